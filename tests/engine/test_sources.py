"""A pipeline of two sources on real Spark and RocksDB: every epoch reads exactly the
ranges recorded for both before its first attempt, whatever lands after the cut; the
state equals a straight computation over both logs; rescaling, state inspection, bad
records and the sinks' epoch marks work as for one source."""

from __future__ import annotations

import json
import signal
import uuid

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from confluent_kafka import Consumer, TopicPartition

from tests.engine.test_crash_recovery import run_until_killed
from tests.helpers import channels, log_records
from volley_dagster import EpochRunner, FileLog, ParquetSink, Pipeline, RunSettings, count, max_, sum_
from volley_dagster.demo.events import EVENT_SCHEMA, generate
from volley_dagster.demo.kafka import produce_events
from volley_dagster.sources.kafka import KafkaSource

PER_FILE, KEYS = 1_000, 300


def reference(records: pa.Table) -> pd.DataFrame:
    df = records.to_pandas()
    df = df[df["status"] == "active"]
    g = df.groupby("merchant_id", sort=True)
    return pd.DataFrame({"total": g["amount"].sum(), "events": g["amount"].size().astype("int64"),
                         "largest": g["amount"].max()}).reset_index()


def test_two_sources_are_cut_together_and_read_exactly_as_recorded(spark, tmp_path):
    generate(tmp_path / "web", 3, PER_FILE, KEYS)
    generate(tmp_path / "store", 1, PER_FILE, KEYS, seed=8)
    runner = EpochRunner(channels(tmp_path), tmp_path / "state", RunSettings(max_records_per_epoch=1_500), spark=spark)
    first = runner.cut_next()
    assert first is not None
    parts = {name: runner.pipeline.source_log.range_of(name, first).records for name in ("web", "store")}
    assert parts == {"web": 750, "store": 750}  # shared fairly, recorded once
    generate(tmp_path / "store", 2, PER_FILE, KEYS, first_file=1, seed=8)  # lands after the cut
    result = runner.run(1)
    assert result.records_in == 1_500  # exactly the recorded ranges, not what landed since
    recorded = json.loads((tmp_path / "state" / "epochs" / "0000000001" / "offsets.json").read_text())
    assert {p.split("/")[0] for p in recorded["end"]} == {"web", "store"}

    runner.rescale(5)  # between epochs, as for one source
    results = runner.run_available()
    assert sum(r.records_in for r in [result, *results]) == 6 * PER_FILE
    everything = pa.concat_tables([log_records(3, PER_FILE, KEYS), log_records(3, PER_FILE, KEYS, seed=8)])
    got = runner.read_state().to_pandas().sort_values("merchant_id").reset_index(drop=True)
    want = reference(everything)
    pd.testing.assert_frame_equal(got[["merchant_id", "total", "events", "largest"]], want, check_exact=False, rtol=1e-9)
    assert runner.result(runner.committed_epoch()).shards.keys() == set(range(5))

    again = runner.run(2)  # a committed epoch re-run: a no-op, as for one source
    assert again.already_committed


def test_a_bad_record_names_its_source_file_and_offset(spark, tmp_path):
    generate(tmp_path / "web", 1, 100, 10)
    (tmp_path / "store").mkdir()
    good = log_records(1, 3, 10, seed=8).to_pandas()
    lines = [json.dumps({**row, "event_time": str(row["event_time"])}) for row in good.to_dict("records")]
    lines[1] = lines[1].replace('"amount": ', '"amount": "not a number", "was": ')
    (tmp_path / "store" / "events-000000.jsonl").write_text("\n".join(lines) + "\n")
    schema = log_records(1, 1, 1).schema
    pipeline = (Pipeline("bad").sources({"web": FileLog(tmp_path / "web"),
                                         "store": FileLog(tmp_path / "store", format="json", schema=schema)})
                .key_by("merchant_id").aggregate(events=count()).sink(ParquetSink(tmp_path / "out"))
                .on_bad_records("dead_letter"))
    runner = EpochRunner(pipeline, tmp_path / "state", spark=spark)
    (result,) = runner.run_available()
    assert result.dead_letters == 1 and result.records_in == 103
    (letter,) = pq.read_table(runner.log.root / result.dead_letter_path).to_pylist()
    assert (letter["partition"], letter["file"], letter["offset"]) == ("store/", "events-000000.jsonl", 1)
    assert pc.sum(runner.read_state().column("events")).as_py() == 102


