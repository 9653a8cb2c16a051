"""Incremental shard snapshots on a real S3 server (SeaweedFS) from real RocksDB
checkpoints: only new SSTs travel, SSTs are keyed by content, warm restores
download nothing, retention never leaves a dangling reference, and an S3 fault
commits nothing and is recovered by re-running the upload."""

from __future__ import annotations

import os
import pickle
import random
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import rocksdict

from harness.processes import free_ports
from harness.seaweedfs import SeaweedFS, start_seaweedfs
from tests.conftest import BUCKET
from volley_dagster.checkpoint.epoch_log import EpochLog
from volley_dagster.checkpoint.lease import PipelineLease
from volley_dagster.checkpoint.manifest import ShardEntry, ShardSnapshot
from volley_dagster.checkpoint.s3_snapshots import S3SnapshotStore, SnapshotManifest
from volley_dagster.errors import FencedError, SnapshotError, SnapshotStorageError
from volley_dagster.result import EpochResult
from volley_dagster.sources.offsets import EpochRange
from volley_dagster.state.digests import sha256_file
from volley_dagster.state.options import RocksDBOptions, write_options
from volley_dagster.state.store import ShardStore, open_snapshot_read_only


@pytest.fixture
def store(seaweedfs: SeaweedFS) -> S3SnapshotStore:
    return S3SnapshotStore(f"s3://{BUCKET}/snapshots-{uuid.uuid4().hex[:10]}", seaweedfs.s3, max_workers=4)


def key(i: int) -> bytes:
    return i.to_bytes(8, "big")


def open_db(path: Path) -> rocksdict.Rdict:
    return rocksdict.Rdict(str(path), RocksDBOptions().build())


def write(db: rocksdict.Rdict, items: dict[bytes, bytes]) -> None:
    batch = rocksdict.WriteBatch(raw_mode=True)
    for k, v in items.items():
        batch.put(k, v)
    db.write(batch, write_options())
    db.flush()  # the WAL is off: the flush makes the SST the checkpoint holds


def checkpoint(db: rocksdict.Rdict, path: Path) -> Path:
    rocksdict.Checkpoint(db).create_checkpoint(str(path))
    return path


def read_all(path: Path) -> dict[bytes, bytes]:
    db = open_snapshot_read_only(path)
    try:
        return dict(db.items())
    finally:
        db.close()


def ssts(path: Path) -> dict[str, str]:
    """SST file name -> SHA-256 of its content."""
    return {p.name: sha256_file(p) for p in sorted(path.glob("*.sst"))}


def objects(seaweedfs: SeaweedFS, store: S3SnapshotStore, under: str) -> set[str]:
    """Object keys (relative to the store root) listed straight from the server."""
    base = f"{store.prefix}/"
    found: set[str] = set()
    for page in seaweedfs.boto3().get_paginator("list_objects_v2").paginate(Bucket=store.bucket, Prefix=base + under):
        found.update(o["Key"][len(base):] for o in page.get("Contents", []))
    return found


