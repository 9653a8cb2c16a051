"""The epoch log: what each epoch reads, and whether it committed.

Layout under the checkpoint root::

    pipeline.json                      identity: layout the state was first written with, and the lineage
    lineage.json                       the lineage of a root from before lineages were kept in pipeline.json
    sinks/delta.json                   a sink that held another lineage's epochs: what it chose (once)
    layouts/0000000001.json            a committed rescale: epochs from N on run with S shards
    epochs/0000000007/offsets.json     the range, written once before the first attempt
    epochs/0000000007/manifest.json    the commit point, written last
    epochs/0000000007/dead_letters.parquet   the side outputs: kept as long as the epoch's snapshots
    epochs/0000000007/late_records.parquet   windows: records whose window had closed
    epochs/0000000007/duplicates.parquet     deduplication (write_duplicates): the records dropped
    epochs/archive/0000000001-0000010000.zip  epochs past retention, their folders compacted (epoch_archive.py)
    retention.json                     the epoch up to which retention removed side outputs
    snapshots/0000000007/rescale-0001-<attempt>/shard-0005/   epoch 7's state rewritten by a rescale
    snapshots/0000000007/shard-0003-<attempt>/   the attempt the manifest names (losers are pruned)
    compacted/0000000007/shard-0003-<attempt>/   its compacted alternate, for epoch 8 (state/compacted.py)
    work/0000000007/shard-0003-<attempt>/  a task attempt's writable DB (deleted after)
    lease/                             the pipeline's lease and fencing tokens (checkpoint/lease.py)

An epoch is committed exactly when its manifest exists; a rescale exactly when
its ``layouts/`` record exists.

The layout history: ``pipeline.json`` holds the layout of epoch 1 (the pipeline's
``with_shards``); each ``layouts/<sequence>.json`` record says that epochs from
``from_epoch`` on run with ``num_shards``, restoring epoch ``from_epoch - 1``'s
state from the record's own snapshots (see ``checkpoint/rescale.py``). The layout
of an epoch is the last record with ``from_epoch`` <= it, else the initial one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from volley_dagster import faults
from volley_dagster.checkpoint.carried import carried_type_changes, without_carried
from volley_dagster.checkpoint.epoch_archive import DEFAULT_SPAN, EpochArchives, epoch_key
from volley_dagster.checkpoint.manifest import ShardSnapshot
from volley_dagster.dimensions.base import TablePin
from volley_dagster.errors import ConfigError, EpochNotCutError, EpochOrderError, StateLayoutError
from volley_dagster.io.atomic import create_json_exclusive, read_json, write_json_atomic
from volley_dagster.json_records import JsonObject
from volley_dagster.result import EpochResult
from volley_dagster.sinks.lineage import Lineage, SinkBinding
from volley_dagster.sources.offsets import EpochRange
from volley_dagster.state.compacted import remove_alternates
from volley_dagster.state.keys import ShardLayout
from volley_dagster.watermarks import Watermarks

LAYOUT_VERSION = 1
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:$")  # "s3:" is what pathlib leaves of "s3://bucket"


def local_root(root: str | os.PathLike[str]) -> Path:
    """The checkpoint root as an absolute local path; ``ConfigError`` for a URI. The
    epoch log relies on exclusive creates, renames and ``flock`` (the lease), which
    only a local or shared POSIX filesystem gives: ``s3://...`` would silently become
    a local folder named ``s3:``. A URI whose ``//`` a ``Path`` join already
    collapsed (``s3:/bucket/...``) is caught by its first component."""
    text = os.fspath(root)
    first = Path(text).parts[0] if Path(text).parts else ""
    if "://" in text or _SCHEME.match(first):
        raise ConfigError(
            f"checkpoint root {text!r} is a URI, but the epoch log (offsets, manifests, the lease) must be on a "
            "local or shared POSIX filesystem: set VOLLEY_CHECKPOINTS (CheckpointResource.root, EpochRunner's "
            "checkpoint_root) to a path, and keep the shard snapshots on S3 with VOLLEY_SNAPSHOT_STORE "
            "(CheckpointResource.snapshot_store_uri, EpochRunner(snapshot_store=S3SnapshotStore(...)))"
        )
    return Path(text).absolute()


@dataclass(frozen=True)
class LayoutChange:
    """One committed rescale or migration (``layouts/<sequence>.json``): epochs from
    ``from_epoch`` on run with ``num_shards`` (and, after a migration, the operator
    ``aggregate`` describes); ``shards`` are epoch ``from_epoch - 1``'s state in that
    layout, as manifest entries (relative snapshot path, file digests, bytes)."""

    sequence: int
    from_epoch: int
    num_shards: int
    num_key_groups: int
    previous_shards: int
    shards: dict[int, ShardSnapshot]
    stats: JsonObject = field(default_factory=dict)  # keys, keys_moved, seconds, bytes_written, created_at
    aggregate: JsonObject | None = None  # a migration's operator layout (None: a rescale keeps the operator)

    @property
    def layout(self) -> ShardLayout:
        return ShardLayout(self.num_shards, self.num_key_groups)

    @property
    def snapshot_epoch(self) -> int:
        """The committed epoch whose state was rewritten."""
        return self.from_epoch - 1

    def to_dict(self) -> JsonObject:
        return {
            "version": LAYOUT_VERSION,
            "sequence": self.sequence,
            "from_epoch": self.from_epoch,
            "num_shards": self.num_shards,
            "num_key_groups": self.num_key_groups,
            "previous_shards": self.previous_shards,
            "shards": {str(shard): snap.to_dict() for shard, snap in sorted(self.shards.items())},
            "stats": self.stats,
            **({"aggregate": self.aggregate} if self.aggregate is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: JsonObject) -> LayoutChange:
        if d.get("version") != LAYOUT_VERSION:
            raise StateLayoutError(f"layout record version {d.get('version')} is unknown; this engine reads {LAYOUT_VERSION}")
        return cls(d["sequence"], d["from_epoch"], d["num_shards"], d["num_key_groups"], d["previous_shards"],
                   {int(s): ShardSnapshot.from_dict(snap) for s, snap in d["shards"].items()}, d.get("stats", {}),
                   d.get("aggregate"))


@dataclass(frozen=True)
class EpochStart:
    """What one epoch starts from (``EpochLog.start_of``): the typed view its attempt
    reads once instead of asking the log one thing at a time."""

    epoch: int
    previous: EpochResult | None  # N-1's manifest (None for epoch 1)
    layout: ShardLayout | None  # the layout N runs with (None before the first epoch ran: the pipeline's)
    shards: dict[int, ShardSnapshot]  # N-1's shard snapshots in that layout, paths relative to the root
    pins: dict[str, TablePin]  # per dimension table: the version N reads

    @property
    def watermark(self) -> int | None:
        """The event time N starts from (windows, event-time TTL, deduplication)."""
        return self.previous.watermark if self.previous is not None else None

    @property
    def watermarks(self) -> Watermarks:
        """The watermark N starts from, with each input's own (a join's sides)."""
        if self.previous is None:
            return Watermarks()
        return Watermarks(self.previous.watermark, dict(self.previous.input_watermarks))


class EpochLog:
    def __init__(self, root: str | os.PathLike[str], archive_span: int = DEFAULT_SPAN) -> None:
        self.root = local_root(root)  # a URI is refused here, whoever opens the log
        self.archives = EpochArchives(self.root / "epochs", archive_span)
        self._heads = {"cut": 0, "committed": 0}  # the last heads found: where the next search starts

    # -- paths ---------------------------------------------------------------------

    def epoch_dir(self, epoch: int) -> Path:
        return self.root / "epochs" / epoch_key(epoch)

    def snapshots_dir(self, epoch: int) -> Path:
        """Where epoch ``epoch``'s shard attempts put their snapshots (``shard-S-<attempt>``)."""
        return self.root / "snapshots" / epoch_key(epoch)

    def work_dir(self, epoch: int) -> Path:
        return self.root / "work" / epoch_key(epoch)

    def dead_letter_path(self, epoch: int) -> Path:
        return self.epoch_dir(epoch) / "dead_letters.parquet"

    def late_records_path(self, epoch: int) -> Path:
        return self.epoch_dir(epoch) / "late_records.parquet"

    def duplicates_path(self, epoch: int) -> Path:
        return self.epoch_dir(epoch) / "duplicates.parquet"

    def side_output_paths(self, epoch: int) -> tuple[Path, ...]:
        """Where an epoch's side outputs are, if it wrote them (retention removes them)."""
        return self.dead_letter_path(epoch), self.late_records_path(epoch), self.duplicates_path(epoch)

    def layout_path(self, sequence: int) -> Path:
        return self.root / "layouts" / f"{sequence:010d}.json"

    def rescale_snapshot_root(self, epoch: int, sequence: int, attempt: str) -> Path:
        """Where a rescale attempt writes epoch ``epoch``'s state in the new layout: inside
        the epoch's snapshot directory, so retention removes it with the epoch."""
        return self.root / "snapshots" / epoch_key(epoch) / f"rescale-{sequence:04d}-{attempt}"

    # -- identity ------------------------------------------------------------------

    def identity(self, epoch: int | None = None) -> JsonObject:
        """The state layout recorded by the first epoch (see ``check_identity``), with the
        operator of the last migration: the one the next epoch runs; with ``epoch``, the
        one ``state_shards(epoch)`` was written by (a migration of epoch E rewrote E's
        state: E reads as the new operator, the epochs before it as the old)."""
        recorded = self._recorded()
        for change in self.layout_changes():
            if change.aggregate is not None and (epoch is None or change.snapshot_epoch <= epoch):
                recorded = {**recorded, "aggregate": change.aggregate}
        return recorded

    def retired_columns(self) -> frozenset[str]:
        """Accumulators an earlier operator layout had and the current one lacks: the
        output columns migrations removed or renamed away."""
        layouts = [self._recorded().get("aggregate")] + [c.aggregate for c in self.layout_changes()]
        names = [{a["name"] for a in layout.get("accumulators", [])} for layout in layouts if layout]
        return frozenset(set().union(*names[:-1]) - names[-1]) if names else frozenset()

    def _recorded(self) -> JsonObject:
        """``pipeline.json``, checked: a file edited by hand or cut short is named, with
        what to do, instead of failing later on a missing key."""
        path = self.root / "pipeline.json"
        try:
            recorded = read_json(path)
        except ValueError as exc:
            raise StateLayoutError(
                f"{path} is not valid JSON ({exc}): it was edited by hand or cut short. It records the layout the "
                "state was written with; restore it from a copy of the checkpoint root (nothing was run)"
            ) from None
        missing = [key for key in _IDENTITY_KEYS if key not in recorded] if isinstance(recorded, dict) else list(_IDENTITY_KEYS)
        layout = recorded.get("layout") if isinstance(recorded, dict) else None
        if not missing and not (isinstance(layout, dict) and "num_shards" in layout):
            missing = ["layout.num_shards"]
        if missing:
            raise StateLayoutError(
                f"{path} lacks {missing}: it was edited by hand. It records the layout the state was written with; "
                "restore it from a copy of the checkpoint root (nothing was run)"
            )
        return recorded

    def has_identity(self) -> bool:
        return (self.root / "pipeline.json").exists()

    def check_identity(self, identity: JsonObject) -> None:
        """Record the pipeline's state layout on first use; refuse a different one later.
        The pipeline's shard count may be the initial one (``with_shards`` is the first
        layout only) or the current one after a rescale; nothing else may change."""
        if not self.has_identity():  # written once: later epochs only read it (a full disk stays readable)
            create_json_exclusive(self.root / "pipeline.json", {**identity, "lineage": uuid.uuid4().hex})
        recorded = {k: v for k, v in self.identity().items() if k != "lineage"}  # the lineage is no layout
        changed = carried_type_changes(recorded.get("aggregate") or {}, identity.get("aggregate") or {})
        if changed:
            raise StateLayoutError(
                f"checkpoint root {self.root}: {'; '.join(changed)}. Rows waiting in state were written with the "
                "recorded type and cannot be read as the new one; nothing was run. Cast the column back to the "
                "recorded type in a transform, or start a new checkpoint root")
        recorded, identity = without_carried(recorded), without_carried(identity)
        if recorded == identity:
            return
        shards = identity.get("layout", {}).get("num_shards")
        current = self.current_layout()
        if _without_shards(recorded) == _without_shards(identity) and current is not None and shards == current.num_shards:
            return
        diff = {k: (recorded.get(k), identity.get(k)) for k in set(recorded) | set(identity) if recorded.get(k) != identity.get(k)}
        rescaled = (
            f" After rescales the state has {current.num_shards} shards (layout history: {self.describe_layouts()});"
            " the pipeline may name the initial or the current shard count."
            if self.layout_changes() and current is not None else ""
        )
        raise StateLayoutError(
            f"checkpoint root {self.root} was written by a different pipeline layout; "
            f"differences (recorded, now): {diff}.{rescaled} Use a new checkpoint root, or rescale "
            "(`volley rescale <root> --shards N`), or migrate the state to the new pipeline (`volley migrate <root> "
            f"--to module:pipeline`, `runner.migrate(pipeline)`, or the job {identity.get('pipeline')}_migrate_job "
            "under Dagster)"
        )

    def lineage(self) -> Lineage:
        """This root's lineage. A root from before lineages gets one now, in ``lineage.json``
        (created exclusively: a concurrent reader adopts the same one), and the sinks'
        unlabelled marks up to its last committed epoch are its own."""
        recorded = self._recorded()
        if "lineage" not in recorded:
            adopted = self.root / "lineage.json"
            if not adopted.exists():
                create_json_exclusive(adopted, {"lineage": uuid.uuid4().hex, "unlabelled_through": self.last_committed()})
            recorded = read_json(adopted)
        return Lineage(recorded["lineage"], int(recorded.get("unlabelled_through", 0)))

    def sink_binding(self, sink: str) -> SinkBinding | None:
        path = self.root / "sinks" / f"{sink}.json"
        return SinkBinding.from_dict(read_json(path)) if path.exists() else None

    def record_sink_binding(self, binding: SinkBinding) -> SinkBinding:
        """Written once, before the first commit under it; a binding recorded first wins."""
        create_json_exclusive(self.root / "sinks" / f"{binding.sink}.json", binding.to_dict())
        recorded = self.sink_binding(binding.sink)
        assert recorded is not None
        return recorded

    # -- layout history ------------------------------------------------------------

    def initial_layout(self) -> ShardLayout | None:
        """The layout of epoch 1 (None before the first epoch ran)."""
        if not self.has_identity():
            return None
        return ShardLayout(**self._recorded()["layout"])

    def layout_changes(self) -> list[LayoutChange]:
        """Committed rescales, in the order they were committed."""
        d = self.root / "layouts"
        if not d.is_dir():
            return []
        paths = sorted(p for p in d.iterdir() if p.suffix == ".json" and p.stem.isdigit())
        return [LayoutChange.from_dict(read_json(p)) for p in paths]

    def layout_for(self, epoch: int) -> ShardLayout | None:
        """The layout epoch ``epoch`` runs with: the last rescale taking effect at or
        before it, else the initial layout (None before the first epoch ran)."""
        return self._layout_for(epoch, self.layout_changes())

    def _layout_for(self, epoch: int, changes: list[LayoutChange]) -> ShardLayout | None:
        effective = [c for c in changes if c.from_epoch <= epoch]
        return effective[-1].layout if effective else self.initial_layout()

    def current_layout(self) -> ShardLayout | None:
        """The layout the next epoch runs with."""
        changes = self.layout_changes()
        return changes[-1].layout if changes else self.initial_layout()

    def layout_history(self) -> list[tuple[int, ShardLayout]]:
        """``(first epoch, layout)`` pairs, oldest first."""
        initial = self.initial_layout()
        history = [(1, initial)] if initial is not None else []
        for change in self.layout_changes():
            if history and history[-1][0] == change.from_epoch:
                history[-1] = (change.from_epoch, change.layout)  # rescaled again at the same boundary
            else:
                history.append((change.from_epoch, change.layout))
        return history

    def describe_layouts(self) -> str:
        return "; ".join(f"from epoch {e}: {layout.num_shards} shards" for e, layout in self.layout_history())

    def state_shards(self, epoch: int) -> dict[int, ShardSnapshot]:
        """A committed epoch's shard snapshots (paths relative to the root) in the newest
        layout they exist in: a rescale's rewrite of the epoch when there is one, else the
        epoch's own (``EpochOrderError`` if it is not committed)."""
        return self._state_shards(self.committed_manifest(epoch), self.layout_changes())

    @staticmethod
    def _state_shards(manifest: EpochResult, changes: list[LayoutChange]) -> dict[int, ShardSnapshot]:
        rewrites = [c for c in changes if c.snapshot_epoch == manifest.epoch]
        if rewrites:
            return dict(rewrites[-1].shards)
        return {shard: entry.snapshot for shard, entry in manifest.shards.items()}

    def start_of(self, epoch: int, pins: dict[str, TablePin]) -> EpochStart:
        """What epoch ``epoch`` starts from, read once for its attempt: N-1's manifest and
        shard snapshots (a rescale's rewrite when there is one), the layout N runs with,
        and ``pins``, the dimension versions N reads (``EpochRunner`` records missing ones)."""
        changes = self.layout_changes()
        previous = self.committed_manifest(epoch - 1) if epoch > 1 else None
        shards = self._state_shards(previous, changes) if previous is not None else {}
        return EpochStart(epoch, previous, self._layout_for(epoch, changes), shards, pins)

    def record_layout_change(self, change: LayoutChange) -> bool:
        """Commit a rescale; False when another rescale took this sequence number first."""
        return create_json_exclusive(self.layout_path(change.sequence), change.to_dict())

    # -- offsets -------------------------------------------------------------------

    def epochs_cut(self) -> list[int]:
        """Every cut epoch, archived ones included: a listing, for inspection only."""
        d = self.root / "epochs"
        if not d.is_dir():
            return []
        archived = self.archives.through()
        return list(range(1, archived + 1)) + sorted(
            int(p.name) for p in d.iterdir() if p.name.isdigit() and int(p.name) > archived and (p / "offsets.json").exists())

    def last_cut(self) -> int:
        return self._head("cut", lambda epoch: (self.epoch_dir(epoch) / "offsets.json").exists())

    def last_committed(self) -> int:
        return self._head("committed", lambda epoch: (self.epoch_dir(epoch) / "manifest.json").exists())

    def _head(self, which: str, present: Callable[[int], bool]) -> int:
        """The last epoch ``present`` (or archived: every archived epoch committed),
        searched from the last head found: two probes while nothing moved."""
        hint = self._heads[which]
        if hint and present(hint):
            head = _last_where(present, start=hint)
        else:
            archived = self.archives.through()
            head = _last_where(lambda epoch: epoch <= archived or present(epoch), start=max(archived, 1))
        self._heads[which] = head
        return head

    def record_offsets(self, rng: EpochRange) -> EpochRange:
        """Write the range unless the epoch was cut already; the recorded one wins."""
        create_json_exclusive(self.epoch_dir(rng.epoch) / "offsets.json", rng.to_dict())
        return self.offsets(rng.epoch)

    def record_dimension_pin(self, epoch: int, pin: TablePin) -> TablePin:
        """Record the version of a dimension table epoch ``epoch`` reads, unless one is
        recorded already (the recorded one wins). Written when the epoch is cut, or by
        its first attempt when the pipeline gained the enrichment after the cut."""
        path = self._pin_path(epoch, pin.table)
        path.parent.mkdir(parents=True, exist_ok=True)
        create_json_exclusive(path, pin.to_dict())
        pinned = self.dimension_pin(epoch, pin.table)
        assert pinned is not None
        return pinned

    def dimension_pin(self, epoch: int, table: str) -> TablePin | None:
        path = self._pin_path(epoch, table)
        if path.exists():
            return TablePin.from_dict(read_json(path))
        archived = self.archives.read(epoch, f"dimensions/{table}.json")
        return TablePin.from_dict(json.loads(archived)) if archived is not None else None

    def drop_dimension_pin(self, epoch: int, table: str, version: str) -> None:
        """Set aside the pin of ``version`` (not another one recorded meanwhile), which
        failed the join's contract, so that no attempt produced output from it (see
        ``spark/enrich.py``): the next attempt pins anew."""
        path = self._pin_path(epoch, table)
        pinned = self.dimension_pin(epoch, table)
        if pinned is not None and pinned.version == version:
            os.replace(path, path.with_name(f"{path.stem}.rejected-{uuid.uuid4().hex[:8]}"))

    def _pin_path(self, epoch: int, table: str) -> Path:
        return self.epoch_dir(epoch) / "dimensions" / f"{table}.json"

    def cut_at(self, epoch: int) -> float:
        """When the epoch's range was recorded (Unix time): how long it has waited to commit."""
        try:
            return (self.epoch_dir(epoch) / "offsets.json").stat().st_mtime
        except FileNotFoundError:
            archived = self.archives.read(epoch, "cut_at")
            if archived is not None:
                return float(archived)
            self.offsets(epoch)  # EpochNotCutError, naming the last cut epoch
            raise

    def offsets(self, epoch: int) -> EpochRange:
        path = self.epoch_dir(epoch) / "offsets.json"
        if not path.exists() and (archived := self.archives.read(epoch, "offsets.json")) is not None:
            return EpochRange.from_dict(json.loads(archived))
        if not path.exists():
            last = self.last_cut()
            raise EpochNotCutError(
                f"epoch {epoch} has no recorded offset range (the last cut epoch is {last}); "
                "epochs are cut in order by the runner, sensor or schedule before they run"
            )
        return EpochRange.from_dict(read_json(path))

    # -- commits -------------------------------------------------------------------

    def is_committed(self, epoch: int) -> bool:
        return (self.epoch_dir(epoch) / "manifest.json").exists() or 1 <= epoch <= self.archives.through()

    def manifest(self, epoch: int) -> EpochResult | None:
        """A committed epoch's recorded result (without its output); None if not committed."""
        path = self.epoch_dir(epoch) / "manifest.json"
        if path.exists():
            return EpochResult.from_manifest(read_json(path))
        archived = self.archives.read(epoch, "manifest.json")
        return EpochResult.from_manifest(json.loads(archived)) if archived is not None else None

    def committed_manifest(self, epoch: int) -> EpochResult:
        """The manifest of an epoch that must be committed (``EpochOrderError`` if not)."""
        manifest = self.manifest(epoch)
        if manifest is None:
            raise EpochOrderError(f"epoch {epoch} is not committed (the last committed epoch is {self.last_committed()})")
        return manifest

    def write_manifest(self, result: EpochResult, layout: ShardLayout | None = None) -> bool:
        """Commit the epoch; False when another attempt committed it first. ``layout``:
        the one the epoch ran with, refused (``StateLayoutError``) when a rescale
        committed another for it meanwhile."""
        if layout is not None and self.layout_for(result.epoch) != layout:
            raise StateLayoutError(
                f"epoch {result.epoch} ran with {layout.num_shards} shards, but a rescale committed meanwhile "
                f"({self.describe_layouts()}); nothing was committed: run the epoch again"
            )
        return create_json_exclusive(self.epoch_dir(result.epoch) / "manifest.json", result.to_manifest())

    # -- retention -----------------------------------------------------------------

    def prune(self, committed: int, keep: int) -> list[int]:
        """Delete snapshots older than the last ``keep`` committed epochs, and those
        epochs' side outputs (dead letters, late records, duplicates: record contents,
        which must not outlive the retention, nor fill the disk); the attempts of
        retained epochs that lost (no manifest or layout record names them); the
        compacted alternates of the epochs before ``committed`` (``state/compacted.py``); and the
        working directories of dead attempts up to ``committed``. Offsets and manifests
        stay: they are the history the UI shows (a manifest still names a pruned side
        output's path and count). Returns the epochs whose snapshots were deleted."""
        self._prune_side_outputs(committed - keep)
        self._compact(committed - keep)
        remove_alternates(self.root, committed)
        removed = []
        snaps = self.root / "snapshots"
        if snaps.is_dir():
            for p in sorted(snaps.iterdir()):
                if not p.name.isdigit() or int(p.name) > committed:
                    continue
                if int(p.name) <= committed - keep:
                    faults.fault_point("during_retention", committed)
                    shutil.rmtree(p)
                    removed.append(int(p.name))
                else:
                    self._remove_lost_attempts(int(p.name), p)
        work = self.root / "work"
        if work.is_dir():
            for p in work.iterdir():
                if p.name.isdigit() and int(p.name) <= committed:
                    _remove_dead_attempts(p)
        return removed

    def _compact(self, through: int) -> None:
        """Move the folders of whole blocks of epochs up to ``through`` (past retention:
        nothing writes them again) into archives (``epoch_archive.py``). The archive is
        written whole first, then the folders go, so a crash between leaves both; the
        next prune removes the folders it left."""
        newest = self.archives.last_block()
        archived = newest[1] if newest else 0
        if newest and self.epoch_dir(archived).exists():  # a crash after the archive, before all folders went
            self._remove_epoch_dirs(*newest)
        span = self.archives.span
        for _ in range(_BLOCKS_PER_PRUNE):  # an old root catches up over a few prunes, each kept short
            if archived + span > through:
                break
            first, last = archived + 1, archived + span
            members: dict[str, bytes] = {}
            for epoch in range(first, last + 1):
                folder = self.epoch_dir(epoch)
                if not (folder / "manifest.json").exists():
                    raise EpochOrderError(f"cannot archive epoch {epoch} of {self.root}: it is not committed")
                key = epoch_key(epoch)
                members[f"{key}/cut_at"] = repr((folder / "offsets.json").stat().st_mtime).encode()
                for path in folder.rglob("*.json"):
                    members[f"{key}/{path.relative_to(folder).as_posix()}"] = path.read_bytes()
            self.archives.write(first, last, members)
            faults.fault_point("during_compaction", last)
            self._remove_epoch_dirs(first, last)
            archived = last

    def _remove_epoch_dirs(self, first: int, last: int) -> None:
        for epoch in range(first, last + 1):
            shutil.rmtree(self.epoch_dir(epoch), ignore_errors=True)

    def side_outputs_pruned_through(self) -> int:
        """The epoch up to which retention removed the side outputs (0: never)."""
        path = self.root / "retention.json"
        return int(read_json(path)["side_outputs_through"]) if path.exists() else 0

    def _prune_side_outputs(self, through: int) -> None:
        """Remove the side outputs of the epochs up to ``through`` that the last prune did
        not reach: from ``retention.json``'s mark on, so one prune costs the epochs it
        newly expires, not the age of the pipeline (the first on a root written before
        side outputs were pruned sweeps its whole history, once). The mark moves only
        after the files are gone, so a crash in between redoes the same deletions. It
        is a mark, not the snapshots' listing: a root whose executors keep snapshots
        only on S3 may hold no snapshot folder of an epoch whose side outputs it holds."""
        start = self.side_outputs_pruned_through()
        if through <= start:
            return
        for epoch in range(start + 1, through + 1):
            for path in self.side_output_paths(epoch):
                path.unlink(missing_ok=True)
        write_json_atomic(self.root / "retention.json", {"side_outputs_through": through})

    def _remove_lost_attempts(self, epoch: int, snapshots: Path) -> None:
        """A committed epoch's snapshot directories that no record names: attempts that
        lost to the one the manifest names, and rescale attempts that never committed.
        Hidden temporaries are left to the epoch's own removal (one may be in flight)."""
        manifest = self.manifest(epoch)
        records = [{s: entry.snapshot for s, entry in manifest.shards.items()}] if manifest else []
        records += [change.shards for change in self.layout_changes() if change.snapshot_epoch == epoch]
        named = {(self.root / snap.path).relative_to(snapshots).parts[0]
                 for shards in records for snap in shards.values()}
        for entry in snapshots.iterdir():
            if not entry.name.startswith(".") and entry.name not in named:
                shutil.rmtree(entry, ignore_errors=True)

    def retained_epochs(self, committed: int, keep: int) -> list[int]:
        """The committed epochs whose snapshots retention keeps after ``committed``, from
        the manifests: what the snapshot store keeps, whatever this machine's disk holds."""
        return [e for e in range(max(1, committed - keep + 1), committed + 1) if self.is_committed(e)]

    def retained_snapshots(self) -> list[int]:
        snaps = self.root / "snapshots"
        return sorted(int(p.name) for p in snaps.iterdir() if p.name.isdigit()) if snaps.is_dir() else []


