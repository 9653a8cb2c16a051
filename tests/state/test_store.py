"""RocksDB shard store: restore never mutates a snapshot, writes go through one
WriteBatch, snapshots share unchanged files by hardlink and are verified."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import tree_digest
from volley_dagster.errors import ConfigError, SnapshotError
from volley_dagster.state.keys import ShardLayout, decode_keys, encode_keys, in_state_order, namespace_prefix
from volley_dagster.state.options import RocksDBOptions
from volley_dagster.state.store import ShardStore, SnapshotInfo, open_snapshot_read_only, verify_snapshot
from volley_dagster.state.transaction import strictly_ascending

NS = namespace_prefix(1)


def keys_for(values):
    arr = pa.array(values, pa.int64())
    return encode_keys(1, np.arange(len(values)) % 256, arr)


_MODEL_KEYS = [bytes([ns]) + bytes([i]) for ns in (1, 5, 6) for i in range(0, 40, 3)]
_WRITES = st.lists(st.tuples(
    st.sampled_from(["sorted", "as_drawn", "delete", "read"]),
    st.lists(st.sampled_from(_MODEL_KEYS), max_size=12),
    st.binary(min_size=1, max_size=3)), max_size=8)


@settings(max_examples=150, deadline=None)
@given(epochs=st.lists(_WRITES, min_size=1, max_size=3))
def test_a_transaction_writes_what_a_dict_of_its_writes_holds(tmp_path_factory, epochs):
    """Batches kept as given (each in key order: several namespaces' at once), the cache,
    deletions and reads between them, over epochs: RocksDB ends as a dict taking every
    write in turn would, and each flush writes each dirty key once."""
    store = ShardStore.restore(None, None, tmp_path_factory.mktemp("txn") / "work")
    model: dict[bytes, bytes] = {}
    try:
        for writes in epochs:
            txn, dirty = store.transaction(), set()
            for kind, keys, value in writes:
                if kind == "read":
                    assert txn.get_many(keys, keys[0][:1] if keys else b"\x01", may_scan=False) == [
                        model.get(k) for k in keys]
                    continue
                if kind == "delete":
                    txn.delete_many(keys)
                    model.update(dict.fromkeys(keys, None))  # type: ignore[arg-type]
                else:
                    if kind == "sorted":
                        keys = sorted(set(keys))
                    values = [value + bytes([i]) for i in range(len(keys))]
                    txn.set_many(keys, values)
                    model.update(zip(keys, values, strict=True))
                dirty.update(keys)
            assert txn.dirty == len(dirty) and txn.flush() == len(dirty)
            model = {k: v for k, v in model.items() if v is not None}
            assert dict(store.db.items()) == model
    finally:
        store.close()


def test_restore_write_snapshot_cycle(tmp_path):
    store = ShardStore.restore(None, None, tmp_path / "work1")
    txn = store.transaction()
    keys = keys_for(range(1000))
    txn.set_many(keys, [i.to_bytes(4, "big") for i in range(1000)])
    assert txn.flush() == 1000 and txn.dirty == 0
    snap1 = store.snapshot(tmp_path / "snaps" / "1", None, None)
    store.close()
    assert not (tmp_path / "work1").exists()
    assert snap1.bytes_new == snap1.bytes_total > 0

    before = tree_digest(snap1.path)
    store = ShardStore.restore(snap1.path, snap1.files, tmp_path / "work2")
    txn = store.transaction(scan_fraction=10.0)  # force multi_get
    got = txn.get_many(keys[:3] + keys_for([5000]), NS)
    assert got == [i.to_bytes(4, "big") for i in range(3)] + [None] and not txn.scanned
    txn.set_many(keys[:10], [b"new"] * 10)
    txn.delete_many(keys[10:20])
    assert txn.get_many(keys[8:12], NS) == [b"new", b"new", None, None]  # reads see the cache
    txn.flush()
    snap2 = store.snapshot(tmp_path / "snaps" / "2", snap1.path, snap1.files)
    store.close()
    assert tree_digest(snap1.path) == before  # the restored snapshot is byte-identical
    shared = [n for n in snap2.files if n.endswith(".sst") and n in snap1.files]
    assert shared and os.path.samefile(snap1.path / shared[0], snap2.path / shared[0])
    assert snap2.bytes_new < snap2.bytes_total

    db = open_snapshot_read_only(snap2.path)
    try:
        items = dict(db.items())
    finally:
        db.close()
    assert len(items) == 990 and items[keys[0]] == b"new" and keys[15] not in items


def test_a_restore_never_opens_the_snapshot_and_copies_one_on_another_filesystem(tmp_path):
    """rocksdict rewrites ``rocksdict-config.json`` at every open, read-only too (for a
    moment the file is empty): a restore leaves every file of the snapshot untouched,
    mtimes included. A snapshot on another filesystem (a cache the snapshot store
    restored into) cannot be hardlinked: it is copied, and reads the same."""
    store = ShardStore.restore(None, None, tmp_path / "work1")
    keys = keys_for(range(500))
    txn = store.transaction()
    txn.set_many(keys, [b"v"] * 500)
    txn.flush()
    snap = store.snapshot(tmp_path / "snaps" / "1", None, None)
    store.close()
    touched = {p.name: p.stat().st_mtime_ns for p in snap.path.iterdir()}
    time.sleep(0.01)
    ShardStore.restore(snap.path, snap.files, tmp_path / "work2").close()
    assert {p.name: p.stat().st_mtime_ns for p in snap.path.iterdir()} == touched

    elsewhere = Path(tempfile.mkdtemp(dir="/dev/shm"))  # tmpfs: another filesystem than the test's
    try:
        assert elsewhere.stat().st_dev != tmp_path.stat().st_dev
        shutil.copytree(snap.path, elsewhere / "1")
        store = ShardStore.restore(elsewhere / "1", snap.files, tmp_path / "work3")
        try:
            assert store.transaction().get_many(keys[:2], NS) == [b"v", b"v"]
        finally:
            store.close()
    finally:
        shutil.rmtree(elsewhere)


def test_a_shard_compacts_its_level_0_when_due_and_keeps_every_write(tmp_path):
    """A shard is open for one epoch, too briefly for RocksDB's background compactions:
    its snapshot folds level 0 into the base when ``compaction_due``, so level 0 stays
    bounded over a long history (without it, a file an epoch, for ever), and every write,
    deletion included, survives."""
    options = RocksDBOptions(compact_l0_files=4, compact_l0_share=2.0)
    rng = np.random.default_rng(3)
    model: dict[bytes, bytes] = {}
    snap, level0, compactions = None, [], 0
    for epoch in range(1, 25):
        store = ShardStore.restore(snap.path if snap else None, snap.files if snap else None,
                                   tmp_path / f"work{epoch}", options)
        txn = store.transaction()
        ids = sorted(rng.choice(5000, 5000 if epoch == 1 else 400, replace=False).tolist())
        keys = keys_for(ids)
        order = sorted(range(len(keys)), key=keys.__getitem__)
        keys, values = [keys[i] for i in order], [epoch.to_bytes(2, "big") + bytes(30) for _ in order]
        txn.set_many(keys, values)
        model.update(zip(keys, values, strict=True))
        gone = keys[:20] if epoch % 5 == 0 else []
        txn.delete_many(gone)
        for k in gone:
            model.pop(k)
        txn.flush()
        snap = store.snapshot(tmp_path / "snaps" / str(epoch), snap.path if snap else None,
                              snap.files if snap else None)
        store.close()
        level0.append(snap.level0_files)
        compactions += snap.compacted
    assert compactions >= 5 and max(level0) < options.compact_l0_files
    assert level0 != sorted(level0), "level 0 only grew: nothing was compacted"
    db = open_snapshot_read_only(snap.path)
    try:
        assert dict(db.items()) == model
        assert sum(1 for f in db.live_files() if f["level"] == 0) == snap.level0_files
    finally:
        db.close()


def test_a_lone_level_0_file_is_never_compacted_and_churn_is_bounded_by_share():
    """The policy alone: the first epoch's file is the base until a compaction makes
    one; a shard compacts on its turn, out of it only at the cap or once its newer
    files pass the share (a shard rewritten whole every epoch)."""
    options = RocksDBOptions(compact_every=10, compact_together=1, compact_l0_files=20, compact_l0_share=2.0)
    assert not options.compaction_due(1, 0, 100) and not options.compaction_due(1, 0, 100, turn=True)
    assert not options.compaction_due(3, 200, 100)
    assert options.compaction_due(4, 300, 100)
    assert options.compaction_due(20, 10, 1000)
    assert not options.compaction_due(19, 10, 1000)
    assert options.compaction_due(2, 10, 1000, turn=True)
    assert [e for e in range(30) if options.compaction_turn(e, 3)] == [3, 13, 23]
    assert [e for e in range(30) if options.compaction_turn(e, 13)] == [3, 13, 23]
    pairs = RocksDBOptions(compact_every=10, compact_together=2)
    assert [s for s in range(6) if pairs.compaction_turn(21, s)] == [2, 3]
    with pytest.raises(ConfigError, match="compact_every must be at least 1, got 0"):
        RocksDBOptions(compact_every=0)


def test_shards_compact_on_their_turns_not_in_the_same_epoch(tmp_path):
    """Four shards with the same churn, two running at once: each pair compacts on its
    own turn, so no epoch compacts more than a pair (before turns, every shard compacted
    in the same epoch: a spike of four compactions), level 0 stays within a turn's
    files, and every shard keeps every write."""
    options = RocksDBOptions(compact_every=6, compact_together=2, compact_l0_files=12, compact_l0_share=100.0)
    rng = np.random.default_rng(5)
    shards = range(4)
    snaps: dict[int, SnapshotInfo | None] = {s: None for s in shards}
    models: dict[int, dict[bytes, bytes]] = {s: {} for s in shards}
    compacted_in: dict[int, list[int]] = {}
    level0: list[int] = []
    for epoch in range(30):
        for shard in shards:
            prev = snaps[shard]
            store = ShardStore.restore(prev.path if prev else None, prev.files if prev else None,
                                       tmp_path / f"w{shard}-{epoch}", options)
            ids = sorted(rng.choice(3000, 3000 if epoch == 0 else 300, replace=False).tolist())
            keys = keys_for([shard * 10_000 + i for i in ids])
            keys.sort()
            values = [epoch.to_bytes(2, "big") + bytes(20)] * len(keys)
            txn = store.transaction()
            txn.set_many(keys, values)
            txn.flush()
            models[shard].update(zip(keys, values, strict=True))
            snap = store.snapshot(tmp_path / "s" / f"{shard}-{epoch}", prev.path if prev else None,
                                  prev.files if prev else None, options.compaction_turn(epoch, shard))
            store.close()
            snaps[shard] = snap
            assert snap.level0_files is not None
            level0.append(snap.level0_files)
            if snap.compacted:
                compacted_in.setdefault(epoch, []).append(shard)
    assert compacted_in and all(s in ([0, 1], [2, 3]) for s in compacted_in.values()), compacted_in
    assert sum(len(s) for s in compacted_in.values()) >= 3 * len(shards)
    assert max(level0) <= options.compact_every
    for shard in shards:
        last = snaps[shard]
        assert last is not None
        db = open_snapshot_read_only(last.path)
        try:
            assert dict(db.items()) == models[shard]
        finally:
            db.close()


def test_a_shard_runs_no_background_compaction(tmp_path):
    """Many level-0 files past RocksDB's own trigger (4): a shard opened on them leaves
    them as they are (its compactions were dropped unfinished at every close, a core lost)."""
    options = RocksDBOptions(compact_l0_files=1000, compact_l0_share=1e9)  # never by the policy
    snap = None
    for epoch in range(1, 9):
        store = ShardStore.restore(snap.path if snap else None, snap.files if snap else None,
                                   tmp_path / f"w{epoch}", options)
        txn = store.transaction()
        txn.set_many(keys_for(range(epoch * 100, epoch * 100 + 300)), [b"v" * 20] * 300)
        txn.flush()
        snap = store.snapshot(tmp_path / "s" / str(epoch), snap.path if snap else None, snap.files if snap else None)
        store.close()
    store = ShardStore.restore(snap.path, snap.files, tmp_path / "open", options)
    try:
        before = sorted(f["name"] for f in store.db.live_files())
        time.sleep(1.0)
        assert store.db.property_int_value("rocksdb.num-running-compactions") == 0
        assert sorted(f["name"] for f in store.db.live_files()) == before and len(before) == 8
    finally:
        store.close()


def test_scan_is_used_when_most_keys_are_touched(tmp_path):
    store = ShardStore.restore(None, None, tmp_path / "w")
    keys = keys_for(range(200))
    txn = store.transaction()
    txn.set_many(keys, [b"v"] * 200)
    txn.flush()
    txn = store.transaction(scan_fraction=0.5)
    assert txn.get_many(keys[:150], NS) == [b"v"] * 150 and txn.scanned
    store.close()


def test_snapshot_never_replaces_an_existing_one(tmp_path):
    """Attempts write their own snapshot directories: one that exists (another
    attempt's, perhaps the one a manifest names) is left byte for byte as it was."""
    target = tmp_path / "snaps" / "shard-0000-aaaa"
    target.mkdir(parents=True)
    (target / "CURRENT").write_text("written by the attempt that won")
    store = ShardStore.restore(None, None, tmp_path / "w")
    store.transaction().flush()
    with pytest.raises(SnapshotError, match=r"snapshot .*shard-0000-aaaa already exists; .*nothing was replaced"):
        store.snapshot(target, None, None)
    store.close()
    assert [p.name for p in target.iterdir()] == ["CURRENT"]
    assert (target / "CURRENT").read_text() == "written by the attempt that won"
    assert [p.name for p in target.parent.iterdir()] == ["shard-0000-aaaa"]  # no temporary left behind


def test_verify_snapshot_names_the_damage(tmp_path):
    store = ShardStore.restore(None, None, tmp_path / "w")
    txn = store.transaction()
    txn.set_many(keys_for(range(10)), [b"x"] * 10)
    txn.flush()
    info = store.snapshot(tmp_path / "s", None, None)
    store.close()
    verify_snapshot(info.path, info.files, full=True)
    sst = next(n for n in info.files if n.endswith(".sst"))
    data = (info.path / sst).read_bytes()
    (info.path / sst).write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    verify_snapshot(info.path, info.files)  # same size: only the full check sees it
    with pytest.raises(SnapshotError, match=f"{sst} does not match its SHA-256"):
        verify_snapshot(info.path, info.files, full=True)
    (info.path / sst).unlink()
    with pytest.raises(SnapshotError, match=f"file {sst} is missing"):
        verify_snapshot(info.path, info.files)
    with pytest.raises(SnapshotError, match="is missing"):
        verify_snapshot(tmp_path / "nope", info.files)


def test_keys_round_trip_and_sort_numerically():
    ints = pa.array([-(2**63), -5, 0, 7, 2**63 - 1], pa.int64())
    kg = np.array([3, 3, 3, 3, 3])
    enc = encode_keys(2, kg, ints)
    assert enc == sorted(enc)  # byte order is numeric order inside a key group
    groups, back = decode_keys("int", enc)
    assert back.to_pylist() == ints.to_pylist() and groups.tolist() == kg.tolist()
    strs = pa.array(["", "é", "merchant-1"])
    groups, back = decode_keys("str", encode_keys(2, np.array([0, 1, 65535]), strs))
    assert back.to_pylist() == strs.to_pylist() and groups.tolist() == [0, 1, 65535]


def test_shard_layout_ranges_are_contiguous_and_cover_all_groups():
    for shards in (1, 3, 4, 7, 256):
        layout = ShardLayout(shards)
        ranges = [layout.key_group_range(s) for s in range(shards)]
        assert ranges[0][0] == 0 and ranges[-1][1] == 256
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        for s, (lo, hi) in enumerate(ranges):
            assert all(layout.shard_of_group(g) == s for g in range(lo, hi))


def test_flush_orders_keys_of_any_length(tmp_path):
    """Writes go in key order; one very long key among short ones sorts without a
    fixed-width blow-up, and every value lands."""
    store = ShardStore.restore(None, None, tmp_path / "work")
    txn = store.transaction()
    keys = [NS + i.to_bytes(4, "big") for i in range(2_000)] + [NS + b"z" * 100_000, NS + b"a\x00", NS + b"a"]
    txn.set_many(keys, [k[-3:] for k in keys])
    txn.delete_many(keys[:10])
    assert txn.flush() == len(keys)
    items = dict(store.db.items())
    store.close()
    assert len(items) == len(keys) - 10 and all(items[k] == k[-3:] for k in keys[10:])


_NEAR_KEYS = st.binary(max_size=4).map(lambda b: b.replace(b"\x01", b"\x00"))  # NULs, prefixes, ties


@settings(max_examples=300, deadline=None)
@given(keys=st.lists(_NEAR_KEYS, max_size=8), sort=st.sampled_from(["as_drawn", "sorted", "sorted_unique"]))
def test_a_batch_is_in_key_order_exactly_when_python_orders_its_bytes_so(keys, sort):
    """The bulk check that lets a batch be flushed as given agrees with bytewise order,
    keys ending in NULs and keys that prefix others included."""
    keys = {"as_drawn": keys, "sorted": sorted(keys), "sorted_unique": sorted(set(keys))}[sort]
    assert strictly_ascending(keys) == all(a < b for a, b in zip(keys, keys[1:]))


_BATCH_KEYS = st.one_of(
    st.lists(st.integers(-2**63, 2**63 - 1), unique=True, max_size=40).map(lambda v: pa.array(v, pa.int64())),
    st.lists(st.text(max_size=4), unique=True, max_size=40).map(lambda v: pa.array(v, pa.string())),
)


@settings(max_examples=300, deadline=None)
@given(keys=_BATCH_KEYS, data=st.data())
def test_rows_sorted_by_key_reach_state_key_order_by_a_sort_of_their_key_groups_alone(keys, data):
    """An aggregate sorts its rows by key (``ResolvedAggregate.apply``); a stable sort of
    their key groups (``in_state_order``) then gives RocksDB's bytewise order of their
    state keys, negative ints, non-ASCII strings and strings that prefix others included:
    the batch is kept and flushed as given."""
    groups = np.array(data.draw(st.lists(st.integers(0, 0xFFFF), min_size=len(keys), max_size=len(keys))), np.int32)
    by_key = pc.sort_indices(keys).to_numpy()
    keys, groups = keys.take(pa.array(by_key)), groups[by_key]
    order = in_state_order(groups)
    written = encode_keys(3, groups[order], keys.take(pa.array(order)))
    assert strictly_ascending(written) and written == sorted(encode_keys(3, groups, keys))


def test_a_batch_in_key_order_is_written_as_given_and_later_writes_still_win(tmp_path):
    """An operator's one sorted ``set_many`` is flushed as given; whatever comes after it
    (a read, another write, a deletion, a batch out of order or with a key twice) sees
    and overrides it as a dict would."""
    store = ShardStore.restore(None, None, tmp_path / "work")
    txn = store.transaction()
    txn.set_many([], [])
    assert txn.dirty == 0 and txn.flush() == 0  # nothing to write: no batch kept, none written
    keys = keys_for(range(500))
    ordered = sorted(keys)
    txn.set_many(ordered, [k[-2:] for k in ordered])
    assert txn.flush() == 500
    assert dict(store.db.items()) == {k: k[-2:] for k in keys}
    txn.set_many(ordered[:100], [b"a"] * 100)
    assert txn.get_many(ordered[98:102], NS) == [b"a", b"a", ordered[100][-2:], ordered[101][-2:]]
    txn.set_many(ordered[50:150], [b"b"] * 100)
    txn.delete_many(ordered[:10])
    twice = [ordered[200], ordered[200], ordered[199]]  # not strictly ascending: the last value of a key wins
    txn.set_many(twice, [b"c", b"d", b"e"])
    assert txn.dirty == 152 and txn.flush() == 152
    items = dict(store.db.items())
    store.close()
    assert len(items) == 490 and ordered[5] not in items
    assert [items[k] for k in (ordered[20], ordered[60], ordered[199], ordered[200])] == [b"a", b"b", b"e", b"d"]
