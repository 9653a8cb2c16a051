"""A shard's running-aggregate state kept resident between epochs (Volley's point:
state operations should mostly hit memory).

The state of one shard is mirrored, decoded, as two NumPy arrays (sorted int64
keys and their fixed-width state records) in a directory of the machine's memory
(``/dev/shm`` where there is one). Spark does not pin a shard to a Python
worker, so the mirror lives beside the workers, not in one: whichever worker
runs the shard next epoch maps it and looks keys up with ``searchsorted``
instead of scanning or ``multi_get``-ing RocksDB. RocksDB stays the durable
truth: every write still goes through the ``WriteBatch`` and the snapshot.

String keys are mirrored by a 64-bit hash (``state/keys.string_key_hashes``), sorted
as the int keys are, beside the strings themselves in the same order (an Arrow
array): every lookup that finds a hash compares the strings, so two keys that share a
hash never share a state. A mirror that would hold two such keys is dropped and
RocksDB answers instead (about one shard in 10^7 at a million keys).

A mirror is used only while its lineage equals the snapshot the epoch restores:
the checkpoint root, shard, state layout and the SHA-256 digests of that
snapshot's files (the same files mean the same state, so an empty epoch's
carried-forward snapshot keeps it valid). It is unstamped before it changes and
stamped again only after the new snapshot exists, so a killed or failed attempt
leaves no mirror to trust; a mismatch, a lock held by another attempt or a
damaged file falls back to RocksDB. A mirror is (re)built when an epoch has the whole
shard in hand: a first epoch, or one that scans the shard. A lost mirror lowers the
bar for that scan (``ShardTransaction``), when it fits beside the others
(``worth_rebuilding``): else a large state would stay on ``multi_get`` for good after
a restart.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from volley_dagster.io.atomic import private_dir, write_json_atomic
from volley_dagster.json_records import JsonObject
from volley_dagster.process import boot_id
from volley_dagster.state import bulk_rows
from volley_dagster.state.digests import FileDigests
from volley_dagster.state.keys import string_key_hashes

_LINEAGE = "lineage.json"
_KEYS = "keys.npy"
_VALUES = "values.npy"
_NAMES = "names.arrow"  # string keys, in the order of keys.npy
_LOCK = ".lock"
DEFAULT_MAX_MIB = 1024
_Mirror = TypeVar("_Mirror", bound="ResidentMirror")
MAX_STRING_KEY_BYTES = 1024  # a longer key is hashed a byte at a time for too long: RocksDB answers
_NAME_BYTES = 20  # a string key's guessed share of names.arrow (offset and text), to size a rebuild


@dataclass(frozen=True)
class ResidentRecords:
    """How an operator's shard state can stay resident: each key's fixed-width record
    (``ResidentShard``), or, with ``windows``, each open window's (``ResidentWindows``)."""

    dtype: np.dtype
    windows: bool = False


@dataclass(frozen=True)
class MirrorKeys:
    """A batch of keys as a mirror orders them: the int keys themselves, or the hashes
    of string keys with the strings beside them for the exact check."""

    order: np.ndarray  # int64
    names: pa.Array | None = None  # the string keys; None for int keys

    @classmethod
    def of(cls, keys: pa.Array) -> MirrorKeys:
        if pa.types.is_integer(keys.type):
            return cls(keys.to_numpy(zero_copy_only=False).astype(np.int64))
        names = keys.cast(pa.string())
        return cls(string_key_hashes(names), names)

    def __getitem__(self, rows: np.ndarray | slice) -> MirrorKeys:
        if self.names is None:
            return MirrorKeys(self.order[rows])
        if isinstance(rows, slice):
            start, stop, _ = rows.indices(len(self.order))
            return MirrorKeys(self.order[rows], self.names.slice(start, stop - start))
        picked = pa.array(rows) if rows.dtype == bool else pa.array(rows, pa.int64())
        return MirrorKeys(self.order[rows], self.names.filter(picked) if rows.dtype == bool else self.names.take(picked))

    def __len__(self) -> int:
        return len(self.order)

    @functools.cached_property
    def too_long(self) -> bool:
        """A string key longer than the mirror hashes."""
        return self.names is not None and len(self.names) > 0 and (
            pc.max(pc.binary_length(self.names)).as_py() or 0) > MAX_STRING_KEY_BYTES

    @functools.cached_property
    def search_order(self) -> np.ndarray | None:
        """The order to look these keys up and write them back in: a search per key in
        turn misses the cache at every step unless each starts where the last ended, and
        a write scattered over the mirror touches a page a key (250k keys in 64 sorted
        runs into a 2.5M-key mirror: search 87 ms, write 59; in one run 12 and 28, the
        stable sort of the runs 7). An aggregate's int keys come sorted, one run; string
        keys' hashes in no order. None: already one run."""
        if not np.any(self.order[1:] < self.order[:-1]):
            return None
        return np.argsort(self.order, kind="stable")

    def clash(self) -> bool:
        """Two of these distinct keys share a hash."""
        return self.names is not None and len(np.unique(self.order)) != len(self.order)