def _without_shards(identity: JsonObject) -> JsonObject:
    layout = {k: v for k, v in identity.get("layout", {}).items() if k != "num_shards"}
    return {**identity, "layout": layout}


_BLOCKS_PER_PRUNE = 2
_IDENTITY_KEYS = ("pipeline", "layout")  # what every root has recorded since the first release


def _last_where(present: Callable[[int], bool], start: int = 1) -> int:
    """The last epoch for which ``present`` holds, where it holds for epochs 1..k and for
    none after them: epochs are cut in order, and each commits only after the one before
    it. From ``start`` (a known head, or 1), galloping, then bisecting: about 2 log2 of
    the distance in probes, so the head of a log of half a million epochs costs what one
    of a thousand does, not a listing of the folder; two probes when nothing moved."""
    if not present(start):
        return 0 if start == 1 else _last_where(present)
    low, high, step = start, start + 1, 1
    while present(high):
        low, step = high, step * 2
        high = low + step
    while high - low > 1:  # present(low), not present(high)
        mid = (low + high) // 2
        low, high = (mid, high) if present(mid) else (low, mid)
    return low


def _remove_dead_attempts(epoch_work: Path) -> None:
    """Remove an epoch's working directories whose RocksDB no process holds open: a
    paused or still running attempt (a retry's twin, another runner's) keeps its own."""
    for attempt in epoch_work.iterdir():
        if not _rocksdb_in_use(attempt):
            shutil.rmtree(attempt, ignore_errors=True)
    with contextlib.suppress(OSError):
        epoch_work.rmdir()  # only once empty


def _rocksdb_in_use(path: Path) -> bool:
    """Whether a process holds a RocksDB under ``path`` open: RocksDB keeps a POSIX
    lock on its ``LOCK`` file while open, and the kernel drops it when the process dies."""
    locks = [path / "LOCK"] if (path / "LOCK").exists() else list(path.rglob("LOCK")) if path.is_dir() else []
    for lock in locks:
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        finally:
            os.close(fd)  # never this process's own database: the driver opens none under work/
    return False
