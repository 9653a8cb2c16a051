"""Property: the interval join (inner, left, right or full; int or string keys; a random
interval and watermark delay), run through the engine over random streams on both sides
cut at random into epochs, equals ``tests/join_reference.py`` on the same epochs: each
epoch's pairs and outer rows, late records, the rows left waiting and the watermark. One
epoch may crash (after its snapshots, after its Delta commit, or after every sink and
before its manifest) and is run again by a new runner, to the same rows: the Delta
table holds each epoch once. Records with a null key or event time are dead letters."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import given
from hypothesis import strategies as st

from tests.join_reference import JoinReference, Row
from tests.properties.streams import CRASH_POINTS, EXAMPLES, SECOND, Crash, crash_at, key_pools, profile, start_us
from volley_dagster import EpochResult, EpochRunner, FileLog, Pipeline
from volley_dagster.operators.join import JoinHow
from volley_dagster.sinks.delta import DeltaSink

Record = tuple[int, object, int | None, int]  # side, key (None: null), time offset (None: null), id


@st.composite
def two_sided(draw: st.DrawFn, kind: str) -> list[list[Record]]:
    """Records of both sides in arrival order, cut into epochs (the first has both sides)."""
    pool = draw(key_pools(kind))
    n = draw(st.integers(2, 30))
    clock, records = 0, []
    for i in range(n):
        clock += draw(st.integers(0, 6 * SECOND))
        side = i if i < 2 else draw(st.integers(0, 1))  # both sides from the first epoch on: each has a schema
        key = draw(st.sampled_from(pool)) if draw(st.integers(0, 15)) else None
        t = clock - draw(st.integers(0, 20 * SECOND)) if draw(st.integers(0, 20)) else None
        records.append((side, key, t, i))
    cuts = sorted(set(draw(st.lists(st.integers(2, n), max_size=4))))
    bounds = [0, *[c for c in cuts if c < n], n]
    return [records[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]


def _write(base: Path, epoch: int, records: list[Record], kind: str, start: int) -> None:
    key_type = pa.int64() if kind == "int" else pa.string()
    ts = pa.timestamp("us", tz="UTC")
    for side, folder, time_column, value in ((0, "left", "lt", "lv"), (1, "right", "rt", "rv")):
        rows = [r for r in records if r[0] == side]
        if rows:
            (base / folder).mkdir(parents=True, exist_ok=True)
            values = pa.array([f"v{r[3]}" for r in rows]) if side == 0 else pa.array([float(r[3]) for r in rows])
            pq.write_table(pa.table({"k": pa.array([r[1] for r in rows], key_type),
                                     time_column: pa.array([None if r[2] is None else start + r[2] for r in rows],
                                                           pa.int64()).cast(ts),
                                     value: values}), base / folder / f"part-{epoch:04d}.parquet")


@dataclass(frozen=True)
class JoinCase:
    """A drawn join: its keys, kind, interval and delay, its epochs and the crashed one."""

    kind: str
    how: JoinHow
    lower: int
    upper: int
    delay: int
    epochs: list[list[Record]]
    crash: tuple[int, str]

    def join(self, pipeline: Pipeline) -> Pipeline:
        """``pipeline``'s two sources ``left`` and ``right`` joined as drawn."""
        return pipeline.join(left="left", right="right", on="k", left_time="lt", right_time="rt",
                             between=(timedelta(microseconds=self.lower), timedelta(microseconds=self.upper)),
                             how=self.how, max_out_of_orderness=timedelta(microseconds=self.delay))

    def valid(self, records: list[Record], start: int) -> list[Row]:
        """An epoch's records as the reference takes them (null keys and times are dead letters)."""
        return [(s, k, start + t, f"v{i}" if s == 0 else float(i)) for s, k, t, i in records
                if k is not None and t is not None]


def draw_case(data: st.DataObject) -> JoinCase:
    kind = data.draw(st.sampled_from(["int", "str"]), label="keys")
    how = data.draw(st.sampled_from(["inner", "left", "right", "full"]), label="how")
    lower = data.draw(st.integers(-20, 5), label="lower s") * SECOND
    upper = lower + data.draw(st.integers(0, 25), label="width s") * SECOND
    delay = data.draw(st.integers(0, 10), label="max_out_of_orderness s") * SECOND
    epochs = data.draw(two_sided(kind), label="epochs")
    crash = (data.draw(st.integers(1, len(epochs)), label="crash epoch"),
             data.draw(st.sampled_from(CRASH_POINTS), label="crash point"))
    return JoinCase(kind, how, lower, upper, delay, epochs, crash)


def run_case(case: JoinCase, base: Path, start: int,
             make_runner: Callable[[], EpochRunner]) -> Iterator[tuple[list[Record], EpochResult]]:
    """Each epoch's files written, cut and run; the crashed one run again by a new runner."""
    runner = make_runner()
    for number, records in enumerate(case.epochs, start=1):
        _write(base, number, records, case.kind, start)
        assert runner.cut_next() is not None
        if case.crash[0] == number:
            with crash_at(case.crash[1], number), contextlib.suppress(Crash):
                runner.run(number)
                raise AssertionError(f"epoch {number} did not reach {case.crash[1]}")
            runner = make_runner()  # a restarted process
        yield records, runner.run(number)


@profile(default_examples=2)
@given(data=st.data())
def test_the_join_equals_the_reference(spark, tmp_path_factory, data):
    EXAMPLES["join"] += 1
    case = draw_case(data)
    base, start = tmp_path_factory.mktemp("join"), start_us()

    def make_runner() -> EpochRunner:
        pipeline = (case.join(Pipeline("join").sources({"left": FileLog(base / "left"),
                                                          "right": FileLog(base / "right")}))
                    .sink(DeltaSink(base / "delta", name="delta", mode="append")).on_bad_records("dead_letter")
                    .with_shards(2))
        return EpochRunner(pipeline, base / "state", spark=spark)

    reference = JoinReference(case.lower, case.upper, case.how, case.delay)
    for number, (records, result) in enumerate(run_case(case, base, start, make_runner), start=1):
        valid = case.valid(records, start)
        pairs, outer, late = reference.run(valid)
        got = set(zip(result.output.column("k").to_pylist(), result.output.column("lv").to_pylist(),
                      result.output.column("rv").to_pylist(), strict=True))
        assert got == pairs | outer, f"epoch {number}"
        assert result.records_out == len(got)
        assert result.dead_letters == len(records) - len(valid)
        assert result.late_records == len(late)
        assert result.watermark == reference.watermark
        assert (result.figures["join_left_rows"], result.figures["join_right_rows"]) == reference.held()
    history = DeltaSink(base / "delta", name="delta").epoch_history("join")
    assert sorted(history) == list(range(1, len(case.epochs) + 1))  # each epoch committed once, the crashed one too