def test_upload_is_incremental_and_warm_restore_downloads_nothing(store, seaweedfs, tmp_path):
    rng = random.Random(1)
    state = {key(i): rng.randbytes(32) for i in range(20_000)}
    db = open_db(tmp_path / "db")
    write(db, state)
    cp1 = checkpoint(db, tmp_path / "cp1")
    first = store.upload(1, 0, cp1)
    assert first.files_reused == 0 and first.bytes_uploaded == first.total_bytes > 500_000

    changed = {key(i): rng.randbytes(32) for i in rng.sample(range(20_000), 2_000)}
    write(db, changed)
    state.update(changed)
    cp2 = checkpoint(db, tmp_path / "cp2")
    db.close()
    second = store.upload(2, 0, cp2)

    old, new = ssts(cp1), ssts(cp2)
    shared = {n for n in new if old.get(n) == new[n]}
    fresh = set(new) - shared
    assert shared and fresh
    small = [p for p in cp2.iterdir() if not p.name.endswith(".sst")]
    assert second.files_reused == len(shared)
    assert second.files_uploaded == len(fresh) + len(small)
    assert second.bytes_uploaded == sum((cp2 / n).stat().st_size for n in fresh) + sum(p.stat().st_size for p in small)
    assert second.bytes_uploaded < second.total_bytes / 4
    assert second.total_bytes == sum(p.stat().st_size for p in cp2.iterdir())
    # Every SST is stored once, under its content hash; epoch 2's manifest is committed.
    assert objects(seaweedfs, store, "sst/") == {f"sst/{h}.sst" for h in {*old.values(), *new.values()}}
    assert store.epochs() == [1, 2]
    assert {f.name for f in store.manifest(2, 0).files} == {p.name for p in cp2.iterdir()}

    cache = tmp_path / "cache"
    restored = store.restore(2, 0, cache)
    assert restored.bytes_downloaded == second.total_bytes and restored.files_cached == 0
    cold = restored.path
    assert read_all(cold) == state
    plain = rocksdict.Rdict(str(cold))  # rocksdict's own defaults open it too
    try:
        assert plain[key(7)] == state[key(7)]
    finally:
        plain.close()

    # A warm restore through a pickled copy (what a Spark executor gets) downloads nothing.
    shipped: S3SnapshotStore = pickle.loads(pickle.dumps(store))
    rewarmed = shipped.restore(2, 0, cache)
    warm = rewarmed.path
    assert warm != cold and rewarmed.bytes_downloaded == 0
    assert rewarmed.files_cached == len({f.sha256 for f in second.manifest.files})
    assert read_all(warm) == state
    sst_name = next(iter(new))
    assert os.path.samefile(warm / sst_name, cache / "objects" / new[sst_name])  # hardlinked from the cache


def test_same_named_ssts_from_two_restores_do_not_collide(store, tmp_path):
    base = {key(i): b"base" * 8 for i in range(2_000)}
    db = open_db(tmp_path / "db")
    write(db, base)
    store.upload(1, 0, checkpoint(db, tmp_path / "cp1"))
    db.close()

    # Two restores of the same snapshot (a retried task, a rescale) write different
    # data; RocksDB numbers their new SSTs alike.
    expected: dict[str, dict[bytes, bytes]] = {}
    snapshots: dict[str, Path] = {}
    for shard, tag in ((0, b"left"), (1, b"right")):
        restored = store.restore(1, 0, tmp_path / f"cache-{tag.decode()}").path
        shard_store = ShardStore.restore(restored, None, tmp_path / f"work-{tag.decode()}")
        changes = {key(i): tag * 8 for i in range(0, 2_000, 3)}
        write(shard_store.db, changes)
        snapshots[tag.decode()] = checkpoint(shard_store.db, tmp_path / f"cp-{tag.decode()}")
        shard_store.close()
        expected[tag.decode()] = {**base, **changes}

    left, right = ssts(snapshots["left"]), ssts(snapshots["right"])
    clashing = [n for n in left if n in right and left[n] != right[n]]
    assert clashing, (left, right)

    up_left = store.upload(2, 0, snapshots["left"])
    up_right = store.upload(2, 1, snapshots["right"])
    keys_left = {f.name: f.key for f in up_left.manifest.files}
    keys_right = {f.name: f.key for f in up_right.manifest.files}
    for name in clashing:
        assert keys_left[name] == f"sst/{left[name]}.sst" != keys_right[name] == f"sst/{right[name]}.sst"

    cache = tmp_path / "cache-both"  # one cache serves both: entries are content-addressed
    assert read_all(store.restore(2, 0, cache).path) == expected["left"]
    assert read_all(store.restore(2, 1, cache).path) == expected["right"]


