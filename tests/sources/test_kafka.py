"""The Kafka source: epochs as recorded offset ranges per topic partition, against the
librdkafka mock cluster (harness/kafka.py) and, where the mock cannot play the case
(partitions added, retention, a re-created topic), against the offsets a broker
reports, through ``plan_cut``."""

from __future__ import annotations

import json
import signal
import time
import uuid
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from tests.engine.test_crash_recovery import run_until_killed
from tests.helpers import assert_state_equal, log_records, payments, payments_on_kafka, read_sink, reference_state
from volley_dagster import ConfigError, EpochRunner, EpochTooLargeError, SourceDataLostError, SourceError
from volley_dagster.columns import ERROR, POS, POS_OFFSET_BITS, POS_SEGMENT_BITS, RAW
from volley_dagster.demo.events import EVENT_SCHEMA
from volley_dagster.demo.kafka import produce_events
from volley_dagster.errors import is_retryable
from volley_dagster.settings import RunSettings
from volley_dagster.sinks.kafka import KafkaSink
from volley_dagster.sources import formats
from volley_dagster.sources.kafka import KafkaSource, Watermarks, plan_cut
from volley_dagster.sources.offsets import EpochRange, Offset, Segment
from volley_dagster.spark.side_outputs import _resolve_dead_letters

BATCHES, PER_BATCH, KEYS = 3, 1_000, 200


def topic_name() -> str:
    return f"events-{uuid.uuid4().hex[:8]}"


def read_all(source: KafkaSource, rng: EpochRange) -> pa.Table:
    return pa.concat_tables([source.read_segment(seg, EVENT_SCHEMA, rng.epoch) for seg in rng.segments])


# -- the cut, on the offsets a broker reports (no broker needed) ------------------------

def test_a_cut_is_fair_across_partitions_and_a_new_partition_starts_at_its_earliest_offset():
    first = plan_cut("t", 1, {}, {"0": Watermarks(0, 100), "1": Watermarks(0, 10)}, 60)
    assert [(s.partition, s.start, s.end) for s in first.segments] == [("0", 0, 50), ("1", 0, 10)]
    assert first.end == {"0": Offset(50), "1": Offset(10)}
    # partition 2 appears (added to the topic), its first records already compacted away up to 5
    second = plan_cut("t", 2, first.end, {"0": Watermarks(0, 100), "1": Watermarks(0, 10), "2": Watermarks(5, 20)}, None)
    assert [(s.partition, s.start, s.end) for s in second.segments] == [("0", 50, 100), ("2", 5, 20)]
    assert second.start["2"] == Offset(5) and EpochRange.from_dict(second.to_dict()) == second
    assert second.summary() == {"0": "offset 50 -> offset 100", "1": "offset 10 -> offset 10",
                                "2": "offset 5 -> offset 20"}


def test_offsets_deleted_before_they_were_read_are_a_named_error():
    with pytest.raises(SourceDataLostError, match=r"partition 0 offsets 10\.\.24 were deleted"):
        plan_cut("t", 3, {"0": Offset(10)}, {"0": Watermarks(25, 100)}, None)


def test_a_deleted_or_re_created_topic_is_a_named_error():
    with pytest.raises(SourceError, match="ends at offset 20, before offset 50 that was already read"):
        plan_cut("t", 3, {"0": Offset(50)}, {"0": Watermarks(0, 20)}, None)
    with pytest.raises(SourceError, match="partition 1 was read before and is gone"):
        plan_cut("t", 3, {"0": Offset(5), "1": Offset(5)}, {"0": Watermarks(0, 20)}, None)


def test_a_kafka_sink_refuses_to_replace_another_lineages_records():
    with pytest.raises(ConfigError, match="cannot remove the records another lineage wrote"):
        KafkaSink("totals", "127.0.0.1:9", on_foreign_lineage="replace")


