"""``Pipeline.process``'s shard side without Spark, on a real RocksDB: random streams
of keyed records cut into random epochs, each epoch run by ``apply_process`` as a
shard task runs it (late records left out, as the stage does) and compared with the
record-by-record ``tests/process_reference.py``: the rows emitted, the state and the
timers left. Each epoch runs twice: its first attempt's transaction is dropped
unflushed (the attempt died), and the retry must emit exactly the same rows."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import rocksdict
from hypothesis import event, given, settings
from hypothesis import strategies as st

from tests.process_reference import ProcessReference
from tests.processors import Heartbeat, OrderMachine
from volley_dagster import columns
from volley_dagster.demo.velocity import VelocityAlert
from volley_dagster.errors import ConfigError, ProcessorError, is_retryable
from volley_dagster.operators.base import TIMERS_DUE_FROM, ShardStep
from volley_dagster.operators.join import END_OF_STREAM_US
from volley_dagster.operators.process import Processing, ResolvedProcessor
from volley_dagster.operators.process_rows import PackedRows, parse_schema
from volley_dagster.operators.process_state import BY_KEY_NS, COUNTS_NS, TIMERS_NS, apply_process
from volley_dagster.state.keys import ShardLayout, decode_keys
from volley_dagster.state.options import RocksDBOptions
from volley_dagster.state.transaction import ShardTransaction, scan_prefix

LAYOUT = ShardLayout(1, 8)
MINUTE_US = 60_000_000


def _resolved(processor: Any, key: str, output: str, schema: list[tuple[str, str]], lateness_us: int = 0,
              time_mode: str = "EventTime", update: bool = False) -> ResolvedProcessor:
    from pyspark.sql import types as T

    kinds = {"bigint": T.LongType(), "double": T.DoubleType(), "string": T.StringType(),
             "timestamp": T.TimestampType()}
    struct = T.StructType([T.StructField(n, kinds[k]) for n, k in schema])
    from volley_dagster.operators.event_time import EventTime
    clock = EventTime("event_time", lateness_us) if time_mode == "EventTime" else None
    return Processing(processor, output, key, time_mode, clock,  # type: ignore[arg-type]
                      output_mode="update" if update else "append").resolve(struct)


def _table(records: list[dict[str, Any]], key: str, inputs: list[str]) -> pa.Table:
    """One shard's input, as the stage routes it: key, key group, position, rows, input columns."""
    keys = [r[key] for r in records]
    data = {columns.KEY: pa.array(keys, pa.int64()), columns.KEY_GROUP: pa.array([k % 8 for k in keys], pa.int32()),
            columns.POS: pa.array([r["pos"] for r in records], pa.int64()),
            columns.ROWS: pa.array([1] * len(records), pa.int32())}
    for name in inputs:
        values = [r[name] for r in records]
        data[name] = pa.array(values, pa.timestamp("us", tz="UTC")) if name == "event_time" else pa.array(values)
    return pa.table(data)


def _emitted(outputs: list[pa.Array], names: list[str]) -> dict[Any, list[tuple[Any, ...]]]:
    by_key: dict[Any, list[tuple[Any, ...]]] = defaultdict(list)
    table = pa.table(outputs, names=["key", *names])
    for row in table.to_pylist():
        by_key[row["key"]].append(tuple(row[n] for n in names))
    return dict(by_key)


def _expected(rows: list[tuple[Any, tuple[Any, ...]]]) -> dict[Any, list[tuple[Any, ...]]]:
    by_key: dict[Any, list[tuple[Any, ...]]] = defaultdict(list)
    for key, row in rows:
        by_key[key].append(tuple(v.item() if hasattr(v, "item") else v for v in row))
    return dict(by_key)


@st.composite
def streams(draw: st.DrawFn, statuses: bool) -> tuple[list[dict[str, Any]], list[int]]:
    pool = draw(st.lists(st.integers(-4, 6), min_size=1, max_size=4, unique=True))
    n = draw(st.integers(0, 60))
    clock, records = 0, []
    for pos in range(n):
        clock += draw(st.integers(0, 40)) * 1_000_000
        record = {"pos": pos, "key": draw(st.sampled_from(pool)),
                  "event_time": clock - draw(st.integers(0, 90)) * 1_000_000}
        if statuses:
            record["status"] = draw(st.sampled_from(["placed", "paid", "shipped"]))
        else:
            record["amount"] = float(draw(st.integers(1, 500)))
        records.append(record)
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=6)))
    return records, cuts