def default_directory() -> str:
    """Memory, not disk, where the machine has a ``/dev/shm``; one folder per user."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return str(base / f"volley-resident-state-{os.getuid()}")


@dataclass(frozen=True)
class ResidentStateCache:
    """Where this machine's mirrors live and how much memory they may hold in all
    (least recently stamped mirrors are dropped first). Settings only: shipped to
    the shard tasks."""

    directory: str
    max_bytes: int = DEFAULT_MAX_MIB * 2**20

    @classmethod
    def from_env(cls, mib: int | None = None) -> ResidentStateCache | None:
        """``mib`` or ``VOLLEY_RESIDENT_STATE_MIB`` (0 turns mirrors off), in
        ``VOLLEY_RESIDENT_STATE_DIR`` or memory."""
        if mib is None:
            mib = int(os.environ.get("VOLLEY_RESIDENT_STATE_MIB", DEFAULT_MAX_MIB))
        if mib <= 0:
            return None
        directory = os.environ.get("VOLLEY_RESIDENT_STATE_DIR") or default_directory()
        return cls(directory, min(mib * 2**20, _half_free(directory) or mib * 2**20))

    def open(
        self, identity: JsonObject, previous_files: FileDigests | None, records: ResidentRecords,
        strings: bool = False,
    ) -> ResidentMirror | None:
        """The shard's mirror of ``records`` (``ResidentShard``, or with ``records.windows``
        ``ResidentWindows``), locked for this attempt: complete when its lineage is
        ``previous_files`` (or the shard starts empty), else incomplete. None when another
        attempt holds it."""
        kind = ResidentWindows if records.windows else ResidentShard
        return self._open(kind, identity, previous_files, records.dtype, strings)

    def _open(
        self, kind: type[_Mirror], identity: JsonObject, previous_files: FileDigests | None, records: np.dtype,
        strings: bool,
    ) -> _Mirror | None:
        name = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]
        path = Path(self.directory) / name
        try:
            if not private_dir(Path(self.directory)):
                return None  # a folder another user could write to: never trusted
            path.mkdir(mode=0o700, exist_ok=True)
        except OSError:
            return None  # no room or no right to keep a mirror here: RocksDB answers
        lock = _try_lock(path)
        if lock is None:
            return None  # another attempt of this shard holds it
        try:
            if os.fstat(lock).st_ino != os.stat(path / _LOCK).st_ino:
                raise OSError("the mirror was evicted while this attempt locked it")
            shard = kind(self, path, lock, identity, records, strings)
            if previous_files is None:
                shard.start_empty()
            else:
                shard.load(lineage_of(previous_files))
            return shard
        except Exception:  # evicted meanwhile, or unreadable: RocksDB answers
            os.close(lock)
            return None


def lineage_of(snapshot_files: FileDigests) -> str:
    """A snapshot's identity (the digests of its files), in this boot."""
    digest = hashlib.sha256(json.dumps(snapshot_files, sort_keys=True).encode()).hexdigest()
    return f"{digest}@{boot_id()}"