def test_offsets_past_2_40_keep_positions_distinct_and_resolve_back():
    """A partition past offset 2^40 beside one at low offsets, in one epoch: positions hold
    each offset from its segment's start, so none coincide and each names its offset."""
    big = 1 << POS_OFFSET_BITS
    rng = plan_cut("t", 7, {"0": Offset(big - 3)}, {"0": Watermarks(0, big + 5), "1": Watermarks(0, 8)}, None)
    assert [(s.partition, s.start, s.end) for s in rng.segments] == [("0", big - 3, big + 5), ("1", 0, 8)]
    rng.check_positions()
    schema = pa.schema([("n", pa.int64())])
    tables = []
    for seg in rng.segments:
        offsets = np.arange(seg.start, seg.end, dtype=np.int64)
        values = [None if o == big + 1 else json.dumps({"n": int(o)}).encode() for o in offsets]  # a tombstone
        tables.append(formats.decode_json_values(values, offsets, schema, seg.position_base()))
    table = pa.concat_tables(tables)
    positions = table.column(POS).to_pylist()
    assert len(set(positions)) == 16 and min(positions) >= 0
    good = table.filter(table.column(ERROR).is_null())
    resolved = [(seg.partition, offset) for seg, offset in map(rng.segment_of, good.column(POS).to_pylist())]
    assert len(resolved) == 15 and resolved == [("0" if n >= big - 3 else "1", n) for n in good.column("n").to_pylist()]
    bad = table.filter(table.column(ERROR).is_valid()).select([POS, ERROR, RAW]).rename_columns([POS, "reason", "raw"])
    dead = _resolve_dead_letters(bad, rng)
    assert dead.select(["partition", "file", "offset"]).to_pylist() == [{"partition": "0", "file": "t", "offset": big + 1}]


def test_a_cut_too_large_for_event_positions_is_refused_by_name():
    big = 1 << POS_OFFSET_BITS
    plan_cut("t", 4, {}, {"0": Watermarks(5, 5 + big - 1)}, None).check_positions()  # 2^40 - 1 records fit
    too_long = plan_cut("t", 4, {}, {"0": Watermarks(0, 3), "1": Watermarks(5, 5 + big)}, None)
    with pytest.raises(EpochTooLargeError, match=rf"epoch 4: partition 1 \(t\) would give it {big} records "
                                                 rf"\(offsets 5\.\.{big + 4}\).*Set max_records_per_epoch") as refused:
        too_long.check_positions()
    assert not is_retryable(refused.value)
    files = (Segment(0, "2", "events-000001.parquet", 0, 1, 10),) * (1 << POS_SEGMENT_BITS)  # one record a file
    with pytest.raises(EpochTooLargeError, match=rf"epoch 4: the cut has {1 << POS_SEGMENT_BITS} segments "
                                                 rf"\(partition 2 alone {1 << POS_SEGMENT_BITS} files\)"):
        EpochRange(4, {}, {}, files).check_positions()


# -- reading from a broker -------------------------------------------------------------

def test_each_recorded_range_reads_exactly_its_offsets(kafka):
    topic = topic_name()
    produce_events(kafka.bootstrap_servers, topic, 2, 500, 50)
    source = KafkaSource(topic, kafka.bootstrap_servers, EVENT_SCHEMA)
    waiting = source.backlog({})
    assert waiting.records == 1_000 and sum(waiting.per_partition.values()) == 1_000
    assert 0 <= waiting.oldest_age_s(time.time()) < 60  # the first waiting record's timestamp
    first = source.cut(1, {}, 600)
    second = source.cut(2, first.end, None)
    assert first.records == 600 and second.records == 400 and source.backlog(second.end).records == 0
    tables = [read_all(source, rng) for rng in (first, second)]
    assert [t.num_rows for t in tables] == [600, 400]
    for rng, table in zip((first, second), tables, strict=True):
        assert table.column(ERROR).null_count == table.num_rows
        offsets = [rng.segment_of(pos)[1] for pos in table.column(POS).to_pylist()]
        expected = sorted(o for s in rng.segments for o in range(s.start, s.end))
        assert sorted(offsets) == expected  # every offset once: positions name (segment, offset)
    both = pa.concat_tables(tables)
    produced = log_records(2, 500, 50)
    assert sorted(both.column("event_id").to_pylist()) == sorted(produced.column("event_id").to_pylist())
    source.verify(first)
    assert source.read_segment(first.segments[0], EVENT_SCHEMA, 1).equals(tables[0].slice(0, first.segments[0].records))


