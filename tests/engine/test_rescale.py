"""Rescaling on real Spark and RocksDB: 4 -> 7 -> 2 shards over a multi-epoch run
gives the reference state after every epoch and the outputs of a run that never
rescaled; windows fire as the reference says across rescales, with evicted
pending-index entries; the refusals; and kill -9 in the middle of a rescale."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

from tests.engine.test_windows import check_against_reference
from tests.helpers import assert_epoch_outputs, assert_state_equal, log_records, payments, read_sink, reference_state
from tests.window_reference import reference, window_pipeline
from volley_dagster import ConfigError, EpochOrderError, EpochRunner, SnapshotError, StateLayoutError, session, sliding
from volley_dagster.checkpoint.manifest import ShardSnapshot
from volley_dagster.demo.events import generate
from volley_dagster.operators.window_state import META_NS, PENDING_NS
from volley_dagster.settings import RunSettings
from volley_dagster.state.keys import ShardLayout, namespace_prefix
from volley_dagster.state.pending_index import PendingIndex, PendingMeta
from volley_dagster.state.store import open_snapshot_read_only
from volley_dagster.state.transaction import scan_prefix

ROOT = Path(__file__).resolve().parents[2]
FILES, PER_FILE, KEYS = 9, 500, 400  # one file per epoch


def consumed(results, epoch: int) -> int:
    return sum(r.records_in for r in results if r.epoch <= epoch)


def test_running_aggregate_4_to_7_to_2_equals_reference(spark, tmp_path):
    generate(tmp_path / "events", FILES, PER_FILE, KEYS)
    records = log_records(FILES, PER_FILE, KEYS)
    runner = EpochRunner(payments(tmp_path / "events", tmp_path / "out", shards=4), tmp_path / "state", RunSettings(max_records_per_epoch=PER_FILE, keep_epochs=2), spark=spark)
    results = []

    def run_epochs(n: int, shards: int) -> None:
        for _ in range(n):
            result = runner.run_next()
            results.append(result)
            assert sorted(map(int, result.shards)) == list(range(shards))
            assert_state_equal(runner.read_state(), reference_state(records.slice(0, consumed(results, result.epoch))))

    run_epochs(3, 4)
    first = runner.rescale(7)
    assert (first.epoch, first.from_epoch, first.old_shards, first.new_shards, first.noop) == (3, 4, 4, 7, False)
    assert first.keys == runner.read_state().num_rows and 0 < first.keys_moved < first.keys
    assert first.bytes_written > 0 and first.sequence == 1
    assert_state_equal(runner.read_state(), reference_state(records.slice(0, consumed(results, 3))))  # the rewrite
    assert runner.log.layout_for(3) == ShardLayout(4) and runner.log.layout_for(4) == ShardLayout(7)
    assert runner.rescale(7).noop and len(runner.log.layout_changes()) == 1  # same count: nothing happens

    run_epochs(3, 7)
    assert runner.log.retained_snapshots() == [5, 6]  # retention took epoch 3 and its rewrite
    with pytest.raises(SnapshotError, match="removed by retention"):
        runner.read_state(3)
    second = runner.rescale(2)
    assert (second.epoch, second.old_shards, second.new_shards, second.keys) == (6, 7, 2, runner.read_state().num_rows)
    assert runner.log.describe_layouts() == "from epoch 1: 4 shards; from epoch 4: 7 shards; from epoch 7: 2 shards"
    assert_state_equal(runner.read_state(5), reference_state(records.slice(0, consumed(results, 5))))

    run_epochs(2, 2)
    # the pipeline code may name the initial (4) or the current (2) shard count, nothing else
    with pytest.raises(StateLayoutError, match=r"(?s)num_shards.*After rescales the state has 2 shards"):
        EpochRunner(payments(tmp_path / "events", tmp_path / "out", shards=5), tmp_path / "state", RunSettings(max_records_per_epoch=PER_FILE), spark=spark).run_next()
    runner = EpochRunner(payments(tmp_path / "events", tmp_path / "out", shards=2), tmp_path / "state", RunSettings(max_records_per_epoch=PER_FILE, keep_epochs=2), spark=spark)
    run_epochs(1, 2)
    assert [r.epoch for r in results] == list(range(1, FILES + 1))
    assert_epoch_outputs(read_sink(tmp_path / "out"), records, {r.epoch: r.records_in for r in results})

    # a run that never rescaled commits the same outputs, epoch by epoch
    never = EpochRunner(payments(tmp_path / "events", tmp_path / "out_fixed", shards=4), tmp_path / "state_fixed", RunSettings(max_records_per_epoch=PER_FILE), spark=spark).run_available()
    assert len(never) == FILES
    for fixed, rescaled in zip(never, results):
        pd.testing.assert_frame_equal(rescaled.output.to_pandas(), fixed.output.to_pandas(), check_exact=False, rtol=1e-12,
                                      obj=f"epoch {fixed.epoch}'s output")


WINDOW_FILES, WINDOW_PER_FILE, WINDOW_KEYS = 10, 300, 20  # as tests/engine/test_windows.py


def pending_of(runner: EpochRunner, shards: dict[int, ShardSnapshot]) -> list[tuple[PendingMeta, PendingIndex, int]]:
    """Per shard: the meta record, the in-memory index and the evicted entries' count."""
    out = []
    for _, snap in sorted(shards.items()):
        db = open_snapshot_read_only(runner.log.root / snap.path)
        try:
            meta_ns = namespace_prefix(META_NS)
            meta, index = db.get([meta_ns + b"meta", meta_ns + b"index"])
            evicted = sum(1 for _ in scan_prefix(db, namespace_prefix(PENDING_NS)))
        finally:
            db.close()
        out.append((PendingMeta.from_bytes(meta), PendingIndex.from_bytes(index), evicted))
    return out


