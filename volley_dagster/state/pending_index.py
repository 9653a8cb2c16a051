"""The pending-window index of one shard: which keys have a window open, by end time.

It is the only record of what must fire (window state is read by key), so it
is persisted with every epoch's ``WriteBatch`` and restored lazily: a small
meta record says how many entries there are and the earliest end, and the
entries themselves are read only when the epoch has records for the shard or
the earliest end is due. That keeps an idle shard's epoch O(1).

In memory the entries are columns sorted by end, so the due ones are a prefix
found by binary search: firing costs O(windows fired). With
``max_pending_windows`` the least recently used entries beyond the bound are
evicted to the ``pending_index/`` namespace, keyed by (end, state key), so the
due ones are again one range scan; it is scanned only while evictions are
outstanding (a count in the meta record), and fired entries leave both places.
An index that evicts its latest ends (state TTL's) takes new entries ending after
all of a full in-memory part straight to that namespace: the part is neither loaded
nor rewritten, so a shard whose deadlines only grow writes each epoch's new keys, not
its whole in-memory part again.

An entry may outlive its window (a session that merged into a longer one):
firing it finds nothing due under that key, which is harmless. Every open
window always has an entry with its exact end, so none is ever orphaned.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, fields

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from volley_dagster.errors import StateLayoutError
from volley_dagster.state.transaction import ShardTransaction

_SIGN_BIT = np.uint64(1 << 63)


def ordered_us(values: np.ndarray) -> np.ndarray:
    """Big-endian, sign-flipped: byte order equals numeric order."""
    return (np.asarray(values, dtype=np.int64).view(np.uint64) ^ _SIGN_BIT).astype(">u8")


@dataclass
class PendingMeta:
    resident: int = 0  # entries in the in-memory part (persisted as one record)
    min_end: int | None = None  # earliest end among them
    evicted: int = 0  # entries in the pending_index/ namespace
    popped_to: int | None = None  # every entry up to this end is gone: later scans start past it
    evicted_min: int | None = None  # the earliest end among the evicted (None with evicted: unknown)
    max_end: int | None = None  # latest end among the resident entries (None: none, or an older record)

    def to_bytes(self) -> bytes:
        return json.dumps(self.__dict__).encode()

    @classmethod
    def from_bytes(cls, data: bytes | None) -> PendingMeta:
        """A field this engine does not know means a newer engine wrote the record, and
        relies on it: refused by name, not guessed around."""
        if not data:
            return cls()
        record = json.loads(data)
        unknown = sorted(set(record) - {f.name for f in fields(cls)})
        if unknown:
            raise StateLayoutError(
                f"the expiry or pending-window index's meta record has fields {unknown} this engine does not know: "
                "a newer volley-dagster wrote this state; run that version or a later one on this checkpoint root")
        return cls(**record)


class PendingIndex:
    """Entries ``(state key, window end, last epoch used)``, sorted by end."""

    def __init__(self, keys: np.ndarray, ends: np.ndarray, used: np.ndarray) -> None:
        self.keys, self.ends, self.used = keys, ends, used

    @classmethod
    def empty(cls) -> PendingIndex:
        return cls(np.empty(0, dtype=object), np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.ends)

    def pop_due(self, limit: int) -> np.ndarray:
        """Remove and return the state keys of entries ending at or before ``limit``."""
        i = int(np.searchsorted(self.ends, limit, side="right"))
        due = self.keys[:i]
        self.keys, self.ends, self.used = self.keys[i:], self.ends[i:], self.used[i:]
        return due

    def add(self, keys: np.ndarray, ends: np.ndarray, epoch: int) -> None:
        order = np.argsort(ends, kind="stable")
        keys, ends = keys[order], ends[order]
        at = np.searchsorted(self.ends, ends, side="right")
        self.keys = np.insert(self.keys, at, keys)
        self.ends = np.insert(self.ends, at, ends)
        self.used = np.insert(self.used, at, np.full(len(ends), epoch, dtype=np.int64))

    def touch(self, keys: list[bytes], epoch: int) -> None:
        """Mark the entries of these keys used in ``epoch`` (for LRU eviction)."""
        if len(self) and keys:
            hit = pc.is_in(pa.array(self.keys, pa.binary()), value_set=pa.array(keys, pa.binary()))
            self.used[hit.to_numpy(zero_copy_only=False)] = epoch

    def evict_beyond(self, bound: int, latest_first: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Drop the least recently used entries beyond ``bound`` (the latest ends first
        among equals: they fire last), or with ``latest_first`` the latest ends, and
        return them."""
        excess = len(self) - bound
        if excess <= 0:
            return np.empty(0, dtype=object), np.empty(0, dtype=np.int64)
        victims = (np.argsort(-self.ends, kind="stable") if latest_first else np.lexsort((-self.ends, self.used)))[:excess]
        keep = np.ones(len(self), dtype=bool)
        keep[victims] = False
        evicted = self.keys[~keep], self.ends[~keep]
        self.keys, self.ends, self.used = self.keys[keep], self.ends[keep], self.used[keep]
        return evicted

    def to_bytes(self) -> bytes:
        table = pa.table({"key": pa.array(self.keys, pa.binary()), "end": self.ends, "used": self.used})
        sink = io.BytesIO()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        return sink.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes | None) -> PendingIndex:
        if not data:
            return cls.empty()
        table = pa.ipc.open_stream(data).read_all()
        return cls(
            table.column("key").to_numpy(zero_copy_only=False),
            table.column("end").to_numpy().astype(np.int64),
            table.column("used").to_numpy().astype(np.int64),
        )


