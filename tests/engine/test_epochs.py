"""End to end on real Spark (local mode) and real RocksDB: epochs equal a
straight computation over the source records, and re-runs change nothing."""

from __future__ import annotations

from dataclasses import replace

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from tests.helpers import (
    assert_epoch_outputs,
    assert_state_equal,
    log_records,
    payments,
    read_sink,
    reference_state,
    tree_digest,
)
from volley_dagster import EpochNotCutError, EpochOrderError, EpochRunner, SnapshotError
from volley_dagster.attempt import AttemptStatus, EpochAttempt
from volley_dagster.demo.events import generate
from volley_dagster.settings import RunSettings
from volley_dagster.sinks.base import CommitContext, SinkCommitResult
from volley_dagster.sinks.memory import MemorySink

FILES, PER_FILE, KEYS = 6, 4_000, 1_500


@pytest.fixture(scope="module")
def committed(spark, tmp_path_factory):
    """Six files, cut into epochs of 3,500 records (epochs straddle files), all run."""
    base = tmp_path_factory.mktemp("epochs")
    generate(base / "events", FILES, PER_FILE, KEYS)
    runner = EpochRunner(payments(base / "events", base / "out"), base / "state", RunSettings(max_records_per_epoch=3_500, keep_epochs=3), spark=spark)
    results = runner.run_available()
    return base, runner, results


def test_epochs_equal_reference(committed):
    base, runner, results = committed
    records = log_records(FILES, PER_FILE, KEYS)
    assert [r.epoch for r in results] == list(range(1, 8))
    assert sum(r.records_in for r in results) == records.num_rows
    assert_state_equal(runner.read_state(), reference_state(records))

    assert_epoch_outputs(read_sink(base / "out"), records, {r.epoch: r.records_in for r in results})
    assert all(r.records_out == r.keys_touched for r in results)
    assert results[0].new_keys == results[0].keys_touched
    assert sum(r.new_keys for r in results) == runner.read_state().num_rows


def test_rerun_of_committed_epoch_changes_nothing(committed):
    base, runner, results = committed
    before = {d: tree_digest(base / d) for d in ("state", "out")}
    again = runner.run(5)
    assert again.already_committed
    assert again.to_manifest() == results[4].to_manifest()
    assert runner.run_next() is None  # nothing new in the log
    assert {d: tree_digest(base / d) for d in ("state", "out")} == before


def test_retention_keeps_k_epochs_and_each_restores(committed):
    base, runner, results = committed
    records = log_records(FILES, PER_FILE, KEYS)
    assert runner.log.retained_snapshots() == [5, 6, 7]
    consumed = {r.epoch: sum(x.records_in for x in results if x.epoch <= r.epoch) for r in results}
    for epoch in (5, 6, 7):
        assert_state_equal(runner.read_state(epoch), reference_state(records.slice(0, consumed[epoch])))
    with pytest.raises(SnapshotError, match="removed by retention"):
        runner.read_state(4)


def test_restore_leaves_previous_snapshot_untouched(spark, tmp_path):
    generate(tmp_path / "events", 2, 3_000, 500)
    runner = EpochRunner(payments(tmp_path / "events", tmp_path / "out"), tmp_path / "state", RunSettings(max_records_per_epoch=3_000), spark=spark)
    runner.run_next()
    snap1 = tree_digest(tmp_path / "state" / "snapshots" / "0000000001")
    second = runner.run_next()
    assert second.epoch == 2 and second.keys_touched > 0
    assert tree_digest(tmp_path / "state" / "snapshots" / "0000000001") == snap1
    # epoch 2's snapshots share the unchanged SSTs with epoch 1 by hardlink
    assert second.state_bytes_written < second.state_bytes


def test_epochs_run_only_in_order(spark, tmp_path):
    generate(tmp_path / "events", 3, 1_000, 200)
    runner = EpochRunner(payments(tmp_path / "events", tmp_path / "out"), tmp_path / "state", RunSettings(max_records_per_epoch=1_000), spark=spark)
    assert [runner.cut_next().epoch for _ in range(3)] == [1, 2, 3]
    with pytest.raises(EpochOrderError, match="epoch 3 .* needs epoch 2 committed first"):
        runner.run(3)
    with pytest.raises(EpochNotCutError, match="epoch 9 has no recorded offset range"):
        runner.run(9)
    assert not (tmp_path / "out" / "payments").exists()  # nothing was committed anywhere
    assert [r.epoch for r in runner.run_available()] == [1, 2, 3]


