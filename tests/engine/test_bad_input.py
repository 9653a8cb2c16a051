"""Malformed records, missing files, corrupt snapshots and wrong config: each a
clear error naming the problem, or a counted dead-letter row; never a silent drop."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.helpers import payments
from volley_dagster import (
    ConfigError,
    EpochRunner,
    FileLog,
    MalformedRecordError,
    MemorySink,
    Pipeline,
    SnapshotError,
    SourceChangedError,
    SourceError,
    StateLayoutError,
    count,
    sum_,
)
from volley_dagster.demo.events import generate
from volley_dagster.settings import RunSettings

SCHEMA = pa.schema([("user", pa.string()), ("amount", pa.float64()), ("ts", pa.timestamp("us", tz="UTC"))])
GOOD = [{"user": f"u{i % 3}", "amount": float(i), "ts": "2026-01-01T00:00:00"} for i in range(6)]


def write_lines(path, lines):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines))


def json_pipeline(root, policy="fail"):
    return (
        Pipeline("json_users")
        .source(FileLog(root / "log", format="json", schema=SCHEMA))
        .key_by("user")
        .aggregate(total=sum_("amount"), n=count())
        .sink(MemorySink())
        .on_bad_records(policy)
        .with_shards(2)
    )


BAD_LINES = [
    json.dumps(GOOD[0]),
    "{not json",  # unparseable
    json.dumps({"user": "u1", "amount": "lots", "ts": "2026-01-01T00:00:00"}),  # wrong type
    json.dumps({"user": None, "amount": 5.0, "ts": "2026-01-01T00:00:00"}),  # null key
    json.dumps(GOOD[1]),
    "",  # empty line
    json.dumps(GOOD[2]),
]


def test_fail_policy_names_file_offset_and_reason(spark, tmp_path):
    write_lines(tmp_path / "log" / "a-0001.jsonl", BAD_LINES)
    runner = EpochRunner(json_pipeline(tmp_path), tmp_path / "state", spark=spark)
    with pytest.raises(MalformedRecordError) as err:
        runner.run_next()
    msg = str(err.value)
    assert "epoch 1: 4 malformed record(s)" in msg
    assert "a-0001.jsonl record 1: unparseable JSON" in msg
    assert "a-0001.jsonl record 2" in msg
    assert runner.committed_epoch() == 0 and not runner.pipeline.sinks[0].epochs
    # the range stays recorded: a retry sees exactly the same records and fails the same way
    with pytest.raises(MalformedRecordError, match="4 malformed"):
        runner.run(1)


def test_dead_letter_policy_routes_and_counts(spark, tmp_path):
    write_lines(tmp_path / "log" / "a-0001.jsonl", BAD_LINES)
    runner = EpochRunner(json_pipeline(tmp_path, "dead_letter"), tmp_path / "state", spark=spark)
    result = runner.run_next()
    assert result.records_in == 7 and result.dead_letters == 4 and result.records_aggregated == 3
    dead = pq.read_table(runner.log.root / result.dead_letter_path).to_pylist()
    assert [(d["file"], d["offset"]) for d in dead] == [("a-0001.jsonl", i) for i in (1, 2, 3, 5)]
    reasons = [d["reason"] for d in dead]
    assert reasons[0].startswith("unparseable JSON") and "lots" in dead[1]["raw"]
    assert reasons[2] == "null key: 'user' is null" and reasons[3] == "empty line"
    state = runner.read_state().to_pylist()
    assert state == [{"user": "u0", "total": 0.0, "n": 1}, {"user": "u1", "total": 1.0, "n": 1},
                     {"user": "u2", "total": 2.0, "n": 1}]


def test_parquet_wrong_type_is_a_bad_record(spark, tmp_path):
    log = tmp_path / "log"
    log.mkdir()
    pq.write_table(pa.table({"user": ["a", "b"], "amount": ["1.5", "x"],
                             "ts": pa.array([0, 0], pa.timestamp("us", tz="UTC"))}), log / "f-1.parquet")
    pipeline = (
        Pipeline("pq").source(FileLog(log, schema=SCHEMA)).key_by("user")
        .aggregate(total=sum_("amount")).on_bad_records("dead_letter")
    )
    runner = EpochRunner(pipeline, tmp_path / "state", spark=spark)
    result = runner.run_next()
    assert result.dead_letters == 1
    dead = pq.read_table(runner.log.root / result.dead_letter_path).to_pylist()[0]
    assert dead["offset"] == 1 and "wrong type: column 'amount' value 'x'" in dead["reason"]
    assert runner.read_state().to_pylist() == [{"user": "a", "total": 1.5}]


@pytest.mark.parametrize("policy", ["fail", "dead_letter"])
def test_parquet_null_keys_in_a_single_job_epoch(spark, tmp_path, policy):
    """Local Parquet of the log's schema is one Spark job: the shard tasks count the
    null keys, and a second job finds them only when there are some."""
    log = tmp_path / "log"
    log.mkdir()
    pq.write_table(pa.table({"user": ["a", None, "b", None, "a"], "amount": [1.0, 2.0, 3.0, 4.0, 5.0],
                             "ts": pa.array([0] * 5, pa.timestamp("us", tz="UTC"))}, schema=SCHEMA), log / "f-1.parquet")
    pipeline = (Pipeline("pq_null").source(FileLog(log)).key_by("user").aggregate(total=sum_("amount"), n=count())
                .sink(MemorySink()).on_bad_records(policy).with_shards(2))
    runner = EpochRunner(pipeline, tmp_path / "state", spark=spark)
    assert runner.pipeline.source_log.native_parquet_files(runner.cut_next(), SCHEMA) is not None
    if policy == "fail":
        with pytest.raises(MalformedRecordError, match=r"2 malformed record\(s\).*f-1.parquet record 1: null key"):
            runner.run(1)
        assert runner.committed_epoch() == 0 and not runner.pipeline.sinks[0].epochs
        return
    result = runner.run(1)
    assert (result.records_in, result.dead_letters, result.records_aggregated) == (5, 2, 3)
    dead = pq.read_table(runner.log.root / result.dead_letter_path).to_pylist()
    assert [(d["offset"], d["reason"]) for d in dead] == [(1, "null key: 'user' is null"), (3, "null key: 'user' is null")]
    assert runner.read_state().to_pylist() == [{"user": "a", "total": 6.0, "n": 2}, {"user": "b", "total": 3.0, "n": 1}]


@pytest.mark.parametrize("fmt", ["json", "parquet"])
def test_dead_letters_of_epochs_cut_mid_file_name_their_offsets_in_the_file(spark, tmp_path, fmt):
    """An event position holds a record's offset from its segment's start: dead letters
    add the start back, after a Python-decoded read and after Spark's own Parquet scan."""
    if fmt == "json":
        write_lines(tmp_path / "log" / "a-0001.jsonl", BAD_LINES)
        pipeline, budget, expected = json_pipeline(tmp_path, "dead_letter"), 3, [[1, 2], [3, 5], []]
    else:
        (tmp_path / "log").mkdir()
        pq.write_table(pa.table({"user": ["a", None, "b", None, "a"], "amount": [1.0, 2.0, 3.0, 4.0, 5.0],
                                 "ts": pa.array([0] * 5, pa.timestamp("us", tz="UTC"))}, schema=SCHEMA),
                       tmp_path / "log" / "f-1.parquet")
        pipeline = (Pipeline("pq_mid").source(FileLog(tmp_path / "log")).key_by("user").aggregate(n=count())
                    .sink(MemorySink()).on_bad_records("dead_letter").with_shards(2))
        budget, expected = 2, [[1], [3], []]
    runner = EpochRunner(pipeline, tmp_path / "state", RunSettings(max_records_per_epoch=budget), spark=spark)
    offsets = []
    for _ in expected:
        result = runner.run_next()
        dead = pq.read_table(runner.log.root / result.dead_letter_path).to_pylist() if result.dead_letters else []
        offsets.append([d["offset"] for d in dead])
    assert offsets == expected