CASES = {
    "velocity": (lambda: VelocityAlert(window_ms=60_000, threshold=3), "card",
                 ["card", "event_time", "amount"], [("card", "bigint"), ("event_time", "timestamp"), ("amount", "double")]),
    "orders": (lambda: OrderMachine(timeout_ms=120_000), "order_id",
               ["order_id", "event_time", "status"],
               [("order_id", "bigint"), ("event_time", "timestamp"), ("status", "string")]),
    "heartbeat": (lambda: Heartbeat(every_ms=15_000, beats=4), "card", ["card", "event_time", "amount"],
                  [("card", "bigint"), ("event_time", "timestamp"), ("amount", "double")]),
    "orders_processing": (lambda: OrderMachine(timeout_ms=120_000, clock="processing", seen_ttl_ms=20_000), "order_id",
                          ["order_id", "event_time", "status"],
                          [("order_id", "bigint"), ("event_time", "timestamp"), ("status", "string")]),
}


@settings(max_examples=40, deadline=None)
@given(data=st.data())
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_epoch_equals_the_reference_and_a_retry_emits_the_same(tmp_path_factory, case, data):
    factory, key, inputs, schema = CASES[case]
    records, cuts = data.draw(streams(case.startswith("orders")), label="stream")
    processing = case == "orders_processing"
    cut_times = iter(sorted(data.draw(st.lists(st.integers(0, 400_000), min_size=len(cuts) + 1,
                                               max_size=len(cuts) + 1), label="cut times (ms)")))
    lateness = data.draw(st.integers(0, 60), label="out_of_orderness_s") * 1_000_000
    end_of_stream = data.draw(st.booleans(), label="end_of_stream")
    for r in records:
        r[key] = r.pop("key")
    update = data.draw(st.booleans(), label="update") if case == "velocity" else False
    resolved = _resolved(factory(), key, factory().OUTPUT, schema, lateness,
                         "ProcessingTime" if processing else "EventTime", update)
    names = resolved.output_names()
    reference = ProcessReference(factory(), key, "event_time", names, lateness,
                                 "processing" if processing else "event")
    clock_before: int | None = None
    due_from: int | None = None  # the timers a timer's handler registered, still due (the previous epoch's figure)
    db = rocksdict.Rdict(str(tmp_path_factory.mktemp("process") / "db"), RocksDBOptions().build())
    bounds = [0, *cuts, len(records)]
    try:
        for number, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True), start=1):
            last = end_of_stream and b == len(records) and number == len(bounds) - 1
            before = reference.watermark
            now = next(cut_times) * 1000 + data.draw(st.integers(0, 999), label="us")
            rows, late = reference.run([{c: r[c] for c in inputs} | {"pos": r["pos"]} for r in records[a:b]], last,
                                       frame=lambda rs: reference.frame([{c: r[c] for c in inputs} for r in rs]),
                                       processing_us=now)
            late_pos = {r["pos"] for r in late}
            on_time = [r for r in records[a:b] if r["pos"] not in late_pos]
            limit = END_OF_STREAM_US if last else reference.watermark
            step = ShardStep(number, "int", fire_limit=limit, watermark_before=before, watermark=reference.watermark,
                             layout=LAYOUT, shard=0, processing_time=now, processing_time_before=clock_before,
                             due_from=due_from)
            clock_before = now
            first, _ = apply_process(resolved.shard(), ShardTransaction(db), _table(on_time, key, inputs), step)
            txn = ShardTransaction(db)  # the first attempt died unflushed: the retry starts from the same state
            outputs, stats = apply_process(resolved.shard(), txn, _table(on_time, key, inputs), step)
            txn.flush()
            due_from = stats.figures.get(TIMERS_DUE_FROM)
            event(f"timers re-armed at or before the limit: {'some' if due_from is not None else 'none'}")
            assert _emitted(outputs, names) == _emitted(first, names), f"epoch {number}: a retry emitted other rows"
            expected = _expected(rows)
            if update:  # the last row the epoch emitted per key
                expected = {k: v[-1:] for k, v in expected.items()}
            assert _emitted(outputs, names) == expected, f"epoch {number}"
            assert stats.figures["process_rows_in"] == len(on_time)
            event(f"rows out: {'some' if stats.figures['process_rows_out'] else 'none'}")
            event(f"timers fired: {'some' if stats.figures['process_timers_fired'] else 'none'}")
            if processing:
                expired = any(e is not None and e <= now // 1000 for v in reference.access.state.values() for e, _ in v)
                event(f"TTL rows expired: {'some' if expired else 'none'}")
        _state_is_the_reference(db, resolved, reference)
    finally:
        db.close()


def _state_is_the_reference(db: rocksdict.Rdict, resolved: ResolvedProcessor, reference: ProcessReference) -> None:
    """Every variable holds exactly the reference's rows, every timer is indexed once by
    time and once by key, and the counts add up: nothing leaks."""
    expected = {(name, key): [tuple(v.item() if hasattr(v, "item") else v for v in row) for row in rows]
                for (name, key), rows in reference.state().items()}
    found, expires, ttl_blobs = {}, {}, 0
    for var in resolved.variables:
        entries = list(scan_prefix(db, var.ns.to_bytes(2, "big")))
        _, keys = decode_keys("int", [k for k, _ in entries])
        for k, (_, v) in zip(keys.to_pylist(), entries, strict=True):
            rows = var.codec.decode(v)
            if var.ttl_us is not None:  # each row leads with its expiry, in µs
                expires[(var.name, k)] = [r[0] // 1000 for r in rows]
                rows, ttl_blobs = [r[1:] for r in rows], ttl_blobs + 1
            found[(var.name, k)] = rows
    assert found == expected
    assert expires == {k: v for k, v in reference.expiries().items() if k[0] in expires or None not in v}
    timers = reference.timers()
    by_key = list(scan_prefix(db, BY_KEY_NS.to_bytes(2, "big")))
    _, keys = decode_keys("int", [k for k, _ in by_key])
    assert {k: (np.frombuffer(v, [("clock", "u1"), ("time", "<i8")])["time"] // 1000).tolist()
            for k, (_, v) in zip(keys.to_pylist(), by_key, strict=True)} == timers
    assert len(list(scan_prefix(db, TIMERS_NS.to_bytes(2, "big")))) == sum(len(t) for t in timers.values()) + ttl_blobs
    counts = {ns: 0 for ns in (0, *(v.ns for v in resolved.variables))}
    for k, v in scan_prefix(db, COUNTS_NS.to_bytes(2, "big")):
        counts[int.from_bytes(k[4:6], "big")] += int(np.frombuffer(v, "<i8")[0])
    assert counts == {0: sum(len(t) for t in timers.values()),
                      **{v.ns: sum(len(r) for (name, _), r in expected.items() if name == v.name)
                         for v in resolved.variables}}


def test_state_rows_round_trip_every_type_and_refuse_what_does_not_fit():
    import datetime as dt

    import pandas as pd

    codec = PackedRows(parse_schema("ts timestamp, amount double, note string, day date, ok boolean, n tinyint, "
                                    "raw binary", "test"))
    rows = [(pd.Timestamp("2026-01-01 10:00", tz="UTC"), 1.5, "a\x00é😀", dt.date(9999, 12, 31), True, -128, b"\x00"),
            (dt.datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=dt.timezone.utc), None, None, None, None, None, None),
            (np.datetime64("1000-01-01T00:00:00"), float("inf"), "", dt.date(1, 1, 1), False, 127, b"")]
    back = codec.decode(codec.encode(rows, "test"))
    assert [r[1:] for r in back] == [r[1:] for r in rows]
    assert [r[0] for r in back] == [pd.Timestamp("2026-01-01 10:00"), pd.Timestamp("9999-12-31 23:59:59.999999"),
                                    pd.Timestamp("1000-01-01")]
    with pytest.raises(TypeError, match=r"field 'n' \(tinyint\) cannot hold 300"):
        codec.encode([(None, 1.0, "a", None, None, 300, None)], "test")
    with pytest.raises(TypeError, match=r"field 'ts' \(timestamp\) cannot hold 1"):
        codec.encode([(1, 1.0, "a", None, None, 1, None)], "test")
    with pytest.raises(ConfigError, match="field 'xs' has type 'array<int>'"):
        parse_schema("xs array<int>", "state variable 'xs'")


class _Divides:
    """Divides by each record's amount: a zero fails on the record that carries it."""

    def init(self, handle: Any) -> None:
        self.total = handle.getValueState("total", "double")

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
        import pandas as pd

        for frame in rows:
            for amount in frame["amount"].tolist():
                self.total.update(((self.total.get() or (0.0,))[0] + 1 / amount,))
        yield pd.DataFrame({"total": [self.total.get()[0]]})


def test_an_exception_in_the_processor_names_processor_key_and_record_and_is_permanent(tmp_path):
    resolved = _resolved(_Divides(), "card", "total double",
                         [("card", "bigint"), ("event_time", "timestamp"), ("amount", "double")])
    records = [{"pos": p, "card": 7, "event_time": p * MINUTE_US, "amount": a}
               for p, a in enumerate([1.0, 2.0, 4.0, 0.0, 5.0])]
    db = rocksdict.Rdict(str(tmp_path / "db"), RocksDBOptions().build())
    try:
        step = ShardStep(3, "int", fire_limit=0, watermark_before=None, watermark=0, layout=LAYOUT, shard=0)
        with pytest.raises(ProcessorError) as failed:
            apply_process(resolved.shard(), ShardTransaction(db), _table(records, "card", resolved.columns_in), step)
    finally:
        db.close()
    message = str(failed.value)
    assert "processor '_Divides' failed in handleInputRows on key 7, epoch 3, shard 0" in message
    assert "handling position 3" in message and "1 / amount" in message and "ZeroDivisionError: float division by zero" in message
    assert "run epoch 3 again" in message
    assert isinstance(failed.value.__cause__, ZeroDivisionError)
    assert not is_retryable(failed.value)
    db = rocksdict.Rdict(str(tmp_path / "db"), RocksDBOptions().build())
    assert list(db.keys()) == [], "the failed attempt wrote state"
    db.close()


def test_a_processor_is_refused_by_name_before_it_runs():
    class NoRows:
        def init(self, handle: Any) -> None:
            pass

    with pytest.raises(ConfigError, match="lacks handleInputRows"):
        Processing(NoRows(), "x bigint", "card")

    class TwoNames(_Divides):
        def init(self, handle: Any) -> None:
            handle.getValueState("total", "double")
            handle.getValueState("total", "bigint")

    with pytest.raises(ConfigError, match="declared twice, differently"):
        _resolved(TwoNames(), "card", "total double", [("card", "bigint"), ("event_time", "timestamp")])
    with pytest.raises(ConfigError, match=r"time_mode='EventTime'\) needs event_time"):
        Processing(_Divides(), "total double", "card", "EventTime")


def test_a_timer_that_re_arms_itself_fires_once_an_epoch_past_any_jump_of_the_watermark(tmp_path):
    """A heartbeat whose watermark jumps 70 minutes past its record (a backlog caught up,
    the stream's end) beats once an epoch, as in Spark's micro-batches, never looping
    within one: each epoch's figure says where the next one's timers start."""
    resolved = _resolved(Heartbeat(every_ms=60_000, beats=3), "card", Heartbeat.OUTPUT,
                         [("card", "bigint"), ("event_time", "timestamp"), ("amount", "double")])
    db = rocksdict.Rdict(str(tmp_path / "db"), RocksDBOptions().build())
    beats, due_from = [], None
    try:
        for epoch, (records, watermark) in enumerate([([{"pos": 0, "card": 1, "event_time": 0, "amount": 1.0}], 0),
                                                      ([], 70 * MINUTE_US), ([], 70 * MINUTE_US),
                                                      ([], END_OF_STREAM_US)], start=1):
            step = ShardStep(epoch, "int", fire_limit=watermark, watermark_before=None if epoch == 1 else 0,
                             watermark=min(watermark, 70 * MINUTE_US), layout=LAYOUT, shard=0, due_from=due_from)
            txn = ShardTransaction(db)
            outputs, stats = apply_process(resolved.shard(), txn, _table(records, "card", resolved.columns_in), step)
            txn.flush()
            beats.append(list(zip(outputs[1].to_pylist(), outputs[2].to_pylist(), strict=True)))
            due_from = stats.figures.get(TIMERS_DUE_FROM)
    finally:
        db.close()
    assert beats == [[], [(1, 60_000)], [(2, 120_000)], [(3, 180_000)]]
    assert due_from is None


class _Emits:
    """Emits what ``rows`` (a frame factory) gives; ``timer_ms`` registers a timer."""

    def __init__(self, frame: Any = None, timer_ms: int | None = None) -> None:
        self.frame, self.timer_ms = frame, timer_ms

    def init(self, handle: Any) -> None:  # no close(): it is optional, as in Spark
        self.handle = handle

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
        list(rows)
        if self.timer_ms is not None:
            self.handle.registerTimer(self.timer_ms)
        if self.frame is not None:
            yield self.frame(key[0])


@pytest.mark.parametrize(("processor", "error"), [
    (_Emits(timer_ms=1_700_000_000_000_000_000), r"registerTimer\(1700000000000000000\): give milliseconds"),
    (_Emits(lambda key: pd.DataFrame({"a": [1]})), r"an emitted frame lacks output column 'b'"),
    (_Emits(lambda key: pd.DataFrame({"card": ["card-7"], "a": [1], "b": ["x"]})),
     r"an output row's 'card' does not read as the key's type"),
])
def test_what_a_processor_gets_wrong_fails_by_name_and_for_good(tmp_path, processor, error):
    resolved = _resolved(processor, "card", "a bigint, b string", [("card", "bigint"), ("event_time", "timestamp")])
    db = rocksdict.Rdict(str(tmp_path / "db"), RocksDBOptions().build())
    try:
        step = ShardStep(1, "int", fire_limit=0, watermark=0, layout=LAYOUT, shard=0)
        with pytest.raises(ProcessorError, match=error) as failed:
            apply_process(resolved.shard(), ShardTransaction(db),
                          _table([{"pos": 0, "card": 7, "event_time": 0}], "card", ["card", "event_time"]), step)
        assert not is_retryable(failed.value) and "key 7" in str(failed.value)
    finally:
        db.close()


def test_a_processor_without_close_runs():
    resolved = _resolved(_Emits(lambda key: pd.DataFrame({"a": [key], "b": ["x"]})), "card", "a bigint, b string",
                         [("card", "bigint"), ("event_time", "timestamp")])
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        db = rocksdict.Rdict(folder + "/db", RocksDBOptions().build())
        try:
            step = ShardStep(1, "int", fire_limit=0, watermark=0, layout=LAYOUT, shard=0)
            outputs, _ = apply_process(resolved.shard(), ShardTransaction(db),
                                       _table([{"pos": 0, "card": 7, "event_time": 0}], "card",
                                              ["card", "event_time"]), step)
        finally:
            db.close()
    assert [a.to_pylist() for a in outputs] == [[7], [7], ["x"]]


def test_a_migration_that_drops_a_ttl_variable_drops_its_expiry_entries():
    from volley_dagster.checkpoint.migrate import ProcessMigration
    from volley_dagster.operators.process_state import TIMERS_NS, TTL_CLOCK

    def entry(clock: int, tag: int) -> tuple[bytes, bytes]:
        return (TIMERS_NS.to_bytes(2, "big") + (3).to_bytes(2, "big") + bytes([clock]) + bytes(8)
                + tag.to_bytes(2, "big") + b"key", b"")

    kept = list(ProcessMigration({}, [], frozenset({0x1234})).kept(
        TIMERS_NS, iter([entry(TTL_CLOCK, 0x1234), entry(TTL_CLOCK, 0x2222), entry(0, 0x1234)])))
    assert kept == [entry(TTL_CLOCK, 0x2222), entry(0, 0x1234)]  # a user timer's bytes there are its key's