def test_bad_values_and_tombstones_are_bad_records_that_name_their_offsets(kafka):
    topic = topic_name()
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers})
    good = json.dumps({"event_id": 1, "merchant_id": 1, "amount": 5, "status": "active",
                       "event_time": "2026-01-01T00:00:00"})
    for value in (good.encode(), b"{not json", None, good.replace(", ", ",\n ").encode()):
        producer.produce(topic, key=b"k", value=value)  # one key: one partition, in this order
    producer.flush(10)
    source = KafkaSource(topic, kafka.bootstrap_servers, EVENT_SCHEMA)
    rng = source.cut(1, {}, None)
    assert len(rng.segments) == 1
    table = read_all(source, rng).sort_by(POS)
    seg = rng.segments[0]
    assert table.column(POS).to_pylist() == [seg.position_base() + seg.start + i for i in range(4)]
    errors = table.column(ERROR).to_pylist()
    assert errors[0] is None and errors[3] is None  # a value with a line break is one record still
    assert "unparseable JSON" in errors[1] and errors[2] == "empty line"


def decode_pairs(values: pa.BinaryArray) -> pa.Table:
    """A user's decoder for values like ``b"7,12.5"``, in bulk with Arrow compute."""
    text = values.cast(pa.string())
    ok = pc.fill_null(pc.match_substring_regex(text, r"^\d+,[\d.]+$"), False)
    parts = pc.split_pattern(pc.if_else(ok, text, "0,0"), ",")
    return pa.table({"id": pc.cast(pc.list_element(parts, 0), pa.int64()),
                     "amount": pc.cast(pc.list_element(parts, 1), pa.float64()),
                     ERROR: pc.if_else(ok, pa.scalar(None, pa.string()), "not 'id,amount'")})


def test_a_decoder_reads_values_of_any_format_in_bulk_and_what_it_cannot_read_is_a_bad_record(kafka):
    topic = topic_name()
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers})
    for value in (b"1,5", b"2,7.5", b"oops", None):
        producer.produce(topic, key=b"k", value=value)
    producer.flush(10)
    schema = pa.schema([("id", pa.int64()), ("amount", pa.float64())])
    source = KafkaSource(topic, kafka.bootstrap_servers, schema, decode=decode_pairs)
    rng = source.cut(1, {}, None)
    table = read_all_with(source, rng, schema).sort_by(POS)
    assert table.select(["id", "amount"]).slice(0, 2).to_pylist() == [{"id": 1, "amount": 5.0}, {"id": 2, "amount": 7.5}]
    assert table.column(ERROR).to_pylist() == [None, None, "not 'id,amount'", "not 'id,amount'"]
    assert table.column("_volley_raw").to_pylist() == [None, None, "oops", None]
    assert source.describe()["format"] == "decoded by decode_pairs"

    def broken(values: pa.BinaryArray) -> pa.Table:
        raise ValueError("schema registry unreachable")

    failing = KafkaSource(topic, kafka.bootstrap_servers, schema, decode=broken)
    errors = read_all_with(failing, rng, schema).column(ERROR).to_pylist()
    assert errors == ["the decoder failed: ValueError: schema registry unreachable"] * 4  # nothing dropped


def read_all_with(source: KafkaSource, rng: EpochRange, schema: pa.Schema) -> pa.Table:
    return pa.concat_tables([source.read_segment(seg, schema, rng.epoch) for seg in rng.segments])


def test_transactions_are_read_once_committed_with_the_gaps_their_markers_leave(kafka):
    topic = topic_name()
    produced = produce_events(kafka.bootstrap_servers, topic, 2, 300, 30, transactional_id=f"tx-{topic}")
    source = KafkaSource(topic, kafka.bootstrap_servers, EVENT_SCHEMA)
    rng = source.cut(1, {}, None)
    table = read_all(source, rng)
    assert table.num_rows == produced and rng.records >= produced  # control records take offsets, not rows
    assert table.column(ERROR).null_count == produced


# -- the engine on a topic --------------------------------------------------------------