def test_missing_source_file_of_a_cut_range_is_an_error(spark, tmp_path):
    generate(tmp_path / "events", 2, 500, 50)
    runner = EpochRunner(payments(tmp_path / "events", tmp_path / "out"), tmp_path / "state", spark=spark)
    runner.cut_next()
    os.unlink(tmp_path / "events" / "events-000001.parquet")
    with pytest.raises(SourceError, match="epoch 1: source file .*events-000001.parquet is missing"):
        runner.run(1)
    assert runner.committed_epoch() == 0


def test_file_sorting_before_the_position_is_refused(spark, tmp_path):
    generate(tmp_path / "events", 2, 500, 50, first_file=5)
    runner = EpochRunner(payments(tmp_path / "events", tmp_path / "out"), tmp_path / "state", spark=spark)
    runner.run_next()
    generate(tmp_path / "events", 1, 500, 50, first_file=1)  # sorts before what was read
    with pytest.raises(SourceError, match="1 new file\\(s\\) sorting before 'events-000006.parquet'"):
        runner.cut_next()


def test_corrupt_snapshot_is_named(spark, tmp_path):
    generate(tmp_path / "events", 2, 500, 50)
    runner = EpochRunner(payments(tmp_path / "events", tmp_path / "out"), tmp_path / "state", RunSettings(max_records_per_epoch=500), spark=spark)
    runner.run_next()
    runner.cut_next()
    sst = next((runner.log.root / runner.result(1).shards[1].snapshot.path).glob("*.sst"))
    sst.write_bytes(sst.read_bytes()[:-10])
    with pytest.raises(SnapshotError, match=r"snapshot .*shard-0001-[0-9a-f]+ is corrupt: .*\.sst has \d+ bytes, manifest says"):
        runner.run(2)
    assert runner.committed_epoch() == 1
    with pytest.raises(SnapshotError, match="is corrupt"):
        runner.read_state(1)