def test_killed_mid_epoch_resumes_reading_both_recorded_ranges_not_what_landed_since(spark, tmp_path):
    """kill -9 in epoch 2's stage, as its first shard task snapshots (both sources
    advancing, read by Spark's own Parquet scans); files land in both before the
    resume; epoch 2 then reads exactly the ranges recorded before its first attempt."""
    generate(tmp_path / "web", 2, PER_FILE, KEYS)
    generate(tmp_path / "store", 2, PER_FILE, KEYS, seed=8)
    crashed = run_until_killed(tmp_path, "shard_after_snapshot", 2, kind="channels", max_records=1_000)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-3000:]
    runner = EpochRunner(channels(tmp_path), tmp_path / "state", RunSettings(max_records_per_epoch=1_000), spark=spark)
    assert (runner.committed_epoch(), runner.log.last_cut()) == (1, 2)
    recorded = runner.log.offsets(2)
    generate(tmp_path / "web", 1, PER_FILE, KEYS, first_file=2)
    generate(tmp_path / "store", 1, PER_FILE, KEYS, first_file=2, seed=8)
    resumed = runner.run_available()
    assert resumed[0].epoch == 2 and resumed[0].records_in == recorded.records == 1_000
    assert resumed[0].range == recorded.summary()
    assert sum(runner.result(e).records_in for e in range(1, runner.committed_epoch() + 1)) == 6 * PER_FILE
    everything = pa.concat_tables([log_records(3, PER_FILE, KEYS), log_records(3, PER_FILE, KEYS, seed=8)])
    got = runner.read_state().to_pandas().sort_values("merchant_id").reset_index(drop=True)
    pd.testing.assert_frame_equal(got[["merchant_id", "total", "events", "largest"]], reference(everything),
                                  check_exact=False, rtol=1e-9)


def test_a_file_log_and_a_kafka_topic_are_cut_together(spark, kafka, tmp_path):
    """One source of each kind: the topic's offsets and the log's files in one recorded
    range per epoch; the topic's consumer group learns the topic's own end offsets."""
    topic = f"store-{uuid.uuid4().hex[:8]}"
    generate(tmp_path / "web", 2, PER_FILE, KEYS)
    produce_events(kafka.bootstrap_servers, topic, 2, PER_FILE, KEYS, seed=8)
    store = KafkaSource(topic, kafka.bootstrap_servers, EVENT_SCHEMA, commit_group=f"volley-{topic}")
    pipeline = (Pipeline("mixed").sources({"web": FileLog(tmp_path / "web"), "store": store})
                .key_by("merchant_id").aggregate(total=sum_("amount"), events=count()).sink(ParquetSink(tmp_path / "out")))
    runner = EpochRunner(pipeline, tmp_path / "state", RunSettings(max_records_per_epoch=1_500), spark=spark)
    results = runner.run_available()
    assert sum(r.records_in for r in results) == 4 * PER_FILE
    first = runner.log.offsets(1)
    parts = {name: pipeline.source_log.range_of(name, first).records for name in ("web", "store")}
    assert parts["web"] == 750 and 700 < parts["store"] <= 750  # the budget shared; a topic splits its share by partition
    everything = pa.concat_tables([log_records(2, PER_FILE, KEYS), log_records(2, PER_FILE, KEYS, seed=8)]).to_pandas()
    state = runner.read_state().to_pandas().set_index("merchant_id").sort_index()
    expected = everything.groupby("merchant_id")["amount"].agg(["sum", "size"])
    assert (state["events"] == expected["size"]).all()
    pd.testing.assert_series_equal(state["total"], expected["sum"], check_names=False, rtol=1e-9)
    ends = {p.split("/", 1)[1]: pos.offset for p, pos in runner.log.offsets(runner.committed_epoch()).end.items()
            if p.startswith("store/")}
    group = Consumer({"bootstrap.servers": kafka.bootstrap_servers, "group.id": f"volley-{topic}"})
    try:
        committed = group.committed([TopicPartition(topic, int(p)) for p in ends], timeout=10)
        assert {str(tp.partition): tp.offset for tp in committed} == ends
    finally:
        group.close()