class PersistentPendingIndex:
    """The index of one shard for one epoch: restored lazily, flushed with the shard's
    transaction. ``meta_ns``/``evicted_ns`` are the two namespaces it owns.
    ``evict_latest``: beyond the bound, evict the latest ends (an index whose entries
    are never touched again, as state TTL's) instead of the least recently used."""

    def __init__(self, txn: ShardTransaction, meta_ns: bytes, evicted_ns: bytes, max_resident: int | None,
                 evict_latest: bool = False) -> None:
        self._txn = txn
        self._meta_ns = meta_ns
        self._meta_key = meta_ns + b"meta"
        self._index_key = meta_ns + b"index"
        self._evicted_ns = evicted_ns
        self._max_resident = max_resident
        self._evict_latest = evict_latest
        self.meta = PendingMeta.from_bytes(txn.get_many([self._meta_key], meta_ns, may_scan=False)[0])
        self._meta_changed = False
        self._fired_evicted: list[bytes] = []  # deleted at flush: the cache stays empty for the state lookups
        self._index: PendingIndex | None = None
        self.loaded = False
        self.evicted_now = 0
        self.evicted_fired = 0

    @property
    def index(self) -> PendingIndex:
        if self._index is None:
            self._index = PendingIndex.from_bytes(self._txn.get_many([self._index_key], self._meta_ns, may_scan=False)[0])
            self.loaded = True
        return self._index

    def may_fire(self, limit: int | None) -> bool:
        """Whether anything can be due at ``limit``, without loading the entries."""
        if limit is None:
            return False
        return self.meta.evicted > 0 or (self.meta.min_end is not None and self.meta.min_end <= limit)

    def open_until(self) -> int | None:
        """The latest end among the entries, so of every open window (each has an entry
        with its exact end); ``NO_OPEN_WINDOW`` when there are none. None: unknown (entries
        were evicted, and the evicted part keeps only its earliest end)."""
        if self.meta.evicted:
            return None
        if not self.meta.resident and self._index is None:
            return NO_OPEN_WINDOW
        if self._index is None and self.meta.max_end is not None:
            return self.meta.max_end
        return int(self.index.ends[-1]) if len(self.index) else NO_OPEN_WINDOW

    def pop_due(self, limit: int) -> list[bytes]:
        """State keys with an entry ending at or before ``limit``, removed from the index."""
        due = list(self.index.pop_due(limit)) if self.meta.min_end is not None and self.meta.min_end <= limit else []
        if self.meta.evicted:
            # entries up to an earlier limit are gone (each new one ends past the limit of
            # its epoch): start past them, not over their tombstones
            popped = self.meta.popped_to
            lower = self._evicted_ns + (b"" if popped is None else ordered_us(np.array([_after(popped)])).tobytes())
            upper = self._evicted_ns + ordered_us(np.array([_after(limit)])).tobytes()
            entries = [k for k, _ in self._txn.scan_flushed(lower, upper)] if lower < upper else []
            following = next(self._txn.scan_flushed(max(lower, upper), _namespace_end(self._evicted_ns)), None)
            self.meta.evicted_min = None if following is None else _end_of(following[0], self._evicted_ns)
            self._fired_evicted.extend(entries)
            self.meta.evicted -= len(entries)
            self.evicted_fired += len(entries)
            skip = len(self._evicted_ns) + 8
            due.extend(k[skip:] for k in entries)
            if limit < np.iinfo(np.int64).max:  # an end-of-stream epoch fires all: no bound to keep
                self.meta.popped_to = limit if popped is None else max(popped, limit)
            self._meta_changed = True
        return due

    def add(self, keys: np.ndarray, ends: np.ndarray, epoch: int) -> None:
        if not len(keys):
            return
        if self._all_evicted_at_flush(ends):
            self._evict(keys, ends)
            return
        self.index.add(keys, ends, epoch)

    def _all_evicted_at_flush(self, ends: np.ndarray) -> bool:
        """Whether flush would evict exactly these entries and leave the in-memory part as
        it is: it is full, the latest ends are evicted, and these end after all of it.
        Then it is neither loaded nor rewritten. An index of deadlines that only grow (a
        state TTL's, past its bound) takes each epoch's new keys this way."""
        return (self._index is None and self._evict_latest and self._max_resident is not None
                and self.meta.resident == self._max_resident and self.meta.max_end is not None
                and int(ends.min()) > self.meta.max_end)

    def touch(self, keys: list[bytes], epoch: int) -> None:
        if self._max_resident is not None:  # recency only matters for eviction
            self.index.touch(keys, epoch)

    def flush(self) -> None:
        """Evict beyond the bound and stage the index and its meta record in the
        transaction (written by its WriteBatch). Never loaded: only a changed meta record."""
        if self._fired_evicted:
            self._txn.delete_many(self._fired_evicted)
            self._fired_evicted = []
        if self._index is None:
            if self._meta_changed:
                self._txn.set_many([self._meta_key], [self.meta.to_bytes()])
            return
        if self._max_resident is not None:
            keys, ends = self.index.evict_beyond(self._max_resident, self._evict_latest)
            if len(keys):
                self._evict(keys, ends)
        index = self._index
        self.meta.resident = len(index)
        self.meta.min_end = int(index.ends[0]) if len(index) else None
        self.meta.max_end = int(index.ends[-1]) if len(index) else None
        self._txn.set_many([self._meta_key, self._index_key], [self.meta.to_bytes(), index.to_bytes()])

    def _evict(self, keys: np.ndarray, ends: np.ndarray) -> None:
        """Stage entries in the evicted namespace, keyed by (end, state key): by end, so
        that the transaction takes them as one sorted batch when no two ends tie."""
        order = np.argsort(ends, kind="stable")
        keys, ends = keys[order], ends[order]
        earliest = int(ends[0])
        if not self.meta.evicted:
            self.meta.evicted_min = earliest
        elif self.meta.evicted_min is not None:  # unknown (an older record) stays unknown
            self.meta.evicted_min = min(self.meta.evicted_min, earliest)
        ns, ordered_ends = self._evicted_ns, ordered_us(ends).view("V8").tolist()
        self._txn.set_many([ns + end + key for end, key in zip(ordered_ends, keys, strict=True)], [b""] * len(keys))
        self.meta.evicted += len(keys)
        self.evicted_now += len(keys)
        self._meta_changed = True

    def next_due(self) -> int | None:
        """The earliest end anywhere in the index (``NO_ENTRY`` when empty; None: unknown,
        an index written before the evicted part's earliest end was kept)."""
        if self.meta.evicted and self.meta.evicted_min is None:
            return None
        ends = [e for e in (self.meta.min_end, self.meta.evicted_min if self.meta.evicted else None) if e is not None]
        return min(ends) if ends else NO_ENTRY


