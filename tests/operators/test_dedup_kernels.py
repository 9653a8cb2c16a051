"""The deduplication's kernels without Spark, on a real RocksDB: 40 random epochs of
ids with copies inside an epoch and across epochs, event times that move on and
some that arrive late (past ``within`` behind the watermark: dropped as late); each
epoch's verdicts and what stays remembered equal a plain record-by-record fold of the
rule in ``volley_dagster.operators.dedup``. A shard written before runs (a key per
entry) is read as remembered and moved into runs by its next epoch. A probe's tally
crosses Spark as bytes and the shard task combines them unchanged."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import rocksdict

from volley_dagster.operators.base import ShardStep
from volley_dagster.operators.dedup import Deduplication, ProbeTally, SeenKeys, decide, first_occurrences
from volley_dagster.operators.dedup_state import LEGACY_BY_DEADLINE_NS, LEGACY_SEEN_NS, RUNS_NS, read_remembered
from volley_dagster.operators.event_time import EventTime
from volley_dagster.state.keys import ShardLayout, encode_keys, namespace_prefix
from volley_dagster.state.options import RocksDBOptions
from volley_dagster.state.pending_index import ordered_us
from volley_dagster.state.transaction import ShardTransaction, scan_prefix

WITHIN = 30


@pytest.mark.parametrize("kind", ["int", "str"])
def test_verdicts_and_memory_equal_a_plain_fold_over_random_epochs(tmp_path, kind):
    dedup = Deduplication(("id",), WITHIN, EventTime("t"))
    layout = ShardLayout(2, 8)  # this DB is shard 1: key groups 4..7
    rng = np.random.default_rng(7)
    db = rocksdict.Rdict(str(tmp_path / "db"), RocksDBOptions().build())
    remembered: dict[object, int] = {}  # the fold: id -> event time of its kept record
    watermark: int | None = None
    forgotten_total = late_total = 0
    try:
        for epoch in range(1, 41):
            n = int(rng.integers(0, 60))
            ids = rng.integers(0, 150, n)
            times = epoch * 10 + rng.integers(-40, 10, n)  # some far behind: late, past the bound
            keys = pa.array(ids, pa.int64()) if kind == "int" else pa.array([f"e-{i}" for i in ids], pa.string())
            key_groups = (ids % 4 + 4).astype(np.int64)
            positions = rng.permutation(n).astype(np.int64) + epoch * 1000  # log order is not row order
            txn = ShardTransaction(db)
            found = read_remembered(txn, kind)
            verdicts = decide(dedup, found, keys, positions, times.astype(np.int64), watermark)
            expected, expected_late, kept_now = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool), {}
            for row in np.argsort(positions, kind="stable"):
                key = keys[int(row)].as_py()
                if watermark is not None and int(times[row]) + WITHIN <= watermark:
                    expected_late[row] = True
                elif key in remembered or key in kept_now:
                    expected[row] = True
                else:
                    kept_now[key] = int(times[row])
            assert verdicts.duplicate.tolist() == expected.tolist(), f"epoch {epoch}"
            assert verdicts.late.tolist() == expected_late.tolist(), f"epoch {epoch}"
            late_total += int(expected_late.sum())
            before = watermark
            if n:
                watermark = max(watermark if watermark is not None else -(2**40), int(times.max()))
            seen = SeenKeys(dedup, txn, ShardStep(epoch, kind, watermark_before=before, watermark=watermark,
                                                  layout=layout, shard=1))
            kept = np.flatnonzero(verdicts.kept)
            figures = seen.settle(key_groups[kept], keys.take(pa.array(kept)), times[kept].astype(np.int64), found)
            forgotten_total += figures["dedup_keys_forgotten"]
            txn.flush()
            remembered.update(kept_now)
            remembered = {k: t for k, t in remembered.items() if watermark is None or t + WITHIN > watermark}
            assert stored_memory(db, kind) == remembered, f"epoch {epoch}: memory is the bound's"
            groups = {int.from_bytes(k[2:4], "big") for k, _ in scan_prefix(db, namespace_prefix(RUNS_NS))}
            assert groups <= set(range(4, 8)), "runs stay in the shard's key groups"
        assert forgotten_total > 100 and late_total > 50
    finally:
        db.close()


def stored_memory(db: rocksdict.Rdict, kind: str) -> dict[object, int]:
    """Every remembered key and its event time, as the shard's runs hold them."""
    found = read_remembered(ShardTransaction(db), kind)
    assert len(set(found.keys.to_pylist())) == len(found.keys), "a key is remembered once"
    return dict(zip(found.keys.to_pylist(), found.times.tolist(), strict=True))