def test_a_pipeline_of_two_sources_migrates_like_one(spark, tmp_path):
    """A migration rewrites the state of a two-source pipeline and the next epochs read
    both logs on: an accumulator renamed, another added (null for the keys it finds)."""
    generate(tmp_path / "web", 2, PER_FILE, KEYS)
    generate(tmp_path / "store", 2, PER_FILE, KEYS, seed=8)
    runner = EpochRunner(channels(tmp_path), tmp_path / "state", RunSettings(max_records_per_epoch=2_000), spark=spark)
    first = runner.run_next()
    assert first is not None and first.records_in == 2_000  # the first file of each
    evolved = (Pipeline("channels")
               .sources({"web": FileLog(tmp_path / "web"), "store": FileLog(tmp_path / "store")}, source_column="channel")
               .where("status = 'active'").key_by("merchant_id")
               .aggregate(total=sum_("amount"), n_events=count(), largest=max_("amount"), seen_since=count())
               .sink(ParquetSink(tmp_path / "out", on_foreign_lineage="fail")).with_shards(3))
    migration = runner.migrate(evolved, renames={"events": "n_events"})
    assert migration.rewrite.from_epoch == 2 and "'events' renamed to 'n_events'" in migration.changes
    rest = runner.run_available()
    assert sum(r.records_in for r in [first, *rest]) == 4 * PER_FILE
    web, store = log_records(2, PER_FILE, KEYS), log_records(2, PER_FILE, KEYS, seed=8)
    got = runner.read_state().to_pandas().sort_values("merchant_id").reset_index(drop=True)
    want = reference(pa.concat_tables([web, store])).rename(columns={"events": "n_events"})
    pd.testing.assert_frame_equal(got[["merchant_id", "total", "n_events", "largest"]], want, check_exact=False,
                                  rtol=1e-9)
    since = pa.concat_tables([web.slice(PER_FILE), store.slice(PER_FILE)])  # the second file of each
    assert got["seen_since"].sum() == pc.sum(pc.equal(since.column("status"), "active")).as_py()


def test_a_join_whose_second_log_has_no_files_yet_waits_then_runs(spark, tmp_path):
    """Review M1 on Spark: the refunds log has no file yet, so nothing is cut (no run
    fails); once its first file lands, the first epoch reads both logs from their starts
    and joins them."""
    from volley_dagster.demo.payments import local_tables
    from volley_dagster.demo.refunds import refunds_pipeline, write_refund_logs

    events = tmp_path / "events"
    write_refund_logs(events, 1, 300)
    landed = tmp_path / "refunds-landed"
    (events / "refunds").rename(landed)
    (events / "refunds").mkdir()
    runner = EpochRunner(refunds_pipeline(events, local_tables(tmp_path / "tables"), shards=2), tmp_path / "state",
                         spark=spark)
    assert runner.run_next() is None and runner.log.last_cut() == 0
    assert runner.backlog().parts["payments"].records == 300
    for f in landed.iterdir():
        f.rename(events / "refunds" / f.name)
    both = sum(pq.read_metadata(f).num_rows for f in events.rglob("*.parquet"))
    result = runner.run_next()
    assert result is not None and result.epoch == 1 and result.records_in == both > 300
    assert result.figures["join_pairs"] > 0