def test_a_pipeline_on_a_topic_equals_the_reference_and_re_runs_as_no_ops(spark, kafka, tmp_path):
    topic = topic_name()
    produce_events(kafka.bootstrap_servers, topic, BATCHES, PER_BATCH, KEYS)
    source = KafkaSource(topic, kafka.bootstrap_servers, EVENT_SCHEMA, commit_group=f"volley-{topic}")
    pipeline = payments(tmp_path / "unused", tmp_path / "out", tables=tmp_path / "tables", source=source)
    runner = EpochRunner(pipeline, tmp_path / "state", RunSettings(max_records_per_epoch=PER_BATCH), spark=spark)
    results = runner.run_available()
    assert [r.epoch for r in results] == [1, 2, 3]
    records = log_records(BATCHES, PER_BATCH, KEYS)
    # keyed by merchant, each merchant's events keep their order in one partition: first/last agree
    assert_state_equal(runner.read_state(), reference_state(records))
    assert sum(r.records_in for r in results) == records.num_rows
    again = runner.run(2)
    assert again.already_committed and again.range == results[1].range
    produce_events(kafka.bootstrap_servers, topic, 1, PER_BATCH, KEYS, first_batch=BATCHES)  # more data lands
    assert runner.records_waiting() == PER_BATCH
    runner.run_available()
    assert_state_equal(runner.read_state(), reference_state(log_records(BATCHES + 1, PER_BATCH, KEYS)))
    # the consumer group holds the committed end offsets, for Kafka's own lag tools
    group = Consumer({"bootstrap.servers": kafka.bootstrap_servers, "group.id": f"volley-{topic}"})
    try:
        ends = runner.log.offsets(runner.committed_epoch()).end
        committed = group.committed([TopicPartition(topic, int(p)) for p in ends], timeout=10)
        assert {str(tp.partition): tp.offset for tp in committed} == {p: pos.offset for p, pos in ends.items()}
    finally:
        group.close()


@pytest.mark.parametrize("point", [pytest.param("segment_read", marks=pytest.mark.deep),
                                   pytest.param("after_sink_iceberg", marks=pytest.mark.deep), "after_sinks"])
def test_kill_9_and_resume_reads_the_same_offsets_and_writes_each_epoch_once(spark, kafka, tmp_path, point):
    """Killed while reading epoch 2's offsets, after every sink but the Kafka one (held)
    committed it, or after every sink (the Kafka transaction included) committed it
    but before its manifest: resumed, the state equals the reference and the output
    topic holds each epoch once. (The points between the snapshot and the sinks do not
    depend on the source; tests/engine/test_crash_recovery.py kills at each of them.)"""
    topic = topic_name()
    produce_events(kafka.bootstrap_servers, topic, BATCHES, PER_BATCH, KEYS)
    crashed = run_until_killed(tmp_path, point, 2, kind="payments_kafka", max_records=PER_BATCH,
                               env_extra={"VOLLEY_TEST_KAFKA": kafka.bootstrap_servers, "VOLLEY_TEST_KAFKA_TOPIC": topic},
                               hold=("kafka",) if point == "after_sink_iceberg" else ())
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-3000:]
    pipeline = payments_on_kafka(tmp_path / "events", tmp_path / "out", tables=tmp_path / "tables",
                                 bootstrap_servers=kafka.bootstrap_servers, topic=topic)
    runner = EpochRunner(pipeline, tmp_path / "state", RunSettings(max_records_per_epoch=PER_BATCH), spark=spark)
    assert runner.committed_epoch() == 1 and runner.log.last_cut() == 2
    assert [r.epoch for r in runner.run_available()] == [2, 3]
    assert_state_equal(runner.read_state(), reference_state(log_records(BATCHES, PER_BATCH, KEYS)))
    parquet_rows = Counter(read_sink(tmp_path / "out")["epoch"].tolist())
    kafka_sink = pipeline.sinks[-1]
    assert Counter(row["_epoch"] for row in kafka_sink.read("payments")) == parquet_rows  # each epoch once
    assert kafka_sink.committed_epoch("payments") == 3
    assert runner.result(2).sinks["kafka"].skipped is (point == "after_sinks")
