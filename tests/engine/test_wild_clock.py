"""Issue 76, point 2: one record stamped 2099 must not silently drop a stream. With the
default settings of every operator on event time (windows, an event-time TTL,
deduplication, the interval join), the record is refused by name (the epoch fails,
committing nothing; with dead letters it is one), and the records after it are
processed, none late: the default skew guard (one day past the cut's wall clock) keeps
the watermark where the honest clocks are. Spark and Flink would follow the record."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from volley_dagster import EpochRunner, FileLog, MemorySink, Pipeline, count, tumbling
from volley_dagster.errors import MalformedRecordError

NOW_US = int(pd.Timestamp.now(tz="UTC").value // 1000)
HOUR_US = 3_600_000_000
WILD_US = int(pd.Timestamp("2099-01-01", tz="UTC").value // 1000)


def write(folder: Path, index: int, ids: list[int], times: list[int]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": pa.array(ids, pa.int64()), "k": pa.array([i % 5 for i in ids], pa.int64()),
                             "t": pa.array(times, pa.int64()).cast(pa.timestamp("us", tz="UTC"))}),
                   folder / f"events-{index:06d}.parquet")


def pipeline(kind: str, events: Path) -> Pipeline:
    """``kind``'s operator, every event-time setting left at its default."""
    if kind == "join":
        return (Pipeline("wild").sources({"a": FileLog(events / "a"), "b": FileLog(events / "b")})
                .join(left="a", right="b", on="k", left_time="t", right_time="t", between=("-1 hour", "+1 hour"),
                      how="left").sink(MemorySink()))
    base = Pipeline("wild").source(FileLog(events / "a"))
    if kind == "window":
        return base.key_by("k").window(tumbling("10 minutes"), on="t").aggregate(n=count()).sink(MemorySink())
    if kind == "ttl":
        return base.key_by("k").aggregate(n=count(), ttl="30 days", event_time="t").sink(MemorySink())
    return base.deduplicate(on="id", within="10 minutes", event_time="t").sink(MemorySink())


@pytest.mark.parametrize("kind", ["window", "ttl", "dedup", "join"])
def test_one_record_stamped_2099_is_refused_and_the_stream_goes_on(spark, tmp_path, kind):
    events = tmp_path / "events"
    before = NOW_US - HOUR_US
    for side in ("a", "b") if kind == "join" else ("a",):
        write(events / side, 0, list(range(20)), [before + i * 1_000_000 for i in range(20)])
    runner = EpochRunner(pipeline(kind, events), tmp_path / "state", spark=spark)
    first = runner.run_next()
    assert first is not None and first.records_in == (40 if kind == "join" else 20)

    write(events / "a", 1, [1000], [WILD_US])
    with pytest.raises(MalformedRecordError, match=r"max_event_time_skew") as refused:
        runner.run_next()  # the defaults: the record is named, nothing is committed
    assert "events-000001.parquet" in str(refused.value)
    assert runner.committed_epoch() == 1

    runner = EpochRunner(pipeline(kind, events).on_bad_records("dead_letter"), tmp_path / "state", spark=spark)
    wild = runner.run_next()
    assert wild is not None and wild.dead_letters == 1 and wild.watermark is not None and wild.watermark < NOW_US
    later = before + 5 * 60_000_000
    for side in ("a", "b") if kind == "join" else ("a",):
        write(events / side, 2, list(range(100, 120)), [later + i * 1_000_000 for i in range(20)])
    after = runner.run_next()
    assert after is not None and after.records_in == (40 if kind == "join" else 20)
    assert after.late_records == 0 and after.figures.get("dedup_late", 0) == 0, "later records dropped as late"
    if kind == "dedup":
        assert after.records_out == 20  # new ids, all kept
    if kind == "join":
        assert after.figures["join_pairs"] > 0


def test_a_carried_time_past_year_9999_is_a_bad_record_not_a_stall(spark, tmp_path):
    """Review J4: Spark writes a timestamp of year 10000 as ``+10000-...``, which the
    join's state could not read back, so every attempt failed. Such a record is a bad
    record, named (the epoch fails) or a dead letter; the others join."""
    events = tmp_path / "events"
    before = NOW_US - HOUR_US
    write(events / "b", 0, list(range(5)), [before + i for i in range(5)])
    (events / "a").mkdir(parents=True)
    year_10000 = pa.array([253_402_300_800_000_000 + 86_400_000_000], pa.int64())  # 10000-01-02T00:00:00Z
    pq.write_table(pa.table({
        "id": pa.array(range(5), pa.int64()), "k": pa.array([i % 5 for i in range(5)], pa.int64()),
        "t": pa.array([before + i for i in range(5)], pa.int64()).cast(pa.timestamp("us", tz="UTC")),
        "until": pa.concat_arrays([year_10000, pa.array([before] * 4, pa.int64())]).cast(pa.timestamp("us", tz="UTC")),
    }), events / "a" / "events-000000.parquet")
    with pytest.raises(MalformedRecordError, match=r"a time outside years 1-9999: 'until' of 'a'"):
        EpochRunner(pipeline("join", events), tmp_path / "state", spark=spark).run_next()
    runner = EpochRunner(pipeline("join", events).on_bad_records("dead_letter"), tmp_path / "state", spark=spark)
    result = runner.run_next()
    assert result is not None and result.dead_letters == 1 and result.figures["join_pairs"] == 4
