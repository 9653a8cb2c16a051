"""The pending-window index without Spark: entries kept sorted by window end, due
entries popped in order, least recently used entries evicted to RocksDB beyond the
bound and still fired on time (a real RocksDB, through the shard transaction)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import rocksdict
from hypothesis import given, settings
from hypothesis import strategies as st

from volley_dagster.errors import StateLayoutError
from volley_dagster.state.keys import namespace_prefix
from volley_dagster.state.options import RocksDBOptions
from volley_dagster.state.pending_index import PendingIndex, PendingMeta, PersistentPendingIndex
from volley_dagster.state.transaction import ShardTransaction

META, EVICTED = namespace_prefix(4), namespace_prefix(3)


def keys(*names: str) -> np.ndarray:
    return np.array([n.encode() for n in names], dtype=object)


def ttl_epoch(txn: ShardTransaction, bound: int, names: np.ndarray, ends: list[int]) -> PersistentPendingIndex:
    """One epoch of a state TTL's index (latest ends evicted): add, flush, write."""
    pending = PersistentPendingIndex(txn, META, EVICTED, max_resident=bound, evict_latest=True)
    pending.add(names, np.array(ends), epoch=1)
    pending.flush()
    txn.flush()
    return pending


def test_due_entries_pop_in_end_order_and_the_index_round_trips():
    index = PendingIndex.empty()
    index.add(keys("c", "a"), np.array([30, 10]), epoch=1)
    index.add(keys("b"), np.array([20]), epoch=2)
    restored = PendingIndex.from_bytes(index.to_bytes())
    assert restored.ends.tolist() == [10, 20, 30] and restored.used.tolist() == [1, 2, 1]
    assert [k.decode() for k in restored.pop_due(20)] == ["a", "b"]
    assert restored.ends.tolist() == [30] and list(restored.pop_due(29)) == []


def test_eviction_drops_the_least_recently_used_and_among_equals_the_latest_ends():
    index = PendingIndex.empty()
    index.add(keys("a", "b", "c", "d"), np.array([10, 20, 30, 40]), epoch=1)
    index.touch([b"a"], epoch=3)
    evicted_keys, evicted_ends = index.evict_beyond(2)
    assert sorted(k.decode() for k in evicted_keys) == ["c", "d"] and sorted(evicted_ends.tolist()) == [30, 40]
    assert [k.decode() for k in index.keys] == ["a", "b"]


def test_evicted_entries_fire_from_rocksdb_on_time(tmp_path):
    db = rocksdict.Rdict(str(tmp_path / "db"), RocksDBOptions().build())
    try:
        txn = ShardTransaction(db)
        pending = PersistentPendingIndex(txn, META, EVICTED, max_resident=2)
        pending.add(keys("a", "b", "c", "d"), np.array([10, 20, 30, 40]), epoch=1)
        pending.flush()
        txn.flush()
        assert (pending.meta.resident, pending.meta.evicted, pending.evicted_now) == (2, 2, 2)

        again = PersistentPendingIndex(ShardTransaction(db), META, EVICTED, max_resident=2)
        assert again.may_fire(5)  # entries are evicted: it must look, it cannot know
        assert again.pop_due(5) == [] and again.evicted_fired == 0
        assert sorted(again.pop_due(35)) == [b"a", b"b", b"c"]  # two resident, one from RocksDB
        assert again.evicted_fired == 1 and again.meta.evicted == 1
    finally:
        db.close()


def test_latest_first_eviction_and_scans_that_start_past_the_last_limit(tmp_path):
    """State TTL's use: the latest deadlines are evicted (the earliest stay in memory to
    pop); a later scan starts past every deadline already popped; an epoch that pops only
    evicted entries, without loading the in-memory part, still persists its meta record."""
    db = rocksdict.Rdict(str(tmp_path / "db"), RocksDBOptions().build())
    try:
        pending = ttl_epoch(ShardTransaction(db), 1, keys("a", "b", "c"), [10, 20, 30])
        assert [k.decode() for k in pending.index.keys] == ["a"] and pending.meta.evicted == 2

        txn = ShardTransaction(db, scan_fraction=0.0)  # would scan for any read of keyed state
        popping = PersistentPendingIndex(txn, META, EVICTED, max_resident=1, evict_latest=True)
        assert not txn.scanned and txn.scanned_entries is None  # its own records: looked up, never a scan
        assert popping.pop_due(5) == [] and popping.meta.popped_to == 5
        popping.flush()  # the in-memory part was never loaded: only the meta record is written
        txn.flush()
        assert popping._index is None
        assert PersistentPendingIndex(ShardTransaction(db), META, EVICTED, None).meta.popped_to == 5

        txn = ShardTransaction(db)
        later = PersistentPendingIndex(txn, META, EVICTED, max_resident=1, evict_latest=True)
        assert sorted(later.pop_due(25)) == [b"a", b"b"] and later.meta.evicted == 1
        later.flush()
        txn.flush()
        stored = [k for k, _ in db.items(from_key=EVICTED) if k.startswith(EVICTED)]
        assert [k[len(EVICTED) + 8:] for k in stored] == [b"c"]  # the popped one left RocksDB
        final = PersistentPendingIndex(ShardTransaction(db), META, EVICTED, None)
        assert (final.meta.evicted, final.meta.popped_to) == (1, 25)
        assert final.pop_due(2**63 - 1) == [b"c"] and final.meta.popped_to == 25  # end of stream: not recorded
    finally:
        db.close()