class ResidentMirror:
    """One shard's mirror during one attempt (holds the lock until ``release``): its
    trust (lineage, lock, stamp) and storage; the subclasses say what a row is."""

    def __init__(
        self, cache: ResidentStateCache, path: Path, lock: int, identity: JsonObject, records: np.dtype,
        strings: bool = False,
    ) -> None:
        self._cache = cache
        self.path = path
        self._lock = lock
        self._identity = {**identity, "keys": "str" if strings else "int"}
        self._records = records
        self._strings = strings
        self.keys: np.ndarray | None = None  # sorted int64 (string keys: their hashes); None: not complete
        self.values: np.ndarray | None = None
        self.names: pa.Array | None = None  # string keys: the strings, in the order of ``keys``
        self.answered = False  # a lookup of this attempt was served by the mirror
        self._searched: tuple[MirrorKeys, np.ndarray, np.ndarray] | None = None  # keys, mirror keys, positions
        self._named: tuple[MirrorKeys, np.ndarray] | None = None  # keys whose found strings were compared, and where
        self._rewrite = False  # the arrays changed shape: write them whole at commit
        self._dropped = False  # this attempt found it cannot hold the shard (``discard``)

    @property
    def complete(self) -> bool:
        """The mirror holds the whole shard as the restored snapshot has it."""
        return self.keys is not None

    def start_empty(self) -> None:
        self._unstamp()
        self.keys, self.values, self._rewrite = np.empty(0, np.int64), np.empty(0, self._records), True
        self.names = pa.array([], pa.string()) if self._strings else None

    def load(self, expected: str) -> None:
        try:
            stamp = json.loads((self.path / _LINEAGE).read_text())
        except (OSError, ValueError):
            return
        if stamp != {"identity": self._identity, "snapshot": expected}:
            return
        try:
            keys = np.load(self.path / _KEYS, mmap_mode="r+")
            values = np.load(self.path / _VALUES, mmap_mode="r+")
        except Exception:  # damaged (truncated, emptied): RocksDB answers instead
            return
        if keys.dtype != np.int64 or keys.ndim != 1 or values.dtype != self._records or len(values) != len(keys):
            return
        names = None
        if self._strings:
            try:
                names = pa.ipc.open_file(pa.memory_map(str(self.path / _NAMES))).read_all().column(0).combine_chunks()
            except (OSError, pa.ArrowException):
                return
            if names.type != pa.string() or len(names) != len(keys):
                return
        self.keys, self.values, self.names = keys, values, names

    def discard(self) -> None:
        """This attempt cannot keep the mirror whole (it read the shard sparsely)."""
        self._unstamp()
        self.keys = self.values = self.names = None
        self._dropped = True

    def worth_rebuilding(self, rows: int) -> bool:
        """Whether a scan of the shard (about ``rows`` rows) should rebuild this mirror,
        lost since the last epoch (a killed attempt, a reboot, another machine): only
        when it was not dropped by this attempt (a clash, keys too long) and fits beside
        the machine's other stamped mirrors (unstamped ones are evicted first), so
        rebuilding it evicts none of theirs: a budget too small for all would otherwise
        have them rebuild one another every epoch."""
        if self.complete or self._dropped:
            return False
        row_bytes = 8 + self._records.itemsize + (_NAME_BYTES if self._strings else 0)
        others = sum(size for path, stamped, size in _mirrors(Path(self._cache.directory))
                     if stamped and path != self.path)
        return others + rows * row_bytes <= self._cache.max_bytes

    def holds(self, keys: MirrorKeys) -> bool:
        """Whether the mirror is whole and can hold ``keys``; keys too long to hash drop it."""
        if keys.too_long:
            self.discard()
        return self.complete

    def adopt(self, row_keys: MirrorKeys, rows: np.ndarray) -> None:
        """The whole shard, as a scan of the restored snapshot read it: each row's key."""
        if row_keys.too_long:
            self.discard()
            return
        order = np.argsort(row_keys.order, kind="stable")
        self._unstamp()
        self.keys, self.values, self._rewrite = row_keys.order[order], bulk_rows.take(rows, order), True
        self.names = row_keys[order].names
        if self.names is not None and len(self.keys) > 1:  # rows of one hash must be rows of one key
            same_hash = np.flatnonzero(self.keys[1:] == self.keys[:-1])
            left, right = self.names.take(pa.array(same_hash)), self.names.take(pa.array(same_hash + 1))
            if pc.all(pc.equal(left, right)).as_py() is False:
                self.discard()

    def _positions(self, keys: MirrorKeys) -> np.ndarray:
        """Where each key is or would go in the mirror (the first of equal keys)."""
        assert self.keys is not None
        if self._searched is not None and self._searched[0] is keys and self._searched[1] is self.keys:
            return self._searched[2]  # a lookup's keys, updated next: the mirror's keys are as they were
        positions = self._search(keys, "left")
        self._searched = (keys, self.keys, positions)
        return positions

    def _search(self, keys: MirrorKeys, side: Literal["left", "right"]) -> np.ndarray:
        assert self.keys is not None
        order = keys.search_order
        if order is None:
            return np.searchsorted(self.keys, keys.order, side=side)
        positions = np.empty(len(order), dtype=np.intp)
        positions[order] = np.searchsorted(self.keys, keys.order[order], side=side)
        return positions

    def _same_names(self, at: np.ndarray, keys: MirrorKeys) -> bool:
        assert self.names is not None and keys.names is not None
        stored = self.names.take(pa.array(at, pa.int64()))
        return bool(pc.all(pc.equal(stored, keys.names)).as_py() is not False)

    def _found_same_names(self, keys: MirrorKeys, at: np.ndarray, found: np.ndarray) -> bool:
        """Whether the keys found at ``at`` are the mirror's strings there, not only their
        hashes. A lookup's keys updated next are found where the lookup compared them,
        in the same mirror: not compared twice."""
        assert self.keys is not None
        if keys.names is None or (self._named is not None and self._named[0] is keys and self._named[1] is self.keys):
            return True
        if not self._same_names(at[found], keys[found]):
            return False
        self._named = (keys, self.keys)
        return True

    def commit(self, snapshot_files: FileDigests) -> None:
        """Stamp the mirror with the snapshot it now equals (after that snapshot exists)."""
        if self.keys is None or self.values is None:
            return
        size = self.keys.nbytes + self.values.nbytes + (self.names.nbytes if self.names is not None else 0)
        if size > self._cache.max_bytes:
            self.discard()
            return
        try:
            if self._rewrite:
                for name, arr in ((_KEYS, self.keys), (_VALUES, self.values)):
                    self._write(name, functools.partial(_write_npy, np.asarray(arr)))
                if self.names is not None:
                    self._write(_NAMES, functools.partial(_write_arrow, self.names))
            else:
                for arr in (self.keys, self.values):
                    if isinstance(arr, np.memmap):
                        arr.flush()
            write_json_atomic(self.path / _LINEAGE, {"identity": self._identity, "snapshot": lineage_of(snapshot_files)})
            _evict(Path(self._cache.directory), self._cache.max_bytes, keep=self.path)
        except OSError:  # the memory filesystem is full (or gone): the epoch goes on without a mirror
            self.discard()
            for name in (_KEYS, _VALUES, _NAMES, f".{_KEYS}.tmp", f".{_VALUES}.tmp", f".{_NAMES}.tmp"):
                with contextlib.suppress(OSError):
                    (self.path / name).unlink(missing_ok=True)

    def _write(self, name: str, write: Callable[[Any], None]) -> None:
        """Replace the mirror's file ``name`` whole (never through a link)."""
        tmp = self.path / f".{name}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as fh:
            write(fh)
        os.replace(tmp, self.path / name)

    def release(self) -> None:
        self.keys = self.values = self.names = self._searched = self._named = None  # unmaps
        os.close(self._lock)

    def _unstamp(self) -> None:
        (self.path / _LINEAGE).unlink(missing_ok=True)

    def _insert(self, keys: np.ndarray, values: np.ndarray, names: pa.Array | None, at: np.ndarray,
                added: MirrorKeys, rows: np.ndarray) -> None:
        """The mirror becomes ``keys``/``values``/``names`` with ``added`` and their
        ``rows`` inserted at ``at`` (``np.insert`` positions), the strings moved alike."""
        order = bulk_rows.inserted_order(at, len(keys))
        self.keys = np.concatenate([keys, added.order])[order]
        self.values = bulk_rows.take(bulk_rows.concat([values, rows]), order)
        if names is not None and added.names is not None:
            self.names = pa.concat_arrays([names, added.names]).take(pa.array(order))
        self._rewrite = True