def test_changed_layout_is_refused(spark, tmp_path):
    generate(tmp_path / "events", 2, 500, 50)
    EpochRunner(payments(tmp_path / "events", tmp_path / "out"), tmp_path / "state", RunSettings(max_records_per_epoch=500), spark=spark).run_next()
    other = payments(tmp_path / "events", tmp_path / "out", shards=5)
    with pytest.raises(StateLayoutError, match="num_shards"):
        EpochRunner(other, tmp_path / "state", spark=spark).run_next()


def test_config_errors_name_the_setting(spark, tmp_path):
    with pytest.raises(ConfigError, match="needs an explicit schema"):
        FileLog(tmp_path, format="json")
    with pytest.raises(ConfigError, match="incomplete: add key_by"):
        EpochRunner(Pipeline("p").source(FileLog(tmp_path)).aggregate(n=count()), tmp_path / "s")
    write_lines(tmp_path / "log" / "a.jsonl", [json.dumps(GOOD[0])])
    bad_key = (
        Pipeline("p").source(FileLog(tmp_path / "log", format="json", schema=SCHEMA))
        .key_by("amount_typo").aggregate(n=count())
    )
    with pytest.raises(ConfigError, match="key column 'amount_typo' is not among the columns"):
        EpochRunner(bad_key, tmp_path / "s", spark=spark).run_next()
    bad_acc = (
        Pipeline("p").source(FileLog(tmp_path / "log", format="json", schema=SCHEMA))
        .key_by("user").aggregate(total=sum_("user"))
    )
    with pytest.raises(ConfigError, match="cannot aggregate column 'user' of type string"):
        EpochRunner(bad_acc, tmp_path / "s2", spark=spark).run_next()