def check_pending_split(runner: EpochRunner, epoch: int, new: ShardLayout) -> int:
    """The rewritten index holds the old entries, each in the shard of its key group,
    with meta records that count them; returns the evicted entries."""
    before = pending_of(runner, {s: entry.snapshot for s, entry in runner.result(epoch).shards.items()})
    after = pending_of(runner, runner.log.state_shards(epoch))
    assert len(after) == new.num_shards
    entries = lambda rows: sorted((k, e, u) for _, ix, _ in rows for k, e, u in zip(ix.keys, ix.ends, ix.used))  # noqa: E731
    assert entries(after) == entries(before)
    for shard, (meta, index, evicted) in enumerate(after):
        lo, hi = new.key_group_range(shard)
        assert all(lo <= int.from_bytes(k[2:4], "big") < hi for k in index.keys)
        assert list(index.ends) == sorted(index.ends)
        assert (meta.resident, meta.evicted) == (len(index), evicted)
        assert meta.min_end == (int(index.ends[0]) if len(index) else None)
    assert sum(e for *_, e in after) == sum(e for *_, e in before)
    return sum(e for *_, e in after)


@pytest.mark.parametrize(
    ("windows", "max_pending"),
    [(sliding("20 seconds", "10 seconds"), 3), (session("8 seconds"), None)],
    ids=["sliding-bounded-index", "session"],
)
def test_windows_fire_as_reference_across_rescales(spark, tmp_path, windows, max_pending):
    files = generate(tmp_path / "events", WINDOW_FILES, WINDOW_PER_FILE, WINDOW_KEYS, events_per_second=10, disorder_s=30)
    pipeline = window_pipeline(tmp_path / "events", tmp_path / "out", windows, delay="5 seconds", lateness="2 seconds",
                               max_pending=max_pending, shards=4)
    runner = EpochRunner(pipeline, tmp_path / "state", RunSettings(max_records_per_epoch=WINDOW_PER_FILE, keep_epochs=WINDOW_FILES + 2), spark=spark)  # every epoch's late records are read back at the end
    results = runner.run_available(max_epochs=3)
    for shards, run_after in ((7, 3), (2, 3)):
        open_before = runner.read_state()
        result = runner.rescale(shards)
        assert runner.read_state().equals(open_before)  # every open window, in its new shard
        evicted = check_pending_split(runner, result.epoch, ShardLayout(shards))
        assert result.pending_entries == evicted
        if max_pending is not None:
            assert evicted > 0, "the bounded index should have evicted entries when the rescale happens"
        results += runner.run_available(max_epochs=run_after)
    results += runner.run_available()
    results += runner.flush()
    assert [len(r.shards) for r in results] == [4] * 3 + [7] * 3 + [2] * 5
    ref = reference([tmp_path / "events" / f for f in files], windows, 5_000_000, 2_000_000, end_of_stream=False)
    check_against_reference(runner, results, ref)
    if max_pending is not None:
        assert all(s.operator.figures["pending_resident"] <= max_pending for r in results for s in r.shards.values())


