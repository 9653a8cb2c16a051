"""The write-behind cache of one shard for one epoch.

Reads go to the cache first and then to RocksDB in bulk (``multi_get``, or one
ordered scan of the operator's prefix when most of its keys are touched);
writes stay in memory and reach RocksDB as a single ``WriteBatch`` at
``flush``. Modelled on Quix Streams' ``PartitionTransactionCache``.
"""

from __future__ import annotations

import bisect
from collections import deque
from itertools import chain
from typing import Iterator, Sequence, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import rocksdict

from volley_dagster.state.options import write_options
from volley_dagster.state.resident import ResidentMirror

_DELETED = object()
# Scan the operator's prefix once a batch touches this share of the shard's keys: a scan
# costs about 0.4 us an entry, multi_get about 2.3 us a key (measured), so ~18% breaks even.
DEFAULT_SCAN_FRACTION = 0.2
# A scan that rebuilds a lost mirror, from a quarter of that (5% of the shard's keys):
# ./dev bench mirror_rebuild, 2.5M keys, touching 10%: the rebuild's epoch 3.1 s against
# 1.0 s, each after it 0.21-0.30 s against 1.1-1.4 s, paid back by the 4th; touching 5%:
# 3.7 s against 0.6 s, then 0.12-0.15 s against 0.54-0.62 s, paid back by about the 9th.
REBUILD_SHARE = 0.25
_CHECKED_CACHE = 1024  # a batch is kept aside only while the cache is this small (each key is compared)


class ShardTransaction:
    def __init__(
        self, db: rocksdict.Rdict, scan_fraction: float = DEFAULT_SCAN_FRACTION, resident: ResidentMirror | None = None
    ) -> None:
        self._db = db
        self._scan_fraction = scan_fraction
        self._cache: dict[bytes, object] = {}
        # ``set_many`` batches kept as given (no dict, no sort at flush): each strictly
        # ascending, and no key of another, nor of the cache, between its first and last;
        # moved into the cache once a read or a write there needs them
        self._kept: list[tuple[list[bytes], list[bytes]]] = []
        self._deletes = False  # the cache holds a deletion: flush checks each entry
        self.reads = 0
        self.scanned = False
        self.resident = resident  # the shard's mirror between epochs (``state/resident.py``), if any
        self.scanned_entries: dict[bytes, bytes] | None = None  # kept for the mirror: the whole prefix

    def get_many(self, keys: list[bytes], prefix: bytes, may_scan: bool = True) -> list[bytes | None]:
        """Values for ``keys`` (all under ``prefix``), None where absent. ``may_scan``:
        an operator's keyed state (a scan of the prefix may serve, and feed the mirror);
        False for a few records of its own (an index's meta), always looked up."""
        cache = self._entries()
        misses = [k for k in keys if k not in cache] if cache else keys
        if misses:
            self.reads += len(misses)
            if may_scan and self._should_scan(len(misses)):
                found = self._scan(prefix)
                self.scanned = True
                if self.resident is not None:
                    self.scanned_entries = found
                loaded = list(map(found.get, misses))
            else:
                loaded = _multi_get_sorted(self._db, misses)
            if not cache:
                return loaded
            fetched = dict(zip(misses, loaded, strict=True))
        else:
            fetched = {}
        out: list[bytes | None] = []
        for k in keys:
            v = cache.get(k, fetched.get(k))
            out.append(None if v is _DELETED else cast("bytes | None", v))
        return out

    def scan_flushed(self, lower: bytes, upper: bytes) -> Iterator[tuple[bytes, bytes]]:
        """``[lower, upper)`` as the last flush left it (the cache is not consulted)."""
        return scan_range(self._db, lower, upper)

    def set_many(self, keys: list[bytes], values: list[bytes]) -> None:
        """An operator writes its keys once an epoch, sorted as RocksDB sorts them (the
        state key's order), and an index its own namespace's: such a batch is kept as it
        is, and flushed without building a dict or sorting it again."""
        if not keys:
            return
        if len(keys) != len(values):
            raise ValueError(f"set_many: {len(keys)} keys but {len(values)} values")
        if strictly_ascending(keys) and self._apart(keys[0], keys[-1]):
            self._kept.append((keys, values))
            return
        self._update(keys, values)

    def delete_many(self, keys: list[bytes]) -> None:
        if keys:
            self._update(keys, [_DELETED] * len(keys))
            self._deletes = True

    @property
    def dirty(self) -> int:
        return len(self._cache) + sum(len(keys) for keys, _ in self._kept)

    def _apart(self, first: bytes, last: bytes) -> bool:
        """Whether no kept batch, nor a key in the cache (when it is small), lies between
        ``first`` and ``last``: a batch from there may be kept as it is."""
        if len(self._cache) > _CHECKED_CACHE:
            return False
        return self._apart_from_kept(first, last) and not any(first <= key <= last for key in self._cache)

    def _update(self, keys: list[bytes], values: Sequence[object]) -> None:
        """Into the cache; the kept batches go first when one may hold a key of these, so
        that the later write wins."""
        if self._kept and not self._apart_from_kept(min(keys), max(keys)):
            self._entries()
        self._cache.update(zip(keys, values, strict=True))

    def _apart_from_kept(self, first: bytes, last: bytes) -> bool:
        return all(last < keys[0] or keys[-1] < first for keys, _ in self._kept)

    def _entries(self) -> dict[bytes, object]:
        """The cache as a dict, the batches ``set_many`` kept aside moved in."""
        for keys, values in self._kept:
            self._cache.update(zip(keys, values, strict=True))
        self._kept = []
        return self._cache

    def flush(self) -> int:
        """Write every dirty key in one ``WriteBatch``; returns how many."""
        keys, values = self._in_key_order()
        if not keys:
            return 0
        batch = rocksdict.WriteBatch(raw_mode=True)
        if self._deletes:
            for key, value in zip(keys, values, strict=True):
                if value is _DELETED:
                    batch.delete(key)
                else:
                    batch.put(key, value)
        else:
            deque(map(batch.put, keys, values), maxlen=0)  # the loop in C
        self._db.write(batch, write_options())
        self._cache, self._kept, self._deletes = {}, [], False
        return len(keys)

    def _in_key_order(self) -> tuple[list[bytes], list[object]]:
        """Every dirty entry in key order: the cache sorted, the kept batches set in
        between its keys as they are (none of its keys lies inside one)."""
        kept = sorted(self._kept, key=lambda batch: batch[0][0])
        if not self._cache and len(kept) == 1:
            return kept[0][0], cast("list[object]", kept[0][1])
        keys, values = _sorted_entries(self._cache) if self._cache else ([], [])
        key_parts: list[list[bytes]] = []
        value_parts: list[Sequence[object]] = []
        start = 0
        for batch_keys, batch_values in kept:
            at = bisect.bisect_left(keys, batch_keys[0], lo=start)
            key_parts += [keys[start:at], batch_keys]
            value_parts += [values[start:at], batch_values]
            start = at
        key_parts.append(keys[start:])
        value_parts.append(values[start:])
        return list(chain.from_iterable(key_parts)), list(chain.from_iterable(value_parts))

    def _should_scan(self, n_keys: int) -> bool:
        """Past ``scan_fraction`` of the shard, a scan is the cheaper read. A lost mirror
        lowers the bar to ``REBUILD_SHARE`` of it: the scan rebuilds the mirror, which
        answers the epochs after it (``ResidentMirror.worth_rebuilding``)."""
        estimate = self._db.property_int_value("rocksdb.estimate-num-keys") or 0
        if estimate <= 0:
            return False
        if n_keys >= self._scan_fraction * estimate:
            return True
        return (n_keys >= REBUILD_SHARE * self._scan_fraction * estimate and self.resident is not None
                and self.resident.worth_rebuilding(estimate))

    def _scan(self, prefix: bytes) -> dict[bytes, bytes]:
        return dict(scan_prefix(self._db, prefix))