def test_retention_deletes_old_manifests_then_unreferenced_ssts(store, seaweedfs, tmp_path):
    rng = random.Random(3)
    state = {key(i): rng.randbytes(24) for i in range(5_000)}
    db = open_db(tmp_path / "db")
    write(db, state)
    states, manifests = {}, {}
    for epoch in range(1, 5):
        if epoch > 1:
            changed = {key(i): rng.randbytes(24) for i in rng.sample(range(5_000), 500)}
            write(db, changed)
            state.update(changed)
        if epoch == 3:  # a full compaction rewrites every SST: epochs 1-2's SSTs become theirs alone
            db.compact_range(None, None)
        manifests[epoch] = store.upload(epoch, 0, checkpoint(db, tmp_path / f"cp{epoch}")).manifest
        states[epoch] = dict(state)
    db.close()

    def sst_keys(*epochs: int) -> set[str]:
        return {f.key for e in epochs for f in manifests[e].files if f.key.startswith("sst/")}

    only_old = sst_keys(1, 2) - sst_keys(3, 4)
    assert only_old and sst_keys(3, 4)
    old_small = {f.key for e in (1, 2) for f in manifests[e].files if not f.key.startswith("sst/")}

    result = store.retain(2)
    assert result.epochs_removed == [1, 2] and result.manifests_deleted == 2
    assert result.ssts_deleted == len(only_old) and result.epoch_objects_deleted == len(old_small)
    assert store.epochs() == [3, 4]
    for epoch in (1, 2):
        with pytest.raises(SnapshotError, match=f"epoch {epoch} shard 0 has no snapshot"):
            store.manifest(epoch, 0)
        assert not objects(seaweedfs, store, f"epochs/{epoch:010d}/")
    assert objects(seaweedfs, store, "sst/") == sst_keys(3, 4)
    for epoch in (3, 4):
        assert read_all(store.restore(epoch, 0, tmp_path / "cache").path) == states[epoch]
    assert store.retain(2).epochs_removed == []  # idempotent


@pytest.mark.parametrize("fault", ["closed port", "wrong secret key"])
def test_unreachable_store_commits_nothing_and_a_rerun_succeeds(store, seaweedfs, tmp_path, fault):
    db = open_db(tmp_path / "db")
    write(db, {key(i): b"v" * 16 for i in range(1_000)})
    cp = checkpoint(db, tmp_path / "cp")
    db.close()
    if fault == "closed port":
        (port,) = free_ports(1)
        broken = S3SnapshotStore(store.uri, replace(seaweedfs.s3, endpoint_url=f"http://127.0.0.1:{port}"),
                                 max_attempts=2)
    else:  # rotated credentials: the server answers 403 to every request
        broken = S3SnapshotStore(store.uri, replace(seaweedfs.s3, secret_access_key="not-the-secret"))
    with pytest.raises(SnapshotStorageError, match=r"epoch 7 shard 3: uploading \S+ to s3://") as err:
        broken.upload(7, 3, cp)
    assert isinstance(err.value, SnapshotError)
    assert not objects(seaweedfs, store, S3SnapshotStore.manifest_key(7, 3))
    assert store.epochs() == []

    done = store.upload(7, 3, cp)
    assert done.files_uploaded == len(done.manifest.files)
    assert store.epochs() == [7]
    assert len(read_all(store.restore(7, 3, tmp_path / "cache").path)) == 1_000


@pytest.mark.server  # its own SeaweedFS, stopped and started again
def test_outage_between_epochs_then_rerun_reuses_stored_ssts(tmp_path):
    """A test-local server (the session's one must stay up) stopped and restarted on its data."""
    root = tmp_path / "weed"
    server = start_seaweedfs(root, bucket="outage")
    uri = "s3://outage/pipeline"
    rng = random.Random(5)
    state = {key(i): rng.randbytes(32) for i in range(5_000)}
    db = open_db(tmp_path / "db")
    try:
        write(db, state)
        first = S3SnapshotStore(uri, server.s3, max_attempts=2).upload(1, 0, checkpoint(db, tmp_path / "cp1"))
        changed = {key(i): rng.randbytes(32) for i in range(0, 5_000, 10)}
        write(db, changed)
        state.update(changed)
        cp2 = checkpoint(db, tmp_path / "cp2")
        server.stop()
        with pytest.raises(SnapshotStorageError, match="epoch 2 shard 0"):
            S3SnapshotStore(uri, server.s3, max_attempts=2).upload(2, 0, cp2)
        server = start_seaweedfs(root, bucket="outage")  # same data, new ports and credentials
        store = S3SnapshotStore(uri, server.s3)
        assert store.epochs() == [1]  # the failed attempt committed nothing
        with pytest.raises(SnapshotError, match="epoch 2 shard 0 has no snapshot"):
            store.restore(2, 0, tmp_path / "cache")

        second = store.upload(2, 0, cp2)
        assert second.files_reused >= 1 and second.bytes_uploaded < first.bytes_uploaded / 2
        assert read_all(store.restore(2, 0, tmp_path / "cache").path) == state
    finally:
        db.close()
        server.stop()