def test_file_changed_after_cut_fails_inside_the_stage(spark, tmp_path):
    """Spark tasks re-check what they read; their engine errors surface as themselves."""
    generate(tmp_path / "events", 1, 500, 50)
    pipeline = payments(tmp_path / "events", tmp_path / "out")
    runner = EpochRunner(pipeline, tmp_path / "state", spark=spark)
    rng = runner.cut_next()
    assert rng is not None
    from volley_dagster.attempt import EpochAttempt
    from volley_dagster.spark.stage import run_stage

    path = tmp_path / "events" / "events-000000.parquet"
    with runner.lease() as lease:
        attempt = EpochAttempt(spark, pipeline, rng, runner.log.start_of(1, {}), runner.log, runner.settings, lease)
        plan, merge = attempt.plan()  # the driver's checks pass
        path.write_bytes(path.read_bytes() + b"x")  # rewritten after them
        with pytest.raises(SourceError, match="changed after the epoch was cut"):
            run_stage(spark, pipeline, rng, plan, merge)


def test_a_source_file_rewritten_at_the_same_size_fails_the_epoch_by_name(spark, tmp_path):
    """A re-run writer that publishes a file again with other values, at the same size:
    the epoch cut from the first version must not read the second."""
    generate(tmp_path / "events", 1, 500, 50, fmt="json")
    runner = EpochRunner(payments(tmp_path / "events", tmp_path / "out", tables=tmp_path / "tables", fmt="json"),
                         tmp_path / "state", spark=spark)
    assert runner.cut_next().records == 500
    path = next((tmp_path / "events").glob("*.jsonl"))
    data = path.read_bytes()
    at = data.index(b'"amount": ') + len(b'"amount": ')
    digit = data[at:at + 1]
    assert digit.isdigit()
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data[:at] + (b"1" if digit != b"1" else b"2") + data[at + 1:])
    tmp.replace(path)  # published again, whole: same size, other values
    with pytest.raises(SourceChangedError, match=rf"epoch 1: source file \S+/{path.name} changed after the epoch "
                                                 r"was cut \(rewritten: its first \d+ bytes"):
        runner.run(1)
    assert runner.committed_epoch() == 0
    assert all(sink.committed_epoch("payments") is None for sink in runner.pipeline.sinks)


def test_a_malformed_record_error_quotes_a_bounded_part_of_the_record(spark, tmp_path):
    """A wrong-typed value is quoted in the reason; a long one (a free-text field full of
    card numbers) is cut in the error message, while the dead letter keeps it whole."""
    log = tmp_path / "log"
    log.mkdir()
    secret = "4111-1111-1111-1111 " * 200
    pq.write_table(pa.table({"user": ["a", "b"], "amount": ["1.5", secret],
                             "ts": pa.array([0, 0], pa.timestamp("us", tz="UTC"))}), log / "f-1.parquet")
    pipeline = Pipeline("pq").source(FileLog(log, schema=SCHEMA)).key_by("user").aggregate(total=sum_("amount"))
    runner = EpochRunner(pipeline, tmp_path / "state", spark=spark)
    with pytest.raises(MalformedRecordError) as err:
        runner.run_next()
    msg = str(err.value)
    assert "f-1.parquet record 1: wrong type: column 'amount' value '4111-1111-1111-1111" in msg
    assert "characters)" in msg and msg.count("4111-1111-1111-1111") <= 10 and len(msg) < 800

    # redacted: the error names file, offset and the kind of problem, never a value
    quiet = EpochRunner(pipeline.on_bad_records("fail", quote_records=False), tmp_path / "quiet", spark=spark)
    with pytest.raises(MalformedRecordError) as err:
        quiet.run_next()
    assert "f-1.parquet record 1: wrong type (details withheld)" in str(err.value)
    assert "4111" not in str(err.value)

