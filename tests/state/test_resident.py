"""Resident state: a shard's mirror is trusted only while its lineage is the snapshot
being restored, one attempt at a time, and a failed attempt leaves none to trust."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from volley_dagster.state.resident import MirrorKeys, ResidentRecords, ResidentStateCache, lineage_of

DTYPE = np.dtype([("_format", np.uint8), ("total", np.float64), ("events", np.int64)])
RECORDS = ResidentRecords(DTYPE)
IDENTITY = {"state": "/root|payments", "shard": 0, "layout": {"namespace": 1}}
FILES_1 = {"000010.sst": {"size": 10, "sha256": "a" * 64}}
FILES_2 = {"000011.sst": {"size": 12, "sha256": "b" * 64}}


def blank(n: int) -> np.ndarray:
    rows = np.zeros(n, DTYPE)
    rows["_format"] = 2
    return rows


def states(keys: np.ndarray) -> np.ndarray:
    rows = blank(len(keys))
    rows["total"], rows["events"] = keys * 1.5, keys % 7
    return rows


def mirror_keys(keys: np.ndarray | list[str]) -> MirrorKeys:
    return MirrorKeys.of(pa.array(keys))


def commit_new(cache: ResidentStateCache, keys: np.ndarray, files: dict, identity: dict = IDENTITY) -> None:
    shard = cache.open(identity, None, RECORDS)
    shard.update(mirror_keys(keys), states(keys))
    shard.commit(files)
    shard.release()


@pytest.fixture
def cache(tmp_path) -> ResidentStateCache:
    return ResidentStateCache(str(tmp_path / "resident"))


def test_mirror_round_trip_merges_new_keys_in_order(cache):
    rng = np.random.default_rng(3)
    first = rng.choice(10_000, 3_000, replace=False).astype(np.int64) - 5_000  # negative keys too
    commit_new(cache, first, FILES_1)

    shard = cache.open(IDENTITY, FILES_1, RECORDS)
    assert shard.complete
    touched = np.concatenate([first[:500], np.arange(20_000, 20_400, dtype=np.int64)])
    got, existed = shard.lookup(mirror_keys(touched), blank)
    assert existed.tolist() == [True] * 500 + [False] * 400
    np.testing.assert_array_equal(got[:500], states(first[:500]))
    assert (got["events"][500:] == 0).all() and (got["_format"] == 2).all()
    updated = states(touched)
    updated["events"] += 100
    shard.update(mirror_keys(touched), updated)
    shard.commit(FILES_2)
    shard.release()

    shard = cache.open(IDENTITY, FILES_2, RECORDS)
    expected = {int(k): r for k, r in zip(first, states(first))} | {int(k): r for k, r in zip(touched, updated)}
    assert np.all(np.diff(shard.keys) > 0) and len(shard.keys) == len(expected)
    got, existed = shard.lookup(mirror_keys(np.array(sorted(expected), np.int64)), blank)
    assert existed.all()
    np.testing.assert_array_equal(got, np.array([expected[k] for k in sorted(expected)], DTYPE))
    shard.release()


def test_keys_in_ascending_runs_are_found_and_written_where_they_belong(cache):
    """An aggregate's keys come in one ascending run per key group; the mirror searches
    and writes them in its own order (``MirrorKeys.search_order``), and each lands on its key."""
    rng = np.random.default_rng(5)
    first = np.sort(rng.choice(50_000, 20_000, replace=False)).astype(np.int64)
    commit_new(cache, first, FILES_1)
    touched = np.concatenate([rng.choice(first, 3_000, replace=False), np.arange(60_000, 60_300, dtype=np.int64)])
    runs = touched[np.lexsort((touched, touched % 7))]  # 7 ascending runs, as 7 key groups send them
    assert mirror_keys(runs).search_order is not None and mirror_keys(np.sort(runs)).search_order is None

    shard = cache.open(IDENTITY, FILES_1, RECORDS)
    got, existed = shard.lookup(mirror_keys(runs), blank)
    assert existed.tolist() == np.isin(runs, first).tolist()
    np.testing.assert_array_equal(got[existed], states(runs[existed]))
    updated = states(runs)
    updated["events"] += 1_000 + np.arange(len(runs))
    shard.update(mirror_keys(runs), updated)
    shard.commit(FILES_2)
    shard.release()

    shard = cache.open(IDENTITY, FILES_2, RECORDS)
    expected = {int(k): r for k, r in zip(first, states(first))} | {int(k): r for k, r in zip(runs, updated)}
    everything = np.array(sorted(expected), np.int64)
    got, existed = shard.lookup(mirror_keys(everything), blank)
    assert existed.all() and len(shard.keys) == len(expected)
    np.testing.assert_array_equal(got, np.array([expected[k] for k in sorted(expected)], DTYPE))
    shard.release()


def test_mirror_of_another_snapshot_or_state_is_not_used(cache):
    commit_new(cache, np.arange(100, dtype=np.int64), FILES_1)
    for identity, files in ((IDENTITY, FILES_2), ({**IDENTITY, "shard": 1}, FILES_1),
                            ({**IDENTITY, "state": "/other|payments"}, FILES_1)):
        shard = cache.open(identity, files, RECORDS)
        assert not shard.complete
        shard.release()
    assert lineage_of(FILES_1) != lineage_of(FILES_2)


def test_failed_attempt_leaves_no_mirror_to_trust(cache):
    keys = np.arange(100, dtype=np.int64)
    commit_new(cache, keys, FILES_1)
    shard = cache.open(IDENTITY, FILES_1, RECORDS)
    changed = states(keys)
    changed["total"] = -1
    shard.update(mirror_keys(keys), changed)  # in place, then the attempt dies before its snapshot
    shard.release()
    shard = cache.open(IDENTITY, FILES_1, RECORDS)
    assert not shard.complete
    shard.release()


def test_one_attempt_at_a_time(cache):
    commit_new(cache, np.arange(10, dtype=np.int64), FILES_1)
    first = cache.open(IDENTITY, FILES_1, RECORDS)
    assert first.complete and cache.open(IDENTITY, FILES_1, RECORDS) is None  # a concurrent attempt reads RocksDB
    first.release()
    again = cache.open(IDENTITY, FILES_1, RECORDS)
    assert again.complete
    again.release()


def test_damaged_mirror_falls_back(cache):
    commit_new(cache, np.arange(1_000, dtype=np.int64), FILES_1)
    shard = cache.open(IDENTITY, FILES_1, RECORDS)
    path = shard.path
    shard.release()
    (path / "values.npy").write_bytes((path / "values.npy").read_bytes()[:100])
    shard = cache.open(IDENTITY, FILES_1, RECORDS)
    assert not shard.complete
    shard.release()
    commit_new(cache, np.arange(1_000, dtype=np.int64), FILES_1)
    (path / "keys.npy").write_bytes(b"")  # emptied
    shard = cache.open(IDENTITY, FILES_1, RECORDS)
    assert shard is not None and not shard.complete
    shard.release()  # and the lock with it: the next attempt gets the mirror
    commit_new(cache, np.arange(10, dtype=np.int64), FILES_1)
    shard = cache.open(IDENTITY, FILES_1, RECORDS)
    assert shard.complete and len(shard.keys) == 10
    shard.release()


def test_folder_others_can_write_is_never_trusted(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    cache = ResidentStateCache(str(shared))
    assert cache.open(IDENTITY, None, RECORDS) is None


def test_memory_budget_drops_least_recent_mirrors(tmp_path):
    keys = np.arange(1_000, dtype=np.int64)  # 8 + 17 bytes a key: about 25 KB a mirror
    cache = ResidentStateCache(str(tmp_path / "resident"), max_bytes=60_000)
    for shard in range(3):
        commit_new(cache, keys, FILES_1, {**IDENTITY, "shard": shard})
    kept = []
    for shard in range(3):
        opened = cache.open({**IDENTITY, "shard": shard}, FILES_1, RECORDS)
        kept.append(opened.complete)
        opened.release()
    assert kept == [False, True, True]

    small = ResidentStateCache(str(tmp_path / "small"), max_bytes=10_000)  # one mirror alone is over
    commit_new(small, keys, FILES_1)
    opened = small.open(IDENTITY, FILES_1, RECORDS)
    assert not opened.complete
    opened.release()


def test_mirror_that_cannot_be_written_is_dropped_not_fatal(cache, tmp_path):
    shard = cache.open(IDENTITY, None, RECORDS)
    (shard.path / "keys.npy").mkdir()  # a write that fails, as on a full /dev/shm
    shard.update(mirror_keys(np.arange(10, dtype=np.int64)), states(np.arange(10, dtype=np.int64)))
    shard.commit(FILES_1)
    shard.release()
    again = cache.open(IDENTITY, FILES_1, RECORDS)
    assert not again.complete
    again.release()
    (tmp_path / "not-a-dir").write_text("")
    assert ResidentStateCache(str(tmp_path / "not-a-dir")).open(IDENTITY, None, RECORDS) is None


def test_string_keys_round_trip_by_hash_with_the_strings_beside(cache):
    rng = np.random.default_rng(5)
    first = [f"m-{i:06d}" for i in rng.choice(100_000, 2_000, replace=False)] + ["", "héllo", "x" * 300]
    values = states(np.arange(len(first), dtype=np.int64))
    shard = cache.open(IDENTITY, None, RECORDS, strings=True)
    shard.update(mirror_keys(first), values)
    shard.commit(FILES_1)
    shard.release()
    as_ints = cache.open(IDENTITY, FILES_1, RECORDS)
    assert not as_ints.complete  # a mirror of int keys is another mirror
    as_ints.release()

    shard = cache.open(IDENTITY, FILES_1, RECORDS, strings=True)
    assert shard.complete and len(shard.names) == len(first)
    touched = first[:700] + [f"new-{i}" for i in range(300)]
    got, existed = shard.lookup(mirror_keys(touched), blank)
    assert existed.tolist() == [True] * 700 + [False] * 300
    np.testing.assert_array_equal(got[:700], values[:700])
    updated = states(np.arange(1_000, 2_000, dtype=np.int64))
    shard.update(mirror_keys(touched), updated)
    shard.remove(mirror_keys(first[-3:]))
    shard.commit(FILES_2)
    shard.release()

    shard = cache.open(IDENTITY, FILES_2, RECORDS, strings=True)
    expected = dict(zip(first, values)) | dict(zip(touched, updated))
    for gone in first[-3:]:
        expected.pop(gone)
    assert np.all(np.diff(shard.keys) > 0) and len(shard.keys) == len(shard.names) == len(expected)
    assert sorted(shard.names.to_pylist()) == sorted(expected)  # each string beside its own hash
    np.testing.assert_array_equal(shard.keys, mirror_keys(shard.names.to_pylist()).order)
    names = sorted(expected)
    got, existed = shard.lookup(mirror_keys(names), blank)
    assert existed.all()
    np.testing.assert_array_equal(got, np.array([expected[k] for k in names], DTYPE))
    shard.release()


def test_two_strings_of_one_hash_never_share_a_state(cache):
    """A forced hash clash (64-bit clashes are too rare to find): the lookup compares
    the strings, drops the mirror and leaves the keys to RocksDB."""
    shard = cache.open(IDENTITY, None, RECORDS, strings=True)
    shard.update(MirrorKeys(np.array([7, 9], np.int64), pa.array(["a", "b"])), states(np.array([1, 2])))
    assert shard.lookup(MirrorKeys(np.array([7], np.int64), pa.array(["a"])), blank)[1].tolist() == [True]
    assert shard.lookup(MirrorKeys(np.array([9], np.int64), pa.array(["z"])), blank) is None
    assert not shard.complete

    shard.start_empty()  # two new keys of one hash in one epoch
    shard.update(MirrorKeys(np.array([3, 3], np.int64), pa.array(["p", "q"])), states(np.array([1, 2])))
    assert not shard.complete

    shard.adopt(MirrorKeys(np.array([4, 4], np.int64), pa.array(["p", "q"])), states(np.array([1, 2])))
    assert not shard.complete  # nor from a scan
    shard.adopt(MirrorKeys(np.array([4, 5], np.int64), pa.array(["p", "q"])), states(np.array([1, 2])))
    shard.update(MirrorKeys(np.array([5], np.int64), pa.array(["r"])), states(np.array([3])))
    assert not shard.complete  # an unseen key landing on a mirrored key's hash
    shard.commit(FILES_1)
    shard.release()
    assert not cache.open(IDENTITY, FILES_1, RECORDS, strings=True).complete


def test_a_lookups_keys_are_compared_with_the_mirrors_strings_once(cache, monkeypatch):
    """The running aggregate looks an epoch's keys up, then updates those same keys: the
    lookup compared their strings in this mirror, so the update does not again. Keys
    given anew (another batch, of the same hashes) are still compared."""
    shard = cache.open(IDENTITY, None, RECORDS, strings=True)
    shard.update(MirrorKeys(np.array([7, 9], np.int64), pa.array(["a", "b"])), states(np.array([1, 2])))
    compared: list[int] = []
    same_names = type(shard)._same_names
    monkeypatch.setattr(type(shard), "_same_names",
                        lambda self, at, keys: compared.append(len(keys)) or same_names(self, at, keys))
    keys = MirrorKeys(np.array([7, 9], np.int64), pa.array(["a", "b"]))
    assert shard.lookup(keys, blank)[1].tolist() == [True, True]
    shard.update(keys, states(np.array([3, 4])))
    assert compared == [2] and shard.complete
    shard.adopt(MirrorKeys(np.array([7, 9], np.int64), pa.array(["z", "b"])), states(np.array([1, 2])))
    shard.update(keys, states(np.array([5, 6])))  # the same keys, in a mirror adopted since: compared
    assert compared == [2, 2] and not shard.complete
    shard.adopt(MirrorKeys(np.array([7, 9], np.int64), pa.array(["a", "b"])), states(np.array([1, 2])))
    other = MirrorKeys(np.array([7], np.int64), pa.array(["z"]))  # "a"'s hash, another string
    assert shard.lookup(other, blank) is None and not shard.complete
    assert compared == [2, 2, 1]
    shard.release()


# Real 64-bit FNV-1a clashes (crafted with a lattice: equal hashes, different strings)
CLASH = ("dnXsmIDUZQkkSXK0KM", "dnXsd2PNqHrnW7xLBU")
CLASH_2 = ("ciOx9gD50HdSMkHJrL", "ciOx9hYNYCxVJ5Z10R")


def test_removing_a_key_that_only_shares_a_mirrored_keys_hash_drops_the_mirror(cache):
    a, b = mirror_keys(list(CLASH)), mirror_keys(list(CLASH_2))
    assert a.order[0] == a.order[1] and b.order[0] == b.order[1]
    shard = cache.open(IDENTITY, None, RECORDS, strings=True)
    shard.update(mirror_keys([CLASH[0], CLASH_2[0], "other"]), states(np.array([1, 2, 3])))
    shard.remove(mirror_keys([CLASH_2[0]]))  # the key itself: removed
    assert shard.complete and sorted(shard.names.to_pylist()) == sorted([CLASH[0], "other"])
    shard.remove(mirror_keys(["absent", CLASH[1]]))  # CLASH[1] was never stored, CLASH[0] was
    assert not shard.complete  # not CLASH[0]'s row deleted in its place: RocksDB answers
    shard.commit(FILES_1)
    shard.release()
    assert not cache.open(IDENTITY, FILES_1, RECORDS, strings=True).complete


def test_new_keys_of_one_hash_one_kept_one_expired_lose_no_state(cache, tmp_path):
    """The review's case (F9), through the running aggregate on a real RocksDB: two new
    keys of one FNV-1a hash in one epoch, the first kept and the second expired at once
    (event-time TTL). The next epoch still finds the first key's count."""
    import rocksdict

    from volley_dagster import columns
    from volley_dagster.operators.accumulators import count
    from volley_dagster.operators.aggregate import Aggregate
    from volley_dagster.operators.base import ShardStep
    from volley_dagster.operators.event_time import EventTime
    from volley_dagster.operators.ttl import TOUCHED_PARTIAL, StateTtl
    from volley_dagster.state.options import RocksDBOptions
    from volley_dagster.state.transaction import ShardTransaction

    ttl = StateTtl(duration_us=50, event_time=EventTime("t"))
    aggregate = Aggregate((("n", count()),), ttl=ttl).recorded(
        {"namespace": 1, "accumulators": [{"kind": None}], "ttl": ttl.layout()})
    db = rocksdict.Rdict(str(tmp_path / "db"), RocksDBOptions().build())

    def epoch(number: int, keys: list[str], times: list[int], files_before: dict | None, files: dict) -> dict:
        shard = cache.open(IDENTITY, files_before, aggregate.resident_records, strings=True)
        ones = np.ones(len(keys), np.int64)
        data = pa.table({columns.KEY_GROUP: pa.array([0] * len(keys), pa.int64()), columns.KEY: pa.array(keys),
                         columns.ROWS: ones, "n:n": ones, TOUCHED_PARTIAL: pa.array(times, pa.int64())})
        txn = ShardTransaction(db, resident=shard)
        out, _ = aggregate.apply(txn, data, ShardStep(number, "str", expire_limit=max(times)))
        txn.flush()
        shard.commit(files)
        shard.release()
        return {k: (n, gone) for k, n, gone in zip(*(a.to_pylist() for a in out), strict=True)}

    try:
        kept, expired = CLASH
        assert epoch(1, [kept, expired], [100, 10], None, FILES_1) == {kept: (1, False), expired: (1, True)}
        assert epoch(2, [kept], [110], FILES_1, FILES_2) == {kept: (2, False)}
    finally:
        db.close()