def test_missing_manifest_and_corrupt_files(store, seaweedfs, tmp_path):
    with pytest.raises(SnapshotError, match=r"epoch 9 shard 0 has no snapshot: manifest s3://\S+/epochs/0000000009/shard-0000\.json"):
        store.restore(9, 0, tmp_path / "cache")

    state = {key(i): bytes([i % 251]) * 40 for i in range(3_000)}
    db = open_db(tmp_path / "db")
    write(db, state)
    manifest: SnapshotManifest = store.upload(1, 0, checkpoint(db, tmp_path / "cp")).manifest
    db.close()
    cache = tmp_path / "cache"
    store.restore(1, 0, cache)
    sst = next(f for f in manifest.files if f.name.endswith(".sst"))

    # A corrupted cache entry (same size, flipped bytes) is found by its hash and downloaded again.
    cached = cache / "objects" / sst.sha256
    data = bytearray(cached.read_bytes())
    data[len(data) // 2] ^= 0xFF
    with open(cached, "r+b") as fh:
        fh.write(data)
    refetched = store.restore(1, 0, cache)
    assert (refetched.files_downloaded, refetched.bytes_downloaded) == (1, sst.size)
    assert sha256_file(cache / "objects" / sst.sha256) == sst.sha256
    assert read_all(refetched.path) == state

    # An object corrupted in the store is refused after download, naming the file.
    client: Any = seaweedfs.boto3()
    full_key = f"{store.prefix}/{sst.key}"
    client.put_object(Bucket=store.bucket, Key=full_key, Body=bytes(data))
    fresh = tmp_path / "fresh-cache"
    with pytest.raises(SnapshotError, match=rf"epoch 1 shard 0: downloaded {sst.name} \(s3://\S+{sst.sha256}\.sst\) is corrupt"):
        store.restore(1, 0, fresh)
    assert not (fresh / "objects" / sst.sha256).exists()
    assert not (fresh / "restores").exists()  # no half-laid-out restore

    # An object deleted behind the manifest's back is named as missing.
    client.delete_object(Bucket=store.bucket, Key=full_key)
    with pytest.raises(SnapshotError, match=rf"{sst.name} is missing from the store"):
        store.restore(1, 0, fresh)


def test_attempts_keep_their_own_manifests_and_retention_keeps_the_winners(store, seaweedfs, tmp_path):
    """Two attempts of one (epoch, shard) upload side by side; retention keeps the one the
    epoch manifest names. An empty epoch carried forward names the previous epoch's
    objects, which stay while it is kept, though that epoch's own manifest goes."""
    db = open_db(tmp_path / "db")
    write(db, {key(i): b"first" for i in range(100)})
    first = checkpoint(db, tmp_path / "first")
    write(db, {key(i): b"second" for i in range(50)})
    second = checkpoint(db, tmp_path / "second")
    db.close()
    store.upload(1, 0, first, attempt="aaaa")
    store.upload(1, 0, second, attempt="bbbb")  # a late twin of epoch 1 shard 0: its own manifest
    assert read_all(store.restore(1, 0, tmp_path / "cache", attempt="aaaa").path) == read_all(first)
    assert read_all(store.restore(1, 0, tmp_path / "cache", attempt="bbbb").path) == read_all(second)

    carried = store.carry_forward(1, 0, 2, from_attempt="aaaa", attempt="cccc")
    assert carried.bytes_uploaded == 0 and carried.files_reused == len(carried.manifest.files)

    result = store.prune([1, 2], {(1, 0): "aaaa", (2, 0): "cccc"})
    assert result.manifests_deleted == 1  # the attempt that lost
    with pytest.raises(SnapshotError, match=r"epoch 1 shard 0 has no snapshot: manifest \S+shard-0000-bbbb\.json"):
        store.manifest(1, 0, "bbbb")

    result = store.prune([2], {(2, 0): "cccc"})
    assert result.epochs_removed == [1]
    assert read_all(store.restore(2, 0, tmp_path / "cache2", attempt="cccc").path) == read_all(first)
    assert objects(seaweedfs, store, "epochs/0000000001/")  # the small files epoch 2 names stay


def test_the_restore_cache_must_be_private_and_is_hashed_after_laying_out(store, tmp_path):
    db = open_db(tmp_path / "db")
    write(db, {key(i): b"v" * 30 for i in range(2_000)})
    store.upload(1, 0, checkpoint(db, tmp_path / "cp"))
    db.close()
    shared = tmp_path / "shared-cache"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)  # a folder every user can write to: its files could be swapped
    with pytest.raises(SnapshotError, match=r"snapshot cache \S+shared-cache is not a folder this user alone can write"):
        store.restore(1, 0, shared)

    cache = tmp_path / "cache"
    expected = read_all(store.restore(1, 0, cache).path)
    assert os.stat(cache).st_mode & 0o777 == 0o700
    # a cache entry swapped for other bytes of the same size after it was stored: caught
    # once laid out (the file RocksDB would open is what is hashed), and fetched again
    entry = max((cache / "objects").iterdir(), key=lambda p: p.stat().st_size)  # the SST
    data = bytearray(entry.read_bytes())
    data[len(data) // 2] ^= 0xFF
    entry.write_bytes(bytes(data))
    again = store.restore(1, 0, cache)
    assert read_all(again.path) == expected
    assert again.files_downloaded == 1


def three_snapshots(tmp_path: Path) -> list[Path]:
    """Checkpoints of one DB after each of three writes, a full compaction before the
    last: the first two share SSTs the third does not name."""
    db = open_db(tmp_path / "db")
    paths = []
    for i in range(3):
        write(db, {key(k): bytes([i]) * 20 for k in range(i * 500, i * 500 + 1_000)})
        if i == 2:
            db.compact_range(None, None)
        paths.append(checkpoint(db, tmp_path / f"cp{i}"))
    db.close()
    return paths


def test_a_stale_view_never_deletes_newer_epochs_than_it_keeps(store, seaweedfs, tmp_path):
    """A holder that paused with its view at epoch 4 (keeping 2..4) resumes while a newer
    holder has written epochs 5 and 6: those stay whole and restorable."""
    cps = three_snapshots(tmp_path)
    for epoch, cp in zip(range(1, 7), [cps[0], cps[0], cps[1], cps[1], cps[2], cps[2]], strict=True):
        store.upload(epoch, 0, cp, attempt=f"a{epoch}")
    newer = objects(seaweedfs, store, "epochs/0000000005/") | objects(seaweedfs, store, "epochs/0000000006/")
    result = store.prune([2, 3, 4], {(e, 0): f"a{e}" for e in (2, 3, 4)})
    assert result.epochs_removed == [1]
    assert store.epochs() == [2, 3, 4, 5, 6]
    assert newer <= objects(seaweedfs, store, "epochs/")
    assert read_all(store.restore(6, 0, tmp_path / "cache", attempt="a6").path) == read_all(cps[2])


def test_an_sst_a_manifest_names_after_the_view_was_taken_is_kept(store, seaweedfs, tmp_path):
    """While a prune runs (its view read), another upload reuses SSTs only the dropped
    epochs named and commits its manifest: the prune reads manifests again before the
    SSTs go, and the new epoch restores."""
    cps = three_snapshots(tmp_path)
    store.upload(1, 0, cps[0], attempt="a1")
    store.upload(2, 0, cps[2], attempt="a2")  # compacted: none of epoch 1's SSTs
    only_epoch_1 = {f.key for f in store.manifest(1, 0, "a1").files if f.key.startswith("sst/")}
    assert only_epoch_1.isdisjoint(f.key for f in store.manifest(2, 0, "a2").files)
    batches: list[str] = []

    def meanwhile(what: str) -> None:
        if not batches:  # the view is read; an upload of epoch 3 finds epoch 1's SSTs stored and reuses them
            reused = store.upload(3, 0, cps[0], attempt="b3")
            assert reused.files_reused == len(only_epoch_1) and reused.bytes_uploaded < reused.total_bytes
        batches.append(what)

    result = store.prune([2], {(2, 0): "a2"}, before_delete=meanwhile)
    assert result.epochs_removed == [1] and result.ssts_deleted == 0
    assert [b.split(" ", 2)[2].split(" under")[0] for b in batches] == ["manifests", "small files"]
    assert only_epoch_1 <= objects(seaweedfs, store, "sst/")
    assert read_all(store.restore(3, 0, tmp_path / "cache", attempt="b3").path) == read_all(cps[0])
    # once no manifest names them, the next prune removes them
    assert store.prune([2, 3], {(2, 0): "a2", (3, 0): "b3"}).ssts_deleted == 0
    assert store.prune([3], {(3, 0): "b3"}).epochs_removed == [2]


def test_a_holder_fenced_off_deletes_nothing(store, seaweedfs, tmp_path):
    cps = three_snapshots(tmp_path)
    for epoch, cp in enumerate(cps, start=1):
        store.upload(epoch, 0, cp, attempt=f"a{epoch}")
    before = objects(seaweedfs, store, "")
    paused = PipelineLease(tmp_path / "root", owner="paused", wait_s=0.5).acquire()
    fence = paused.fence
    paused.release()
    PipelineLease(tmp_path / "root", owner="newer", wait_s=0.5).acquire()  # takes token 2
    with pytest.raises(FencedError, match=r"deleting \d+ manifests under s3://\S+: stopped, the lease of"):
        store.prune([3], {(3, 0): "a3"}, before_delete=fence.check)
    assert objects(seaweedfs, store, "") == before


def test_retention_from_the_roots_manifests_keeps_their_winners(store, seaweedfs, tmp_path):
    """``retain_committed`` takes the kept epochs and their winning attempts from the
    root's manifests as they are at prune time."""
    log = EpochLog(tmp_path / "root")
    cps = three_snapshots(tmp_path)
    for epoch, cp in enumerate(cps, start=1):
        store.upload(epoch, 0, cp, attempt=f"a{epoch}")
        store.upload(epoch, 0, cp, attempt=f"bb{epoch}")  # a twin whose epoch manifest never named it
        log.record_offsets(EpochRange(epoch, {}, {}))
        entry = ShardEntry(0, ShardSnapshot(f"snapshots/{epoch:010d}/shard-0000-a{epoch}", {}, 0, f"a{epoch}", True), "scan")
        assert log.write_manifest(EpochResult("p", epoch, {}, 1, 1, 0, 1, 1, 0, 0, 0, {0: entry}, {}, {"total": 1.0}))
    result = store.retain_committed(log, 3, 2)
    assert result.epochs_removed == [1] and result.manifests_deleted == 4  # epoch 1's two, and the losers of 2 and 3
    assert {k.rsplit("/", 1)[1] for k in objects(seaweedfs, store, "epochs/") if k.count("/") == 2} == \
        {"shard-0000-a2.json", "shard-0000-a3.json"}  # the manifests left: the winners of the kept epochs
    assert read_all(store.restore(3, 0, tmp_path / "cache", attempt="a3").path) == read_all(cps[2])