@pytest.mark.parametrize("kind", ["int", "str"])
def test_a_shard_written_before_runs_is_remembered_and_moved_into_runs(tmp_path, kind):
    """Per-key entries (``key -> time`` and the deadline index) as epochs before runs
    wrote them: the next epoch drops their copies as duplicates, forgets the due ones,
    moves the rest into its runs and leaves the old namespaces empty."""
    dedup = Deduplication(("id",), WITHIN, EventTime("t"))
    db = rocksdict.Rdict(str(tmp_path / "db"), RocksDBOptions().build())
    try:
        ids = np.arange(10)
        keys = pa.array(ids, pa.int64()) if kind == "int" else pa.array([f"e-{i}" for i in ids], pa.string())
        groups, times = (ids % 4 + 4).astype(np.int64), (100 + ids).astype(np.int64)  # deadlines 130..139
        seen = encode_keys(LEGACY_SEEN_NS, groups, keys)
        for key, group, at in zip(seen, groups, times, strict=True):
            db[key] = int(at).to_bytes(8, "little", signed=True)
            index = namespace_prefix(LEGACY_BY_DEADLINE_NS) + int(group).to_bytes(2, "big")
            db[index + ordered_us(np.array([at + WITHIN])).tobytes() + key[4:]] = b""
        txn = ShardTransaction(db)
        found = read_remembered(txn, kind)
        assert found.legacy and stored_memory(db, kind) == dict(zip(keys.to_pylist(), times.tolist(), strict=True))
        new = pa.array([3, 42], pa.int64()) if kind == "int" else pa.array(["e-3", "e-42"], pa.string())
        verdicts = decide(dedup, found, new, np.array([1, 2]), np.array([120, 121]), watermark=125)
        assert verdicts.duplicate.tolist() == [True, False] and not verdicts.late.any()
        step = ShardStep(5, kind, watermark_before=125, watermark=134, layout=ShardLayout(2, 8), shard=1)
        figures = SeenKeys(dedup, txn, step).settle(np.array([6]), new.take(pa.array([1])), np.array([121]), found)
        txn.flush()
        assert figures == {"dedup_keys_remembered": 1, "dedup_keys_forgotten": 5}  # deadlines 130..134 are due
        expected = {k: t for k, t in zip(keys.to_pylist(), times.tolist(), strict=True) if t + WITHIN > 134}
        assert stored_memory(db, kind) == {**expected, new[1].as_py(): 121}
        for ns in (LEGACY_SEEN_NS, LEGACY_BY_DEADLINE_NS):
            assert not list(scan_prefix(db, namespace_prefix(ns))), f"namespace {ns} emptied"
        assert not read_remembered(ShardTransaction(db), kind).legacy
        # per-key entries beside runs (never written so by the engine): both are read, a
        # partly due run is rewritten and the entries move into the epoch's runs
        db[encode_keys(LEGACY_SEEN_NS, np.array([7]), new.take(pa.array([0])))[0]] = (150).to_bytes(8, "little")
        txn = ShardTransaction(db)
        found = read_remembered(txn, kind)
        assert found.legacy and stored_memory(db, kind) == {**expected, new[1].as_py(): 121, new[0].as_py(): 150}
        step = ShardStep(6, kind, watermark_before=134, watermark=137, layout=ShardLayout(2, 8), shard=1)
        figures = SeenKeys(dedup, txn, step).settle(np.zeros(0, np.int64), new.slice(0, 0), np.zeros(0, np.int64), found)
        txn.flush()
        assert figures == {"dedup_keys_remembered": 0, "dedup_keys_forgotten": 3}  # deadlines 135..137: kg 7's run goes
        assert stored_memory(db, kind) == {**{k: t for k, t in expected.items() if t + WITHIN > 137},
                                           new[1].as_py(): 121, new[0].as_py(): 150}
        assert not read_remembered(ShardTransaction(db), kind).legacy
    finally:
        db.close()


def test_probe_tallies_cross_as_bytes_and_combine_to_the_latest_time_and_the_sums():
    tallies = [ProbeTally(None), ProbeTally(-5, 3, 1), ProbeTally(2**62, 0, 7), ProbeTally(None, 2, 0)]
    assert [ProbeTally.from_bytes(t.to_bytes()) for t in tallies] == tallies
    assert ProbeTally.combined(tallies) == ProbeTally(2**62, 5, 8)
    assert ProbeTally.combined([ProbeTally(None), ProbeTally(None, 1, 1)]) == ProbeTally(None, 1, 1)
    assert ProbeTally.combined([]) == ProbeTally(None)
    assert {ProbeTally.key_group(s) for s in range(4)} == {-1, -2, -3, -4}  # never a key group of a run


def test_the_rows_of_one_record_are_one_event_kept_or_dropped_together():
    """A transform that explodes a record gives several rows one position (review J1):
    rows of the key's first record are all first, whatever their order; a later
    record's rows with that key are all duplicates, and other keys are decided alone."""
    keys = pa.array(["a", "b", "a", "a", "b", "c", "a"])
    positions = np.array([5, 5, 5, 9, 2, 9, 5])
    assert first_occurrences(keys, positions).tolist() == [True, False, True, False, True, True, True]
    shuffled = np.array([6, 3, 0, 5, 2, 1, 4])
    again = first_occurrences(keys.take(pa.array(shuffled)), positions[shuffled])
    assert again.tolist() == [True, False, True, True, True, False, True]