def key_order(keys: list[bytes]) -> np.ndarray:
    """The permutation that sorts ``keys`` as RocksDB does (bytewise), in bulk: NumPy
    when the keys are of similar length (fixed-width bytes), else Python's sort, so one
    long string key cannot blow the fixed width up. Keys differing only in trailing NUL
    bytes tie under NumPy; callers use the order for speed only."""
    lengths = np.fromiter(map(len, keys), dtype=np.int64, count=len(keys))
    if not len(keys) or int(lengths.max()) * len(keys) <= 2 * int(lengths.sum()) + (1 << 20):
        return np.argsort(np.array(keys, dtype=bytes), kind="stable")
    return np.array(sorted(range(len(keys)), key=keys.__getitem__), dtype=np.int64)


def _multi_get_sorted(db: rocksdict.Rdict, keys: list[bytes]) -> list[bytes | None]:
    """``multi_get`` in key order (RocksDB batches sorted lookups: about 15% faster on
    a large shard), the values back in the caller's order."""
    order = key_order(keys)
    out = np.empty(len(keys), dtype=object)
    out[order] = db.get(np.array(keys, dtype=object)[order].tolist())
    return out.tolist()


def strictly_ascending(keys: list[bytes]) -> bool:
    """Whether ``keys`` are in RocksDB's (bytewise) order, none twice. Arrow compares
    binary values as RocksDB and Python do (bytewise, a prefix first), in bulk: about
    half the time of a pass of ``bytes.__lt__`` (160k state keys: 7 ms against 15)."""
    if len(keys) < 2:
        return True
    arr = pa.array(keys, pa.large_binary())
    return bool(pc.all(pc.greater(arr.slice(1), arr.slice(0, len(arr) - 1))).as_py())


def _sorted_entries(cache: dict[bytes, object]) -> tuple[list[bytes], list[object]]:
    """The dirty entries sorted: RocksDB applies a sorted batch to its memtable about
    7x faster than one in arrival order (measured, 137k keys)."""
    keys = list(cache)
    order = key_order(keys)
    values = np.array(list(cache.values()), dtype=object)
    return np.array(keys, dtype=object)[order].tolist(), values[order].tolist()


def scan_prefix(db: rocksdict.Rdict, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
    """Every (key, value) under ``prefix`` in key order, iterated inside RocksDB."""
    return scan_range(db, prefix, (int.from_bytes(prefix, "big") + 1).to_bytes(len(prefix), "big"))


def scan_range(db: rocksdict.Rdict, lower: bytes, upper: bytes) -> Iterator[tuple[bytes, bytes]]:
    """Every (key, value) in ``[lower, upper)`` in key order."""
    read_opt = rocksdict.ReadOptions()
    read_opt.set_iterate_upper_bound(upper)
    # yield from, not return: read_opt (which holds the bound) must outlive the iteration
    yield from db.items(from_key=lower, read_opt=read_opt)
