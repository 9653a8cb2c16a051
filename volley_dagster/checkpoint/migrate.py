"""Evolving a pipeline at an epoch boundary without starting over: the last committed
epoch's state is rewritten into the new pipeline's record layout and recorded in
the epoch log, as a rescale is (``checkpoint/rescale.py`` does the rewrite, with a
value conversion, and commits it with one exclusive layout record), so a crash
leaves the old layout in force or the new one, never a mix. The next epoch runs
the new pipeline.

Supported, each key's state carried over:

- an accumulator added: existing keys start from its declared initial value
  (``count()`` from 0; ``sum_`` from null, or 0 if declared; the others from null),
  so its value means "since the migration epoch" for keys that existed before;
- an accumulator removed;
- an accumulator (an output column) renamed;
- a window's allowed lateness changed (the pending-window bound may change anyway);
- the shard count, in the same rewrite;
- a processor's (``Pipeline.process``) state variable added (it starts empty) or
  dropped (its rows are not copied).

Refused, naming the way out (a new lineage, or re-running the log): a changed key,
pipeline name, operator kind, window definition, event-time column or
out-of-orderness, an accumulator whose type, column or input type changed, or a
processor's state variable whose kind or schema changed.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal, NoReturn

import numpy as np

from volley_dagster.checkpoint.epoch_log import EpochLog
from volley_dagster.checkpoint.lease import PipelineLease
from volley_dagster.checkpoint.rescale import RescaleResult, rescale
from volley_dagster.checkpoint.s3_snapshots import S3SnapshotStore
from volley_dagster.errors import ConfigError, EpochOrderError, StateLayoutError
from volley_dagster.json_records import JsonObject
from volley_dagster.operators.aggregate import ResolvedAggregate
from volley_dagster.operators.base import MigratableOperator, StatefulOperator
from volley_dagster.operators.process_state import COUNTS_NS, TIMERS_NS, TTL_CLOCK
from volley_dagster.operators.recorded import recorded_operator, without_dedup
from volley_dagster.operators.ttl import TOUCHED
from volley_dagster.state.options import RocksDBOptions

WAY_OUT = ("start a new lineage (a new checkpoint root, whose epochs re-read the log from its start; each sink's "
           "on_foreign_lineage decides what its table does with this lineage's rows), or keep the recorded pipeline")
FIXED_WINDOWING = ("windows", "time_column", "out_of_orderness_us")


@dataclass(frozen=True)
class AccumulatorChange:
    name: str  # in the new pipeline (the old name for a removed one)
    change: Literal["kept", "renamed", "added", "removed"]
    source: str | None = None  # the old name it carries the state of
    initial: float | None = None  # added: what existing keys start from (None: the accumulator's blank)

    def describe(self) -> str:
        if self.change == "renamed":
            return f"{self.source!r} renamed to {self.name!r}"
        if self.change == "added":
            start = "null" if self.initial is None else f"{self.initial:g}"
            return f"{self.name!r} added (existing keys start from {start})"
        return f"{self.name!r} {self.change}"


@dataclass(frozen=True)
class StateMigration:
    """The recorded operator, the new one, and how each new accumulator gets its state;
    converts stored values in bulk (one NumPy copy per field)."""

    old: StatefulOperator
    new: StatefulOperator
    accumulators: tuple[AccumulatorChange, ...]
    windowing: tuple[str, ...] = ()  # what changed in the windowing, described

    @property
    def aggregate(self) -> JsonObject:
        return self.new.layout()

    @property
    def changes(self) -> list[str]:
        return [c.describe() for c in self.accumulators if c.change != "kept"] + list(self.windowing)

    def convert(self, namespace: int, values: list[bytes]) -> list[bytes]:
        """The stored records rewritten by the new operator, each accumulator filled by
        ``_fill`` (a deduplication's remembered keys are copied as they are)."""
        new = without_dedup(self.new)
        assert isinstance(new, MigratableOperator), "plan_migration refuses operators without a record migration"
        return new.migrate_records(without_dedup(self.old), values, self._fill)

    def kept(self, namespace: int, entries: Iterator[tuple[bytes, bytes]]) -> Iterator[tuple[bytes, bytes]]:
        return entries

    def _fill(self, out: np.ndarray, rows: np.ndarray, new: ResolvedAggregate) -> None:
        out["_format"] = rows["_format"]
        if TOUCHED in (out.dtype.names or ()):  # a state TTL's stamp (the same TTL: ``plan_migration``)
            out[TOUCHED] = rows[TOUCHED]
        for (name, acc), kind in zip(new.accumulators, new.kinds, strict=True):
            change = next(c for c in self.accumulators if c.name == name and c.change != "removed")
            for field, _ in acc.fields(name, kind):
                if change.source is not None:
                    out[field] = rows[change.source + field[len(name):]]
            if change.change == "added" and change.initial is not None:  # sum_ from 0
                out[f"{name}:v"], out[f"{name}:ok"] = change.initial, True


@dataclass(frozen=True)
class MigrationResult:
    changes: list[str]
    rewrite: RescaleResult

    @property
    def noop(self) -> bool:
        return self.rewrite.noop

    def describe(self) -> str:
        if self.noop:
            return "the pipeline's state layout is unchanged: nothing to migrate"
        r = self.rewrite
        shards = f"; {r.old_shards} -> {r.new_shards} shards" if r.old_shards != r.new_shards else ""
        return (f"migrated epoch {r.epoch}'s state ({', '.join(self.changes) or 'no operator change'}{shards}) in "
                f"{r.seconds:.2f} s: {r.keys:,} keys rewritten; epochs from {r.from_epoch} on run the new pipeline "
                f"(layouts/{r.sequence:010d}.json)")


@dataclass(frozen=True)
class ProcessMigration:
    """A processor's state variables added or dropped: stored rows are copied as they
    are (a variable's namespace comes from its name), a dropped variable's not at all."""

    aggregate: JsonObject  # the new layout
    changes: list[str]
    dropped: frozenset[int]  # the dropped variables' namespaces

    def convert(self, namespace: int, values: list[bytes]) -> list[bytes]:
        return values

    def kept(self, namespace: int, entries: Iterator[tuple[bytes, bytes]]) -> Iterator[tuple[bytes, bytes]]:
        if namespace in self.dropped:
            return iter(())
        if namespace == COUNTS_NS:  # kg | counter: a dropped variable's counter goes with it
            return (e for e in entries if int.from_bytes(e[0][4:6], "big") not in self.dropped)
        if namespace == TIMERS_NS:  # kg | TTL clock | expiry | variable ns | key: a dropped variable's expiry entries
            return (e for e in entries if e[0][4] != TTL_CLOCK or int.from_bytes(e[0][13:15], "big") not in self.dropped)
        return entries


def _shown_variable(v: JsonObject) -> str:
    key = f"{v['key_schema']} -> " if "key_schema" in v else ""
    ttl = f", ttl {v['ttl_us'] // 1000} ms" if "ttl_us" in v else ""
    return f"{v['kind']}<{key}{v['schema']}>{ttl}"


def plan_process_migration(old: JsonObject, new: JsonObject) -> ProcessMigration:
    if "process" not in old or "process" not in new:
        _refuse("the operator changed between a processor (process(...)) and another kind")
    was, now = old["process"], new["process"]
    for field in ("time_mode", "event_time", "out_of_orderness_us"):
        if was[field] != now[field]:
            _refuse(f"the processor's {field.replace('_', ' ')} changed ({was[field]!r} -> {now[field]!r}): its timers "
                    "and the watermark were kept on the recorded clock")
    before = {v["name"]: v for v in was["variables"]}
    after = {v["name"]: v for v in now["variables"]}
    changes = []
    for name, v in after.items():
        if name not in before:
            changes.append(f"state variable {name!r} added (every key starts without it)")
        elif _shown_variable(before[name]) != _shown_variable(v):
            _refuse(f"state variable {name!r} changed from {_shown_variable(before[name])} to {_shown_variable(v)}: "
                    "its stored rows cannot be read as the new type (add it under another name, which starts empty, "
                    "and stop declaring the old one to drop it)")
    dropped = [before[n] for n in before if n not in after]
    changes += [f"state variable {v['name']!r} dropped" for v in dropped]
    return ProcessMigration(new, changes, frozenset(v["ns"] for v in dropped))


def plan_migration(recorded: JsonObject, proposed: JsonObject, renames: Mapping[str, str],
                   initial: Mapping[str, float | None]) -> StateMigration | ProcessMigration:
    """How the recorded state becomes the proposed pipeline's (identities as the epoch
    log records them); ``StateLayoutError`` for a change state cannot follow."""
    for field, what in (("pipeline", "pipeline name"), ("key_column", "key column"), ("key_kind", "key type")):
        if recorded.get(field) != proposed.get(field):
            _refuse(f"the {what} changed ({recorded.get(field)!r} -> {proposed.get(field)!r}): every key's state "
                    "would belong to another key")
    old_layout, new_layout = recorded["aggregate"], proposed["aggregate"]
    if "process" in old_layout or "process" in new_layout:
        if renames or initial:
            raise ConfigError("renames and initial values are for an aggregate's accumulators; a processor's state "
                              "variable is added or dropped by its name in init()")
        return plan_process_migration(old_layout, new_layout)
    if "unique_records" in old_layout or "unique_records" in new_layout:
        _refuse("a pipeline that only deduplicates remembers keys under its recorded deduplication; "
                "start a new checkpoint root for another pipeline")
    if "join" in old_layout or "join" in new_layout:
        _refuse("a join's waiting rows are keyed, dated and bounded by its recorded sides and interval "
                f"({old_layout.get('join')} -> {new_layout.get('join')}); the columns each side carries may come or go "
                "without a migration (a carried column's type may only widen an integer); start a new checkpoint "
                "root for another join")
    if ("windowing" in old_layout) != ("windowing" in new_layout):
        _refuse("the operator changed between a running aggregate and windows")
    for field in ("namespace", "format"):
        if old_layout.get(field) != new_layout.get(field):
            _refuse(f"the state {field} changed ({old_layout.get(field)} -> {new_layout.get(field)})")
    if old_layout.get("ttl") != new_layout.get("ttl"):
        _refuse(f"the state TTL changed ({old_layout.get('ttl')} -> {new_layout.get('ttl')}): every key's expiry "
                "is stamped and indexed under the recorded one; start a new checkpoint root for another TTL")
    if old_layout.get("dedup") != new_layout.get("dedup"):
        _refuse(f"the deduplication changed ({old_layout.get('dedup')} -> {new_layout.get('dedup')}): the keys it "
                "remembers are keyed and dated by the recorded one; start a new checkpoint root for another")
    windowing = _windowing_changes(old_layout.get("windowing"), new_layout.get("windowing"))
    old_specs = {a["name"]: a for a in old_layout["accumulators"]}
    new_specs = {a["name"]: a for a in new_layout["accumulators"]}
    unknown = {k: v for k, v in renames.items() if k not in old_specs or v not in new_specs}
    if unknown:
        raise ConfigError(f"renames {unknown} must map a recorded accumulator ({sorted(old_specs)}) to one of the "
                          f"new pipeline ({sorted(new_specs)})")
    sources = {new: old for old, new in renames.items()}
    changes = []
    for name, spec in new_specs.items():
        source = sources.get(name, name if name in old_specs and name not in renames else None)
        if source is None:
            changes.append(AccumulatorChange(name, "added", initial=_initial(spec, initial.get(name))))
            continue
        was = old_specs[source]
        if (was["type"], was["column"], was["kind"]) != (spec["type"], spec["column"], spec["kind"]):
            _refuse(f"accumulator {name!r} changed from {_show(was)} to {_show(spec)}: its state cannot be carried "
                    "over (add it under another name instead, which starts from its initial value)")
        changes.append(AccumulatorChange(name, "renamed" if source != name else "kept", source))
    used = {c.source for c in changes}
    changes += [AccumulatorChange(name, "removed", name) for name in old_specs if name not in used]
    stray = set(initial) - {c.name for c in changes if c.change == "added"}
    if stray:
        raise ConfigError(f"initial values {sorted(stray)} name no added accumulator; added: "
                          f"{[c.name for c in changes if c.change == 'added']}")
    return StateMigration(recorded_operator(old_layout), recorded_operator(new_layout), tuple(changes), windowing)


def migrate(
    log: EpochLog, proposed: JsonObject, lease: PipelineLease, renames: Mapping[str, str] | None = None,
    initial: Mapping[str, float | None] | None = None, num_shards: int | None = None,
    rocksdb: RocksDBOptions | None = None, verify_checksums: bool = False, uncommitted_ok: bool = False,
    store: S3SnapshotStore | None = None,
) -> MigrationResult:
    """Rewrite the last committed epoch's state for the ``proposed`` pipeline identity
    (and ``num_shards``, and into ``store``), under the pipeline's ``lease``; refused before the first
    epoch, and while an epoch is cut but not committed unless ``uncommitted_ok``
    (``rescale``'s rules)."""
    if not log.has_identity() or log.last_committed() == 0:
        raise EpochOrderError(f"nothing to migrate in {log.root}: no epoch is committed; run the new pipeline")
    recorded = log.identity()
    current = log.current_layout()
    assert current is not None
    shards = num_shards or current.num_shards
    if _without_layout(recorded) == _without_layout(proposed):  # already migrated (a re-run): renames are history
        return MigrationResult([], rescale(log, shards, lease, rocksdb, verify_checksums,
                                           uncommitted_ok=uncommitted_ok, store=store))
    migration = plan_migration(recorded, proposed, renames or {}, initial or {})
    conversion = migration if migration.changes else None
    return MigrationResult(migration.changes, rescale(log, shards, lease, rocksdb, verify_checksums, conversion,
                                                      uncommitted_ok, store))


def _without_layout(identity: JsonObject) -> JsonObject:
    """What a migration changes: everything but the shard layout and the lineage."""
    return {k: v for k, v in identity.items() if k not in ("layout", "lineage")}


def _windowing_changes(old: JsonObject | None, new: JsonObject | None) -> tuple[str, ...]:
    if old is None or new is None:
        return ()
    for field in FIXED_WINDOWING:
        if old[field] != new[field]:
            _refuse(f"the window's {field.replace('_', ' ')} changed ({old[field]} -> {new[field]}): open windows "
                    "and their pending entries were cut by the old one")
    if new["lateness_us"] > old["lateness_us"]:
        # A window fired under the old lateness (end + old <= watermark) would take
        # records again under the new one and fire a second time: a duplicate row on an
        # append sink, a partial one over the complete one on an upsert sink.
        _refuse(f"the window's allowed lateness would grow ({old['lateness_us'] / 1e6:g} s -> "
                f"{new['lateness_us'] / 1e6:g} s): windows already fired under the old lateness would take their late "
                "records again and fire a second time. Lowering it is allowed; to wait longer for late records, "
                "keep the lateness and send them to the late-records output, or start a new checkpoint root")
    if old["lateness_us"] != new["lateness_us"]:
        return (f"allowed lateness {old['lateness_us'] / 1e6:g} s -> {new['lateness_us'] / 1e6:g} s",)
    return ()


def _initial(spec: JsonObject, value: float | None) -> float | None:
    """What an added accumulator's existing keys start from: its blank (count 0, the
    others null), or for ``sum_`` a declared 0."""
    if value is None or (spec["type"] == "Count" and value == 0):
        return None
    if spec["type"] == "Sum" and value == 0:
        return 0.0
    allowed = {"Count": "0", "Sum": "null or 0"}.get(spec["type"], "null")
    raise ConfigError(f"accumulator {spec['name']!r} ({_show(spec)}) can start from {allowed} for existing keys, "
                      f"not {value!r}")


def _show(spec: JsonObject) -> str:
    column = repr(spec["column"]) if spec["column"] is not None else ""
    return f"{spec['type'].lower()}({column}) over {spec['kind'] or 'rows'}"


def _refuse(why: str) -> NoReturn:
    raise StateLayoutError(f"cannot migrate: {why}. Options: {WAY_OUT}")