def test_a_rescale_takes_the_epochs_cut_but_not_committed_along(spark, tmp_path):
    """Ranges do not depend on the layout, and under the lease no attempt of a cut epoch
    runs meanwhile: a sensor that keeps cutting never blocks a rescale. Only the CLI,
    which has no pipeline code to ask the sinks whether one holds such an epoch, waits
    until it committed."""
    generate(tmp_path / "events", 2, 300, 100)
    runner = EpochRunner(payments(tmp_path / "events", tmp_path / "out", shards=3), tmp_path / "state", RunSettings(max_records_per_epoch=300), spark=spark)
    with pytest.raises(EpochOrderError, match="no epoch is committed yet"):
        runner.rescale(5)
    runner.run_next()
    runner.cut_next()
    refused = volley("rescale", str(tmp_path / "state"), "--shards", "5")
    assert refused.returncode == 1 and "epoch 2 is cut but not committed" in refused.stderr and "Run it, then rescale" in refused.stderr
    assert runner.log.layout_changes() == [] and not (tmp_path / "state" / "layouts").exists()
    for bad in (0, 257):
        with pytest.raises(ConfigError, match="num_shards must be in 1..num_key_groups"):
            runner.rescale(bad)
    assert runner.rescale(3).noop
    assert runner.rescale(5).new_shards == 5
    assert len(runner.run(2).shards) == 5  # the cut epoch runs in the new layout
    assert_state_equal(runner.read_state(), reference_state(log_records(2, 300, 100)))


def test_the_rescale_cli_waits_for_the_lease_of_a_running_pipeline(spark, tmp_path):
    """``volley rescale`` while a run holds the pipeline's lease: it waits, writes nothing
    meanwhile, and rescales once the run lets go."""
    generate(tmp_path / "events", 1, 300, 100)
    state = tmp_path / "state"
    runner = EpochRunner(payments(tmp_path / "events", tmp_path / "out", shards=3), state, spark=spark)
    runner.run_next()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with runner.lease(owner="a run"):
        busy = subprocess.run([sys.executable, "-m", "volley_dagster.cli", "rescale", str(state), "--shards", "5",
                               "--wait", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert busy.returncode == 1 and "pipeline 'payments' is busy" in busy.stderr and "(a run)" in busy.stderr
        waiting = subprocess.Popen([sys.executable, "-m", "volley_dagster.cli", "rescale", str(state), "--shards", "5"],
                                   cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        said: queue.Queue[str] = queue.Queue()
        reader = threading.Thread(target=lambda: [said.put(line) for line in waiting.stderr], daemon=True)  # type: ignore[union-attr]
        reader.start()
        # until it says it waits (its imports take seconds on a loaded machine), then a while longer
        first = said.get(timeout=120)
        assert "waiting for the lease of 'payments'" in first, first
        time.sleep(1)
        assert waiting.poll() is None and runner.log.layout_changes() == []  # waits, writes nothing
    out, _ = waiting.communicate(timeout=120)
    reader.join(timeout=10)
    rest = [said.get_nowait() for _ in range(said.qsize())]
    assert waiting.returncode == 0, "".join(rest)
    assert runner.layout() == ShardLayout(5)


def volley(*args: str, kill_at: str | None = None, shard: int | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if kill_at:
        env["VOLLEY_KILL_AT"] = kill_at
    if shard is not None:
        env["VOLLEY_KILL_SHARD"] = str(shard)
    return subprocess.run([sys.executable, "-m", "volley_dagster.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_kill_during_rescale_leaves_old_or_new_layout(spark, tmp_path):
    generate(tmp_path / "events", 3, 500, 200)
    records = log_records(3, 500, 200)
    state = tmp_path / "state"
    runner = EpochRunner(payments(tmp_path / "events", tmp_path / "out", shards=3), state, RunSettings(max_records_per_epoch=500), spark=spark)
    runner.run_available(max_epochs=2)
    expected = reference_state(records.slice(0, 1_000))

    for point, shard in (("rescale_after_shard", 2), ("rescale_before_commit", None)):
        killed = volley("rescale", str(state), "--shards", "5", kill_at=point, shard=shard)
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        assert runner.layout() == ShardLayout(3) and runner.log.layout_changes() == []  # the old layout, whole
        assert_state_equal(runner.read_state(), expected)

    killed = volley("rescale", str(state), "--shards", "5", kill_at="rescale_after_commit")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert runner.layout() == ShardLayout(5)  # the new layout, whole
    assert_state_equal(runner.read_state(), expected)
    again = volley("rescale", str(state), "--shards", "5")
    assert again.returncode == 0 and "already 5 shards: nothing to do" in again.stdout
    attempts = sorted(p.name.rsplit("-", 1)[0] for p in (state / "snapshots" / "0000000002").glob("rescale-*"))
    assert attempts == ["rescale-0001"] * 3  # two killed attempts' leftovers, unreferenced, and the committed one

    result = runner.run_next()
    assert result.epoch == 3 and len(result.shards) == 5
    assert_state_equal(runner.read_state(), reference_state(records))
    inspect = volley("inspect", str(state))
    assert "layouts/0000000001.json  from epoch 3: 5 shards (was 3; epoch 2's state rewritten)" in inspect.stdout
    refused = volley("rescale", str(state), "--shards", "999")
    assert refused.returncode == 1 and "num_shards must be in 1..num_key_groups (256), got 999" in refused.stderr
