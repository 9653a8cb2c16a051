"""Random streams, random cuts of them into epochs, and the driver that runs a cut
through the engine (real Spark, RocksDB and a Delta table), for the property tests
against the references in ``tests/ttl_reference.py``, ``tests/window_reference.py``
and ``tests/dedup_reference.py``.

A stream is a list of records in log order: int or string keys (a few, so keys
repeat; now and then a null one), amounts with nulls, NaN and infinities, event times
that move on by a few seconds with disorder, now and then a gap longer than the skew,
a null one or one far in the future (two days past the wall clock: past any
``max_event_time_skew`` the tests set), and re-sends of earlier records. Event times
are relative to a start six hours before now (``materialise``): the skew guard is
judged against the wall clock of each cut.

A plan cuts the stream twice over: into log files (written as the cuts need them,
so the log grows while it is read), and into epochs (``max_records_per_epoch`` set
before each cut, so epochs end mid-file or span files; an empty epoch is cut where
every written file has been read). A plan may crash one epoch: the attempt stops at
a fault point after its snapshots, or after its Delta commit, or after every sink and
before its manifest, and a new runner (a restarted process) runs it again.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator
from unittest import mock

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import DeltaTable
from hypothesis import event, settings
from hypothesis import strategies as st

from tests.helpers import tree_digest
from volley_dagster import EpochRunner, faults
from volley_dagster.result import EpochResult
from volley_dagster.sinks.delta import DeltaSink

DEEP = os.environ.get("VOLLEY_DEEP") == "1"
PROFILE = "volley-properties-deep" if DEEP else "volley-properties"  # registered in conftest.py
EXAMPLES: Counter[str] = Counter()  # examples run per test, printed at the end of the session (conftest.py)

KEY, ID, SOURCE = "merchant_id", "event_id", "source"
SECOND = 1_000_000
MINUTE = 60 * SECOND
HOUR = 60 * MINUTE
FAR = "far"  # an event time two days past the wall clock
SKEW = "10 minutes"  # every test's max_event_time_skew, when it sets one
GAP = (15 * MINUTE, 70 * MINUTE)  # a pause in the stream: longer than SKEW
DISORDER = 20 * SECOND  # how far an event time lies before the latest one
MAX_RECORDS = 48 if DEEP else 20
MAX_EPOCHS = 6 if DEEP else 4
CRASH_POINTS = ("after_snapshot", "after_sink_delta", "after_sinks")


def profile(default_examples: int) -> settings:
    """The settings of a property test: ``default_examples`` in the default lane
    (derandomized: CI runs the same examples every time), the deep profile's many with
    ``VOLLEY_DEEP=1``."""
    base = settings.get_profile(PROFILE)
    return base if DEEP else settings(base, max_examples=default_examples)


@dataclass(frozen=True)
class Record:
    event_id: int | str | None
    key: int | str | None
    amount: float | None
    t: int | str | None  # microseconds after the stream's start; FAR; None: a null event time
    source: str | None = None  # a second deduplication column


@dataclass(frozen=True)
class Stream:
    records: tuple[Record, ...]
    key_kind: str  # "int" | "str"
    id_kind: str = "int"  # "int" | "str"


def _amounts() -> st.SearchStrategy[float | None]:
    finite = st.integers(-100_000, 100_000).map(lambda cents: cents / 100)
    return st.sampled_from(["finite"] * 12 + ["null", "nan", "inf", "-inf"]).flatmap(
        lambda kind: finite if kind == "finite" else st.just(
            None if kind == "null" else float(kind)))  # float("nan"), float("inf"), float("-inf")


def key_pools(kind: str) -> st.SearchStrategy[list[Any]]:
    """A few keys, so they repeat: ints (small ones, or anywhere in int64) or short strings."""
    values: st.SearchStrategy[Any] = (
        st.one_of(st.integers(-3, 6), st.integers(-(2**63), 2**63 - 1)) if kind == "int"
        else st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=4))
    return st.lists(values, min_size=1, max_size=5, unique=True)


@st.composite
def streams(draw: st.DrawFn, key_kind: str, *, id_kind: str = "int", new_amounts: bool = False,
            sources: bool = False, null_ids: bool = False, min_records: int = 4) -> Stream:
    """A random stream (see the module docstring). ``id_kind``: event ids as ints or
    ``e-<n>`` strings; ``null_ids``: now and then a null one; ``new_amounts``: a re-send
    carries another amount (so a total tells which copy was kept); ``sources``: a
    second key column for deduplication, null now and then."""
    pool = draw(key_pools(key_kind))
    n = draw(st.integers(min_records, MAX_RECORDS))
    records: list[Record] = []
    clock = 0
    for i in range(n):
        step = draw(st.sampled_from(["step"] * 15 + ["gap"]))
        clock += draw(st.integers(0, 4 * SECOND)) if step == "step" else draw(st.integers(*GAP))
        what = draw(st.sampled_from(["fresh"] * 6 + ["resend", "reuse"]))
        if what == "resend" and records:  # the same event again: its id and event time
            copy = draw(st.sampled_from(records))
            amount = draw(_amounts()) if new_amounts else copy.amount
            records.append(Record(copy.event_id, copy.key, amount, copy.t, copy.source))
            continue
        when = draw(st.sampled_from(["time"] * 20 + ["null", "far"]))
        t: int | str | None = clock - draw(st.integers(0, DISORDER)) if when == "time" else (
            None if when == "null" else FAR)
        key = draw(st.sampled_from(pool)) if draw(st.sampled_from(["key"] * 14 + ["null"])) == "key" else None
        event_id: int | str | None = i if id_kind == "int" else f"e-{i}"
        if what == "reuse" and records:  # an earlier id at a new event time
            event_id = draw(st.sampled_from(records)).event_id
        elif null_ids and draw(st.sampled_from(["id"] * 14 + ["null"])) == "null":
            event_id = None  # a null deduplication key: a bad record
        source = draw(st.sampled_from(["a", "a", "b", None])) if sources else None
        records.append(Record(event_id, key, draw(_amounts()), t, source))
    return Stream(tuple(records), key_kind, id_kind)


@dataclass(frozen=True)
class Plan:
    """``files``: the log's file boundaries (record indices); ``epochs``: the record
    range of each epoch, in order; ``crash``: (epoch, fault point) of the attempt that dies."""

    files: tuple[int, ...]
    epochs: tuple[tuple[int, int], ...]
    crash: tuple[int, str] | None = None


@st.composite
def plans(draw: st.DrawFn, n: int, *, empty_epochs: bool = True, crash: bool = True) -> Plan:
    """Random cuts of ``n`` records into files and epochs (at least one record an epoch
    unless ``empty_epochs``: then some may be empty, after the first record, and up to
    two more at the end)."""
    k = draw(st.integers(1, MAX_EPOCHS))
    points = sorted(draw(st.lists(st.integers(0, n), min_size=k - 1, max_size=k - 1)))
    bounds = [0, *points, n]
    # no empty epoch before the first record: the log has no file yet, so no schema to read
    epochs = [(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if a < b or (empty_epochs and a > 0)]
    if empty_epochs:
        epochs += [(n, n)] * draw(st.integers(0, 2))
    splits = set(draw(st.lists(st.integers(1, max(1, n - 1)), max_size=4)))
    splits |= {a for a, b in epochs if a == b}  # an empty epoch is cut where every written file was read
    files = tuple(sorted(s for s in splits if 0 < s < n)) + (n,)
    crashed = None
    if crash:
        crashed = (draw(st.integers(1, len(epochs))), draw(st.sampled_from(CRASH_POINTS)))
    return Plan(files, tuple(epochs), crashed)


def start_us() -> int:
    """Where the stream's event times start: six hours before now, on the hour."""
    return (time.time_ns() // 1000 // HOUR - 6) * HOUR


def materialise(stream: Stream, start: int) -> pa.Table:
    """The stream as the log's rows: ``event_time`` as timestamps from ``start``."""
    far = time.time_ns() // 1000 + 48 * HOUR
    key_type = pa.int64() if stream.key_kind == "int" else pa.string()
    id_type = pa.int64() if stream.id_kind == "int" else pa.string()
    times = [None if r.t is None else far if r.t == FAR else start + int(r.t) for r in stream.records]
    return pa.table({
        ID: pa.array([r.event_id for r in stream.records], id_type),
        KEY: pa.array([r.key for r in stream.records], key_type),
        "amount": pa.array([r.amount for r in stream.records], pa.float64()),
        "status": pa.array(["active"] * len(stream.records), pa.string()),
        "event_time": pa.array(times, pa.int64()).cast(pa.timestamp("us", tz="UTC")),
        SOURCE: pa.array([r.source for r in stream.records], pa.string()),
    })


def file_name(index: int) -> str:
    return f"events-{index:06d}.parquet"


def located(log: pa.Table, plan: Plan) -> pa.Table:
    """``log`` with ``file`` and ``offset``: where the plan's files put each record."""
    files, offsets, first = [], [], 0
    for index, end in enumerate(plan.files):
        files += [file_name(index)] * (end - first)
        offsets += list(range(end - first))
        first = end
    return (log.append_column("file", pa.array(files, pa.string()))
            .append_column("offset", pa.array(offsets, pa.int64())))


class Crash(BaseException):
    """The process dies here (nothing in the engine catches a BaseException)."""


@contextlib.contextmanager
def crash_at(point: str, epoch: int) -> Iterator[None]:
    """The driver stops at ``point`` of ``epoch``, as ``VOLLEY_KILL_AT`` would kill it."""
    real = faults.fault_point

    def fault_point(name: str, at: int, *, pid: int | None = None, shard: int | None = None) -> None:
        if name == point and at == epoch:
            raise Crash(f"{point} of epoch {epoch}")
        real(name, at, pid=pid, shard=shard)

    with mock.patch.object(faults, "fault_point", fault_point):
        yield


@dataclass
class Epoch:
    """One committed epoch: its result, its records (``located``), when it was cut,
    and its side outputs by where each record is in the log."""

    result: EpochResult
    records: pa.Table
    cut_at_us: int
    dead: set[tuple[str, int]] = field(default_factory=set)
    late: set[tuple[str, int, int]] = field(default_factory=set)  # (file, offset, window start)
    duplicates: list[tuple[str, int, str]] = field(default_factory=list)  # (file, offset, reason), in log order


MOMENTS = ("before_cut", "after_cut", "after_crash")  # when run_plan calls its ``at``, per epoch


def run_plan(make_runner: Callable[[], EpochRunner], events: Path, log: pa.Table, plan: Plan,
             delta_uri: Path, at: Callable[[str, int], None] | None = None) -> tuple[EpochRunner, list[Epoch]]:
    """Write the log file by file and cut and run the plan's epochs; the crashed epoch
    is run again by a new runner, then once more (committed: nothing may change).
    ``at(moment, epoch)`` runs at each of ``MOMENTS`` of each epoch (``after_crash``:
    between the crashed attempt and the retry), for what changes beside the log (a
    dimension table rewritten)."""
    moment = at or (lambda _moment, _epoch: None)
    events.mkdir(parents=True, exist_ok=True)
    rows = located(log, plan)
    event(f"epochs: {len(plan.epochs)}, records: {log.num_rows}, files: {len(plan.files)}")
    if plan.crash is not None:
        event(f"crash: {plan.crash[1]}")
    runner = make_runner()
    written, starts = 0, [0, *plan.files[:-1]]
    epochs: list[Epoch] = []
    for number, (a, b) in enumerate(plan.epochs, start=1):
        while written < len(plan.files) and starts[written] < b:  # the files this epoch reads into
            pq.write_table(log.slice(starts[written], plan.files[written] - starts[written]),
                           events / file_name(written))
            written += 1
        runner.settings = replace(runner.settings, max_records_per_epoch=b - a if b > a else 1)
        moment("before_cut", number)
        rng = runner.cut_next(allow_empty=True)
        assert rng is not None and rng.epoch == number and rng.records == b - a, (number, rng)
        assert rng.cut_at_us is not None
        moment("after_cut", number)
        if plan.crash is not None and plan.crash[0] == number:
            with crash_at(plan.crash[1], number), contextlib.suppress(Crash):
                runner.run(number)
                raise AssertionError(f"epoch {number} did not reach {plan.crash[1]}")
            assert runner.committed_epoch() == number - 1
            moment("after_crash", number)
            runner = make_runner()  # a restarted process: new sinks, no loaded tables
            result = runner.run_next()
            assert result is not None and result.epoch == number
            before = (tree_digest(runner.log.root), DeltaTable(str(delta_uri)).version())
            again = runner.run(number)  # committed: its recorded result, nothing run, nothing written
            assert again.already_committed and again.to_manifest() == result.to_manifest()
            assert (tree_digest(runner.log.root), DeltaTable(str(delta_uri)).version()) == before
        else:
            result = runner.run(number)
        epochs.append(_epoch(runner, result, rows.slice(a, b - a), rng.cut_at_us))
    for what, n in (("dead letters", sum(e.result.dead_letters for e in epochs)),
                    ("late records", sum(e.result.late_records for e in epochs)),
                    ("duplicates", sum(e.result.figures.get("duplicates", 0) for e in epochs)),
                    ("late copies", sum(e.result.figures.get("dedup_late", 0) for e in epochs)),
                    ("expired keys", sum(e.result.figures.get("keys_expired", 0) for e in epochs)),
                    ("empty epochs", sum(e.result.records_in == 0 for e in epochs))):
        if n:
            event(f"with {what}")
    return runner, epochs


def _epoch(runner: EpochRunner, result: EpochResult, records: pa.Table, cut_at_us: int) -> Epoch:
    epoch = Epoch(result, records, cut_at_us)
    if result.dead_letter_path is not None:
        dead = pq.read_table(runner.log.root / result.dead_letter_path)
        epoch.dead = set(zip(dead.column("file").to_pylist(), dead.column("offset").to_pylist(), strict=True))
    late = runner.late_records(result.epoch)
    if late is not None:
        epoch.late = set(zip(late.column("file").to_pylist(), late.column("offset").to_pylist(),
                             late.column("window_start").cast(pa.int64()).to_pylist(), strict=True))
    duplicates = runner.duplicate_records(result.epoch)
    if duplicates is not None:
        epoch.duplicates = list(zip(duplicates.column("file").to_pylist(), duplicates.column("offset").to_pylist(),
                                    duplicates.column("reason").to_pylist(), strict=True))
    return epoch


def where(records: pa.Table, rows: list[int]) -> list[tuple[str, int]]:
    """(file, offset) of the epoch's ``rows``."""
    files, offsets = records.column("file").to_pylist(), records.column("offset").to_pylist()
    return [(files[r], offsets[r]) for r in rows]


def delta_sink(runner: EpochRunner) -> DeltaSink:
    return next(s for s in runner.pipeline.sinks if isinstance(s, DeltaSink))


def one_commit_each(runner: EpochRunner, epochs: list[Epoch]) -> None:
    """The Delta table holds each epoch once, with the rows the epoch emitted."""
    delta = delta_sink(runner)
    assert delta.epoch_history(runner.pipeline.name) == {e.result.epoch: [e.result.records_out] for e in epochs}


def by_key(table: pa.Table) -> dict[object, dict[str, object]]:
    """An upsert table's (or state's) rows by key, as ``same_values`` expects them."""
    return {row[KEY]: row for row in table.to_pylist()}


def is_nan(value: object) -> bool:
    return isinstance(value, float) and math.isnan(value)