class ResidentShard(ResidentMirror):
    """A running aggregate's mirror: one state record per key."""

    def lookup(
        self, keys: MirrorKeys, blank_rows: Callable[[int], np.ndarray]
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """States of ``keys`` (blank where absent) and which existed; None when a
        string key shares its hash with another in the mirror, or the mirror cannot
        answer (not whole, or dropped: RocksDB answers)."""
        if not self.holds(keys):
            return None
        assert self.keys is not None and self.values is not None
        state = blank_rows(len(keys))
        if not len(self.keys):
            self.answered = True
            return state, np.zeros(len(keys), dtype=bool)
        idx = np.minimum(self._positions(keys), len(self.keys) - 1)
        existed = self.keys[idx] == keys.order
        if not self._found_same_names(keys, idx, existed):
            self.discard()
            return None
        bulk_rows.put(state, np.flatnonzero(existed), bulk_rows.take(self.values, idx[existed]))
        self.answered = True
        return state, existed

    def update(self, keys: MirrorKeys, states: np.ndarray) -> None:
        """Set the epoch's new states: in place for known keys, merged in for new ones."""
        if not self.holds(keys):
            return
        assert self.keys is not None and self.values is not None
        self._unstamp()
        idx = self._positions(keys)
        known = idx < len(self.keys)
        known[known] = self.keys[idx[known]] == keys.order[known]
        if not self._found_same_names(keys, idx, known):
            self.discard()  # a new key with the hash of a mirrored one (a mirror adopted from a scan)
            return
        order = keys.search_order
        written = np.flatnonzero(known) if order is None else order[known[order]]  # in the mirror's order
        bulk_rows.put(self.values, idx[written], bulk_rows.take(states, written))
        new = ~known
        if not new.any():
            return
        order = np.argsort(keys.order[new], kind="stable")
        added = keys[np.flatnonzero(new)[order]]
        if added.clash():
            self.discard()
            return
        self._insert(np.asarray(self.keys), np.asarray(self.values), self.names, idx[new][order], added,
                     bulk_rows.take(states, np.flatnonzero(new)[order]))

    def remove(self, keys: MirrorKeys) -> None:
        """Drop these keys (expired): the state no longer holds them. A key that only shares
        a mirrored key's hash drops the mirror, never that key's row."""
        if not self.holds(keys):
            return
        assert self.keys is not None and self.values is not None
        if not len(keys) or not len(self.keys):
            return
        self._unstamp()
        idx = np.minimum(self._positions(keys), len(self.keys) - 1)
        found = self.keys[idx] == keys.order
        if keys.names is not None and not self._same_names(idx[found], keys[found]):
            self.discard()  # an expired key with the hash of a mirrored one: RocksDB answers
            return
        keep = np.ones(len(self.keys), dtype=bool)
        keep[idx[found]] = False
        self.keys, self.values = np.asarray(self.keys)[keep], bulk_rows.select(np.asarray(self.values), keep)
        self._rewrite = True
        if self.names is not None:
            self.names = self.names.filter(pa.array(keep))


class ResidentWindows(ResidentMirror):
    """A window operator's mirror: every open window of the shard as one row, sorted by
    key (rows of one key in their stored order), so a key's windows are one range."""

    def windows_of(self, keys: MirrorKeys) -> tuple[np.ndarray, np.ndarray] | None:
        """The open windows of ``keys`` (distinct) and, for each, the index of its key;
        None when a string key shares its hash with another, or the mirror cannot answer."""
        if not self.holds(keys):
            return None
        ranges = self._ranges(keys)
        if ranges is None:
            return None
        rows, key_index = _expand(*ranges)
        assert self.values is not None
        self.answered = True
        return np.asarray(bulk_rows.take(self.values, rows)), key_index

    def replace(self, keys: MirrorKeys, rows: np.ndarray, row_key: np.ndarray) -> None:
        """Every window of ``keys`` (distinct) becomes ``rows``; ``row_key``: the index in
        ``keys`` of each row's key (a key without rows has none left)."""
        if not self.holds(keys):
            return
        ranges = self._ranges(keys)
        if ranges is None:
            return
        if keys.clash():
            self.discard()
            return
        self._unstamp()
        assert self.keys is not None and self.values is not None
        drop = np.zeros(len(self.keys), dtype=bool)
        drop[_expand(*ranges)[0]] = True
        kept_keys = np.asarray(self.keys)[~drop]
        kept_names = self.names.filter(pa.array(~drop)) if self.names is not None else None
        order = np.argsort(keys.order[row_key], kind="stable")  # by key, each key's rows in their order
        added = keys[row_key[order]]
        self._insert(kept_keys, bulk_rows.select(np.asarray(self.values), ~drop), kept_names,
                     np.searchsorted(kept_keys, added.order), added, bulk_rows.take(rows, order))

    def _ranges(self, keys: MirrorKeys) -> tuple[np.ndarray, np.ndarray] | None:
        """Each key's rows ``[lo, hi)``; None (and the mirror dropped) on a hash clash."""
        assert self.keys is not None
        lo = self._positions(keys)
        hi = self._search(keys, "right")
        found = hi > lo
        if keys.names is not None and not self._same_names(lo[found], keys[found]):
            self.discard()
            return None
        return lo, hi


def _expand(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The positions of every ``[lo, hi)`` range, and the range each belongs to."""
    counts = hi - lo
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    positions = np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(lo - starts, counts)
    return positions, np.repeat(np.arange(len(lo)), counts)


def _write_npy(arr: np.ndarray, fh: Any) -> None:
    np.save(fh, arr)


def _write_arrow(names: pa.Array, fh: Any) -> None:
    table = pa.table([names], names=["key"])
    with pa.ipc.new_file(fh, table.schema) as writer:
        writer.write_table(table)


def _half_free(directory: str) -> int:
    """Half the free space of the filesystem the mirrors go to (a container's /dev/shm
    may be 64 MiB): mirrors never crowd out what else lives there. 0: unknown."""
    path = Path(directory)
    try:
        while not path.exists():
            path = path.parent
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize // 2


def _try_lock(mirror: Path) -> int | None:
    """The mirror's lock, held by this process (its descriptor), or None when another
    attempt holds it or the lock file cannot be opened."""
    try:
        fd = os.open(mirror / _LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _mirrors(directory: Path) -> list[tuple[Path, float, int]]:
    """The machine's mirrors: each folder, when it was stamped (0: unstamped) and the
    bytes of its arrays. Every commit looks at every mirror: no pathlib, no glob."""
    found = []
    with contextlib.suppress(OSError):  # no folder yet: no mirrors
        for entry in os.scandir(directory):
            size, mtime = 0, 0.0
            with contextlib.suppress(OSError):  # evicted meanwhile (or not a folder)
                for f in os.scandir(entry.path):
                    with contextlib.suppress(OSError):  # another attempt may be replacing it
                        if f.name.endswith((".npy", ".arrow")):
                            size += f.stat().st_size
                        elif f.name == _LINEAGE:
                            mtime = f.stat().st_mtime
            found.append((Path(entry.path), mtime, size))
    return found


def _evict(directory: Path, max_bytes: int, keep: Path) -> None:
    """Drop the least recently stamped mirrors (not locked by a running attempt)
    until the machine's mirrors fit ``max_bytes``; unstamped ones go first."""
    mirrors = _mirrors(directory)
    total = sum(size for _, _, size in mirrors)
    for is_keep, _, size, mirror in sorted((path == keep, mtime, size, path) for path, mtime, size in mirrors):
        if total <= max_bytes or is_keep:
            break
        fd = _try_lock(mirror)
        if fd is None:
            continue
        try:
            shutil.rmtree(mirror, ignore_errors=True)
            total -= size
        finally:
            os.close(fd)