def test_recorded_range_is_reused_when_files_are_appended(spark, tmp_path):
    generate(tmp_path / "events", 2, 1_000, 100)
    runner = EpochRunner(payments(tmp_path / "events", tmp_path / "out"), tmp_path / "state", RunSettings(max_records_per_epoch=None), spark=spark)
    cut = runner.cut_next()
    generate(tmp_path / "events", 2, 1_000, 100, first_file=2)  # lands after the cut
    result = runner.run(cut.epoch)
    assert result.records_in == 2_000
    assert_state_equal(runner.read_state(), reference_state(log_records(2, 1_000, 100)))
    assert runner.run_next().records_in == 2_000
    assert_state_equal(runner.read_state(), reference_state(log_records(4, 1_000, 100)))


def test_partitioned_log_with_string_keys(spark, tmp_path):
    """Sub-folder partitions share each epoch's budget; string keys shard like ints."""
    from volley_dagster import FileLog, MemorySink, Pipeline, count, sum_

    generate(tmp_path / "events", 6, 1_000, 300, partitions=3)
    pipeline = (
        Pipeline("by_status")
        .source(FileLog(tmp_path / "events"))
        .with_column("merchant", "concat('m-', cast(merchant_id as string))")
        .key_by("merchant")
        .aggregate(total=sum_("amount"), events=count())
        .sink(MemorySink())
        .with_shards(2)
    )
    runner = EpochRunner(pipeline, tmp_path / "state", RunSettings(max_records_per_epoch=2_400), spark=spark)
    results = runner.run_available()
    assert [r.records_in for r in results] == [2_400, 2_400, 1_200]
    first_range = results[0].range
    assert set(first_range) == {"p0", "p1", "p2"}  # every partition advanced in epoch 1
    df = log_records(6, 1_000, 300).to_pandas()
    df["merchant"] = "m-" + df["merchant_id"].astype(str)
    g = df.groupby("merchant")
    expected = pd.DataFrame({"total": g["amount"].sum(), "events": g.size()}).reset_index()
    got = runner.read_state().to_pandas()
    pd.testing.assert_frame_equal(got, expected, check_dtype=False, rtol=1e-9)


def test_empty_epoch_carries_state_forward_without_spark_work(spark, tmp_path):
    """An epoch with no records links N-1's snapshot files (no RocksDB opened, nothing
    written), and each sink still records the epoch; the next epoch restores from it."""
    generate(tmp_path / "events", 1, 1_000, 100)
    pipeline = payments(tmp_path / "events", tmp_path / "out", tables=tmp_path / "tables")
    runner = EpochRunner(pipeline, tmp_path / "state", RunSettings(max_records_per_epoch=1_000), spark=spark)
    runner.run_next()
    empty = runner.run(runner.cut_next(allow_empty=True).epoch)
    assert (empty.epoch, empty.records_in, empty.records_out, empty.state_bytes_written) == (2, 0, 0, 0)
    assert all(s.read_mode == "carried_forward" for s in empty.shards.values())
    for shard, info in runner.result(1).shards.items():
        new = runner.log.root / empty.shards[shard].snapshot.path
        assert empty.shards[shard].snapshot.files == info.snapshot.files
        assert all((new / n).stat().st_ino == (runner.log.root / info.snapshot.path / n).stat().st_ino
                   for n in info.snapshot.files)  # hardlinks: the same files
    sinks = {s.name: s for s in pipeline.sinks}
    assert sinks["delta"].committed_epoch("payments") == sinks["iceberg"].committed_epoch("payments") == 2
    assert_state_equal(runner.read_state(2), reference_state(log_records(1, 1_000, 100)))

    generate(tmp_path / "events", 1, 1_000, 100, first_file=1)
    runner.run_next()
    records = log_records(2, 1_000, 100)
    assert_state_equal(runner.read_state(), reference_state(records))
    assert_state_equal(sinks["delta"].read(), reference_state(records))


