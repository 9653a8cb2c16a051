"""Property: a team's own processor (``Pipeline.process``: ``tests/processors.OrderMachine``,
value and map state and event-time timers it registers and deletes, or the demo's
``VelocityAlert``, list state and a timer per record; int or string keys; a random
watermark delay), run through the engine over random streams cut at
random into epochs, equals ``tests/process_reference.py`` running the same processor
record by record: each epoch's rows (per key, in the order emitted), late records, dead
letters (a null key or event time), the watermark and the state left. One epoch may
crash (after its snapshots, after its Delta commit, or after every sink and before its
manifest) and is run again by a new runner, to the same rows: the Delta table holds
each epoch once."""

from __future__ import annotations

import contextlib
import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import given
from hypothesis import strategies as st

from tests.process_reference import ProcessReference
from tests.processors import OrderMachine
from tests.properties.streams import CRASH_POINTS, EXAMPLES, SECOND, Crash, crash_at, key_pools, profile, start_us
from volley_dagster import EpochRunner, FileLog, Pipeline
from volley_dagster.demo.velocity import VelocityAlert
from volley_dagster.sinks.delta import DeltaSink

Record = tuple[object, int | None, str, int]  # key (None: null), time offset (None: null), status, id
TIMEOUT_MS = 30_000
PROCESSORS: dict[str, tuple[Callable[[], Any], list[str]]] = {  # each one's output columns after the key
    "orders": (lambda: OrderMachine(TIMEOUT_MS), ["event", "at_ms"]),
    "velocity": (lambda: VelocityAlert(window_ms=20_000, threshold=2), ["alert_at_ms", "payments", "total"]),
}
DDL = {"event": "string", "at_ms": "bigint", "alert_at_ms": "bigint", "payments": "int", "total": "double"}


@st.composite
def epochs_of(draw: st.DrawFn, kind: str) -> list[list[Record]]:
    pool = draw(key_pools(kind))
    n = draw(st.integers(1, 30))
    clock, records = 0, []
    for i in range(n):
        clock += draw(st.integers(0, 8 * SECOND))
        key = draw(st.sampled_from(pool)) if draw(st.integers(0, 15)) else None
        t = clock - draw(st.integers(0, 20 * SECOND)) if draw(st.integers(0, 20)) else None
        records.append((key, t, draw(st.sampled_from(["placed", "paid", "shipped"])), i))
    cuts = sorted(set(draw(st.lists(st.integers(1, n), max_size=4))))
    bounds = [0, *[c for c in cuts if c < n], n]
    return [records[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]


@profile(default_examples=2)
@given(data=st.data())
def test_the_processor_equals_the_reference(spark, tmp_path_factory, data):
    EXAMPLES["process"] += 1
    kind = data.draw(st.sampled_from(["int", "str"]), label="keys")
    make, outputs = PROCESSORS[data.draw(st.sampled_from(sorted(PROCESSORS)), label="processor")]
    delay = data.draw(st.integers(0, 10), label="max_out_of_orderness s") * SECOND
    epochs = data.draw(epochs_of(kind), label="epochs")
    crash = (data.draw(st.integers(1, len(epochs)), label="crash epoch"),
             data.draw(st.sampled_from(CRASH_POINTS), label="crash point"))
    base, start = tmp_path_factory.mktemp("process"), start_us()

    def make_runner() -> EpochRunner:
        pipeline = (Pipeline("orders").source(FileLog(base / "log")).key_by("k")
                    .process(make(), output_schema=", ".join(f"{c} {DDL[c]}" for c in outputs), time_mode="EventTime",
                             event_time="event_time", max_out_of_orderness=f"{delay // SECOND} seconds")
                    .sink(DeltaSink(base / "delta", name="delta", mode="append")).on_bad_records("dead_letter")
                    .with_shards(2))
        return EpochRunner(pipeline, base / "state", spark=spark)

    reference = ProcessReference(make(), "k", "event_time", outputs, delay)
    runner = make_runner()
    for number, records in enumerate(epochs, start=1):
        _write(base / "log", number, records, kind, start)
        assert runner.cut_next() is not None
        if crash[0] == number:
            with crash_at(crash[1], number), contextlib.suppress(Crash):
                runner.run(number)
                raise AssertionError(f"epoch {number} did not reach {crash[1]}")
            runner = make_runner()  # a restarted process
        result = runner.run(number)
        valid = [{"k": k, "event_time": start + t, "status": s, "amount": float(i)} for k, t, s, i in records
                 if k is not None and t is not None]
        rows, late = reference.run(valid)
        emitted = zip(*(result.output.column(c).to_pylist() for c in outputs), strict=True)
        assert _by_key(zip(result.output.column("k").to_pylist(), emitted, strict=True)) == _by_key(rows), \
            f"epoch {number}"
        assert result.dead_letters == len(records) - len(valid)
        assert result.late_records == len(late)
        assert result.watermark == reference.watermark
    _state_is_the_reference(runner, reference)
    history = DeltaSink(base / "delta", name="delta").epoch_history("orders")
    assert sorted(history) == list(range(1, len(epochs) + 1))  # each epoch committed once, the crashed one too


def _by_key(rows: Any) -> dict[Any, list[tuple[Any, ...]]]:
    """Rows per key in the order emitted (keys' order is not the processor's)."""
    out: dict[Any, list[tuple[Any, ...]]] = defaultdict(list)
    for key, row in rows:
        out[key].append(tuple(v.item() if hasattr(v, "item") else v for v in row))
    return dict(out)


def _state_is_the_reference(runner: EpochRunner, reference: ProcessReference) -> None:
    state = runner.read_state()
    got: dict[tuple[str, Any], list[list[Any]]] = defaultdict(list)
    for row in state.to_pylist():
        got[(row["variable"], row["k"])].append(json.loads(row["value"]))
    expected = {(name, key): [[v.item() if hasattr(v, "item") else v for v in r] for r in rows]
                for (name, key), rows in reference.state().items()}
    expected.update({("timer", key): [[t] for t in times] for key, times in reference.timers().items()})
    assert dict(got) == expected


def _write(folder: Path, epoch: int, records: list[Record], kind: str, start: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({
        "k": pa.array([r[0] for r in records], pa.int64() if kind == "int" else pa.string()),
        "event_time": pa.array([None if r[1] is None else start + r[1] for r in records], pa.int64())
        .cast(pa.timestamp("us", tz="UTC")),
        "status": pa.array([r[2] for r in records]),
        "amount": pa.array([float(r[3]) for r in records]),
    }), folder / f"part-{epoch:04d}.parquet")