class AggregateShard:
    """One shard of a running count on a real RocksDB, run epoch by epoch through
    ``Aggregate.apply`` with a mirror from ``cache`` (the shard task's steps)."""

    def __init__(self, cache: ResidentStateCache, path) -> None:
        import rocksdict

        from volley_dagster.operators.accumulators import count
        from volley_dagster.operators.aggregate import Aggregate
        from volley_dagster.state.options import RocksDBOptions

        self.cache = cache
        self.aggregate = Aggregate((("n", count()),)).recorded({"namespace": 1, "accumulators": [{"kind": None}]})
        self.db = rocksdict.Rdict(str(path), RocksDBOptions().build())
        self.files: dict | None = None

    def epoch(self, number: int, keys: np.ndarray, restored: dict | None = None) -> tuple[dict, str]:
        """Count ``keys`` once each; the counts out and how the shard read its state.
        ``restored``: the snapshot the mirror is opened against (default: the last epoch's)."""
        from volley_dagster import columns
        from volley_dagster.operators.base import ShardStep
        from volley_dagster.state.transaction import ShardTransaction

        shard = self.cache.open(IDENTITY, restored or self.files, self.aggregate.resident_records)
        ones = np.ones(len(keys), np.int64)
        data = pa.table({columns.KEY_GROUP: pa.array(np.zeros(len(keys), np.int64)), columns.KEY: pa.array(keys),
                         columns.ROWS: ones, "n:n": ones})
        txn = ShardTransaction(self.db, resident=shard)
        out, _ = self.aggregate.apply(txn, data, ShardStep(number, "int"))
        txn.flush()
        self.files = {f"{number:06d}.sst": {"size": number, "sha256": f"{number:064x}"}}
        shard.commit(self.files)
        mode = "resident" if shard.answered else "scan" if txn.scanned else "multi_get"
        shard.release()
        return dict(zip(*(a.to_pylist() for a in out[:2]), strict=True)), mode

    def close(self) -> None:
        self.db.close()