@pytest.mark.parametrize("string_keys", [False, True], ids=["int_keys", "string_keys"])
def test_resident_state_is_used_only_while_it_is_the_restored_snapshot(spark, tmp_path, string_keys):
    """Shards read state from their memory mirror between epochs; a mirror left behind
    by an epoch some other runner moved past (with the mirror off) is never used, and
    the next epoch that scans rebuilds it. State and outputs equal the reference.
    String keys are mirrored too (by hash, each string checked)."""
    from volley_dagster.state.resident import ResidentStateCache

    generate(tmp_path / "events", 5, 1_000, 400)
    pipeline = payments(tmp_path / "events", tmp_path / "out", string_keys=string_keys)
    cache = ResidentStateCache(str(tmp_path / "resident"))
    mirrored = EpochRunner(pipeline, tmp_path / "state", RunSettings(max_records_per_epoch=1_000, resident_state=cache), spark=spark)
    plain = EpochRunner(pipeline, tmp_path / "state", RunSettings(max_records_per_epoch=1_000, resident_state=None), spark=spark)
    modes = []
    for runner in (mirrored, mirrored, plain, mirrored, mirrored):
        result = runner.run_next()
        modes.append({s.read_mode for s in result.shards.values()})
    assert modes[0] == modes[1] == modes[4] == {"resident"}
    assert "resident" not in modes[2] | modes[3]  # epoch 4: the mirror is epoch 2's state
    assert modes[3] == {"scan"}  # 1,000 records touch most of 400 keys: scanned, so mirrored again
    records = log_records(5, 1_000, 400)
    state, outputs = mirrored.read_state(), read_sink(tmp_path / "out")
    if string_keys:
        assert all(k.startswith("m-") for k in state.column("merchant_id").to_pylist())
        state = state.set_column(0, "merchant_id", pc.cast(pc.utf8_slice_codeunits(state.column(0), 2), pa.int64()))
        outputs["merchant_id"] = outputs["merchant_id"].str[2:].astype("int64")
    assert_state_equal(state, reference_state(records))
    assert_epoch_outputs(outputs, records, {e: 1_000 for e in range(1, 6)})


def test_a_new_checkpoint_root_is_its_owners_alone(tmp_path):
    """State, dead letters and late records may hold record values: a root the runner
    creates is readable by its owner only (an existing one keeps its mode)."""
    generate(tmp_path / "events", 1, 10, 5)
    runner = EpochRunner(payments(tmp_path / "events", tmp_path / "out"), tmp_path / "ckpt" / "payments")
    assert (runner.log.root.stat().st_mode & 0o777) == 0o700


class _DownSink(MemorySink):
    """A sink whose store is down: every commit raises, as an outage does."""

    def commit(self, output: pa.Table, ctx: CommitContext) -> SinkCommitResult:
        raise OSError("the sink's store is down")


def test_an_attempt_says_how_far_it_got_and_a_failed_one_commits_nothing(spark, tmp_path):
    generate(tmp_path / "events", 1, 500, 50)
    pipeline = payments(tmp_path / "events", tmp_path / "out")
    down = replace(pipeline, sinks=(_DownSink(),))
    runner = EpochRunner(down, tmp_path / "state", spark=spark)
    rng = runner.cut_next()
    assert rng is not None
    with runner.lease() as lease:
        failed = EpochAttempt(spark, down, rng, runner.log.start_of(1, {}), runner.log, runner.settings, lease)
        assert failed.status is AttemptStatus.STARTED
        with pytest.raises(OSError, match="store is down"):
            failed.run()
        # the shard tasks snapshotted, the side outputs were written; no sink, no manifest
        assert failed.failed and failed.status is AttemptStatus.SIDE_OUTPUTS_WRITTEN
        assert not runner.log.is_committed(1)
        healed = EpochAttempt(spark, pipeline, rng, runner.log.start_of(1, {}), runner.log, runner.settings, lease)
        result = healed.run()
        token = lease.fence.token
    assert not healed.failed and healed.status is AttemptStatus.PRUNED
    assert runner.log.is_committed(1) and result.records_in == 500 and result.fencing_token == token
    assert_state_equal(runner.read_state(), reference_state(log_records(1, 500, 50)))