class _AlwaysLoaded(PersistentPendingIndex):
    """The index as it was before new entries could go straight to RocksDB."""

    def _all_evicted_at_flush(self, ends: np.ndarray) -> bool:
        return False


def _stored(db: rocksdict.Rdict) -> dict[bytes, bytes]:
    """Everything the index wrote, its meta record aside (``evicted_now`` differs by design)."""
    return {k: v for k, v in db.items() if k.startswith(EVICTED) or (k.startswith(META) and k != META + b"meta")}


# per epoch: how far the limit moves on, and the new entries' ends after it
_EPOCHS = st.lists(st.tuples(st.integers(0, 30), st.lists(st.integers(1, 40), max_size=6)), min_size=1, max_size=8)


@settings(max_examples=150, deadline=None)
@given(epochs=_EPOCHS, bound=st.integers(1, 4))
def test_entries_past_a_full_index_go_straight_to_rocksdb_and_store_the_same(tmp_path_factory, epochs, bound):
    """State TTL's index (latest ends evicted): new entries that end after all of a full
    in-memory part are evicted without loading or rewriting it, and every epoch leaves
    RocksDB, the meta figures and the due keys exactly as loading it would."""
    root = tmp_path_factory.mktemp("pending")
    dbs = [rocksdict.Rdict(str(root / name), RocksDBOptions().build()) for name in ("direct", "loaded")]
    try:
        limit, serial = 0, 0
        for advance, offsets in epochs:
            limit += advance
            ends = np.array([limit + o for o in offsets], dtype=np.int64)  # past the limit, as ShardExpiry adds
            names = keys(*(f"k{serial + i:03d}" for i in range(len(offsets))))
            serial += len(offsets)
            seen = []
            for db, kind in zip(dbs, (PersistentPendingIndex, _AlwaysLoaded), strict=True):
                txn = ShardTransaction(db)
                pending = kind(txn, META, EVICTED, max_resident=bound, evict_latest=True)
                due = sorted(pending.pop_due(limit)) if pending.may_fire(limit) else []
                pending.add(names, ends, epoch=1)
                pending.flush()
                txn.flush()
                meta = pending.meta
                seen.append((due, meta.resident, meta.evicted, meta.min_end, meta.evicted_min, pending.next_due()))
            assert seen[0] == seen[1]
            assert _stored(dbs[0]) == _stored(dbs[1])
    finally:
        for db in dbs:
            db.close()


def test_a_full_index_is_not_loaded_for_entries_after_it(tmp_path):
    db = rocksdict.Rdict(str(tmp_path / "db"), RocksDBOptions().build())
    try:
        pending = ttl_epoch(ShardTransaction(db), 2, keys("a", "b", "c"), [10, 20, 30])
        assert (pending.meta.resident, pending.meta.max_end, pending.meta.evicted) == (2, 20, 1)

        later = ttl_epoch(ShardTransaction(db), 2, keys("d", "e"), [40, 25])
        assert later._index is None and later.evicted_now == 2  # never loaded: straight to RocksDB
        assert (later.meta.resident, later.meta.evicted, later.meta.evicted_min) == (2, 3, 25)

        txn = ShardTransaction(db)
        before = PersistentPendingIndex(txn, META, EVICTED, max_resident=2, evict_latest=True)
        before.add(keys("f"), np.array([15]), epoch=3)  # before the in-memory part's latest: loaded
        assert before._index is not None
        before.flush()
        txn.flush()
        assert [k.decode() for k in before.index.keys] == ["a", "f"] and before.meta.max_end == 15
        assert sorted(PersistentPendingIndex(ShardTransaction(db), META, EVICTED, None).pop_due(100)) == keys(
            "a", "b", "c", "d", "e", "f").tolist()
    finally:
        db.close()


def test_a_meta_record_from_a_newer_engine_is_refused_by_name():
    """A field this engine does not know (a newer engine's, which it relies on) is
    named in the error; an older record without the newest field still reads."""
    meta = PendingMeta(resident=3, min_end=10, max_end=30)
    assert PendingMeta.from_bytes(meta.to_bytes()) == meta
    older = {k: v for k, v in json.loads(meta.to_bytes()).items() if k != "max_end"}
    assert PendingMeta.from_bytes(json.dumps(older).encode()) == PendingMeta(resident=3, min_end=10)
    newer = json.dumps({**json.loads(meta.to_bytes()), "next_field": 1}).encode()
    with pytest.raises(StateLayoutError, match=r"\['next_field'\].*newer volley-dagster"):
        PendingMeta.from_bytes(newer)