NO_ENTRY = int(np.iinfo(np.int64).max)
NO_OPEN_WINDOW = int(np.iinfo(np.int64).min)


def _namespace_end(ns: bytes) -> bytes:
    return (int.from_bytes(ns, "big") + 1).to_bytes(len(ns), "big")


def _end_of(entry_key: bytes, ns: bytes) -> int:
    ordered = np.frombuffer(entry_key[len(ns):len(ns) + 8], dtype=">u8")
    return int((ordered.astype(np.uint64) ^ _SIGN_BIT).view(np.int64)[0])


def _after(limit: int) -> int:
    return min(limit, np.iinfo(np.int64).max - 1) + 1


def stored_entries(index_record: bytes | None, evicted_keys: list[bytes],
                   evicted_ns: bytes) -> tuple[list[bytes], np.ndarray, np.ndarray]:
    """A shard's pending entries as its snapshot holds them, for reading state: the
    resident part (the index record) and the evicted one (``(end, state key)`` keys of
    the evicted namespace); returns their state keys, window ends and evicted flags."""
    resident = PendingIndex.from_bytes(index_record)
    skip = len(evicted_ns) + 8
    ordered = np.frombuffer(b"".join(k[len(evicted_ns):skip] for k in evicted_keys), dtype=">u8")
    evicted_ends = (ordered.astype(np.uint64) ^ _SIGN_BIT).view(np.int64)
    keys = list(resident.keys) + [k[skip:] for k in evicted_keys]
    ends = np.concatenate([resident.ends, evicted_ends]).astype(np.int64)
    evicted = np.concatenate([np.zeros(len(resident), bool), np.ones(len(evicted_keys), bool)])
    return keys, ends, evicted