@pytest.mark.parametrize("touched, budget, other_stamped, rebuilt", [
    (60, 60_000, True, True), (30, 60_000, True, False), (60, 40_000, True, False), (60, 40_000, False, True)],
    ids=["six-percent", "three-percent", "no-room-beside-the-others", "room-once-an-unstamped-one-goes"])
def test_a_lost_mirror_is_rebuilt_by_a_scan_that_pays_back(tmp_path, touched, budget, other_stamped, rebuilt):
    """A mirror lost between epochs (here: stamped with another snapshot, as a killed
    attempt or a reboot leaves it) is rebuilt by the next epoch that touches 5% of the
    shard (a quarter of the scan fraction), when it fits beside the machine's other
    stamped mirrors (an unstamped one is evicted first); else that epoch reads RocksDB
    sparsely and the mirror stays lost. Counts are right either way."""
    keys = np.arange(1_000, dtype=np.int64)  # 8 + 17 bytes a key: about 25 KB a mirror
    other = ResidentStateCache(str(tmp_path / "resident"), max_bytes=2**20)
    commit_new(other, keys, FILES_1, {**IDENTITY, "shard": 1})  # another shard's mirror, 25 KB
    shard = AggregateShard(other, tmp_path / "db")
    try:
        assert shard.epoch(1, keys) == ({int(k): 1 for k in keys}, "resident")  # a first epoch builds it
        shard.cache = ResidentStateCache(other.directory, max_bytes=budget)
        if not other_stamped:  # as a killed attempt of that shard leaves it
            opened = other.open({**IDENTITY, "shard": 1}, FILES_1, RECORDS)
            opened.discard()
            opened.release()
        some = keys[::len(keys) // touched][:touched]
        counts, mode = shard.epoch(2, some, restored=FILES_2)  # not the snapshot it was stamped with
        assert counts == {int(k): 2 for k in some}
        assert mode == ("scan" if rebuilt else "multi_get")
        counts, mode = shard.epoch(3, keys[:10])
        assert counts == {int(k): 2 + int(k in set(some.tolist())) for k in keys[:10]}
        assert mode == ("resident" if rebuilt else "multi_get")
        if other_stamped:
            opened = other.open({**IDENTITY, "shard": 1}, FILES_1, RECORDS)
            assert opened.complete  # the other shard's mirror was never evicted for it
            opened.release()
    finally:
        shard.close()


def test_keys_too_long_to_hash_quickly_are_left_to_rocksdb():
    assert mirror_keys(["k" * 1_025, "short"]).too_long
    assert not mirror_keys(["k" * 1_024, "short"]).too_long and not mirror_keys(np.arange(3)).too_long


WINDOW = np.dtype([("start", np.int64), ("end", np.int64), ("_format", np.uint8), ("n", np.int64)])


def windows(starts: list[int]) -> np.ndarray:
    rows = np.zeros(len(starts), WINDOW)
    rows["start"], rows["end"], rows["_format"], rows["n"] = starts, np.add(starts, 10), 2, np.add(starts, 1)
    return rows


@pytest.mark.parametrize("strings", [False, True], ids=["int_keys", "string_keys"])
def test_window_mirror_holds_every_open_window_as_a_fold_of_the_epochs(cache, strings):
    """Random epochs: each replaces the windows of the keys it touches (adding, keeping
    or firing them all); the mirror, reopened every epoch, always equals a plain dict."""
    rng = np.random.default_rng(11)
    name = (lambda k: f"key-{k}") if strings else int
    expected: dict = {}
    files = None
    for epoch in range(1, 16):
        opened = cache.open(IDENTITY, files, ResidentRecords(WINDOW, windows=True), strings=strings)
        assert opened is not None and opened.complete
        keys = [name(k) for k in rng.choice(60, rng.integers(1, 30), replace=False)]
        got, key_index = opened.windows_of(mirror_keys(keys))
        for i, key in enumerate(keys):
            np.testing.assert_array_equal(got[key_index == i], expected.get(key, windows([])))
        after = {key: windows(sorted(rng.choice(1_000, rng.integers(0, 4), replace=False).tolist())) for key in keys}
        rows = np.concatenate([after[k] for k in keys])
        row_key = np.repeat(np.arange(len(keys)), [len(after[k]) for k in keys])
        opened.replace(mirror_keys(keys), rows, row_key)
        expected.update({k: v for k, v in after.items()})
        expected = {k: v for k, v in expected.items() if len(v)}
        files = {f"{epoch}.sst": {"size": epoch, "sha256": f"{epoch:064d}"}}
        opened.commit(files)
        opened.release()
    final = cache.open(IDENTITY, files, ResidentRecords(WINDOW, windows=True), strings=strings)
    assert len(final.values) == sum(len(v) for v in expected.values())
    got, key_index = final.windows_of(mirror_keys(list(expected)))
    for i, rows in enumerate(expected.values()):
        np.testing.assert_array_equal(got[key_index == i], rows)
    final.release()


def test_window_mirror_from_a_scan_and_its_hash_clashes(cache):
    shard = cache.open(IDENTITY, None, ResidentRecords(WINDOW, windows=True), strings=True)
    shard.adopt(MirrorKeys(np.array([8, 3, 8], np.int64), pa.array(["b", "a", "b"])), windows([1, 2, 3]))
    got, key_index = shard.windows_of(MirrorKeys(np.array([8, 3], np.int64), pa.array(["b", "a"])))
    assert got["start"].tolist() == [1, 3, 2] and key_index.tolist() == [0, 0, 1]  # each key's rows, in scan order
    assert shard.windows_of(MirrorKeys(np.array([8], np.int64), pa.array(["z"]))) is None  # z shares b's hash
    assert not shard.complete
    shard.adopt(MirrorKeys(np.array([5, 5], np.int64), pa.array(["p", "q"])), windows([1, 2]))
    assert not shard.complete  # a scan holding two keys of one hash
    shard.release()
