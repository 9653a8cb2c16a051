"""A shard's running-aggregate state kept resident between epochs (Volley's point:
state operations should mostly hit memory).

The state of one shard is mirrored, decoded, as two NumPy arrays (sorted int64
keys and their fixed-width state records) in a directory of the machine's memory
(``/dev/shm`` where there is one). Spark does not pin a shard to a Python
worker, so the mirror lives beside the workers, not in one: whichever worker
runs the shard next epoch maps it and looks keys up with ``searchsorted``
instead of scanning or ``multi_get``-ing RocksDB. RocksDB stays the durable
truth: every write still goes through the ``WriteBatch`` and the snapshot.

A mirror is used only while its lineage equals the snapshot the epoch restores:
the checkpoint root, shard, state layout and the SHA-256 digests of that
snapshot's files (the same files mean the same state, so an empty epoch's
carried-forward snapshot keeps it valid). It is unstamped before it changes and
stamped again only after the new snapshot exists, so a killed or failed attempt
leaves no mirror to trust; a mismatch, a lock held by another attempt or a
damaged file falls back to RocksDB. A mirror is (re)built only when an epoch has
the whole shard in hand anyway: a first epoch, or one that scans the shard.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from volley_dagster.io.atomic import private_dir, write_json_atomic
from volley_dagster.process import boot_id

if TYPE_CHECKING:
    from volley_dagster.state.store import FileDigests  # store imports this module

_LINEAGE = "lineage.json"
_KEYS = "keys.npy"
_VALUES = "values.npy"
_LOCK = ".lock"
DEFAULT_MAX_MIB = 1024


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
        self, identity: dict[str, Any], previous_files: FileDigests | None, records: np.dtype
    ) -> ResidentShard | None:
        """The shard's mirror of ``records``, locked for this attempt: complete when its
        lineage is ``previous_files`` (or the shard starts empty), else incomplete.
        None when another attempt holds it."""
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
            shard = ResidentShard(self, path, lock, identity, records)
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


class ResidentShard:
    """One shard's mirror during one attempt (holds the lock until ``release``)."""

    def __init__(
        self, cache: ResidentStateCache, path: Path, lock: int, identity: dict[str, Any], records: np.dtype
    ) -> None:
        self._cache = cache
        self.path = path
        self._lock = lock
        self._identity = identity
        self._records = records
        self.keys: np.ndarray | None = None  # sorted int64; None: not complete
        self.values: np.ndarray | None = None
        self._rewrite = False  # the arrays changed shape: write them whole at commit

    @property
    def complete(self) -> bool:
        """The mirror holds the whole shard as the restored snapshot has it."""
        return self.keys is not None

    def start_empty(self) -> None:
        self._unstamp()
        self.keys, self.values, self._rewrite = np.empty(0, np.int64), np.empty(0, self._records), True

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
        self.keys, self.values = keys, values

    def lookup(self, keys: np.ndarray, blank_rows: Callable[[int], np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """States of ``keys`` (blank where absent) and which existed."""
        assert self.keys is not None and self.values is not None
        state = blank_rows(len(keys))
        if not len(self.keys):
            return state, np.zeros(len(keys), dtype=bool)
        idx = np.minimum(np.searchsorted(self.keys, keys), len(self.keys) - 1)
        existed = self.keys[idx] == keys
        state[existed] = self.values[idx[existed]]
        return state, existed

    def adopt(self, keys: np.ndarray, values: np.ndarray) -> None:
        """The whole shard, as a scan of the restored snapshot read it."""
        order = np.argsort(keys, kind="stable")
        self._unstamp()
        self.keys, self.values, self._rewrite = keys[order], values[order], True

    def update(self, keys: np.ndarray, states: np.ndarray) -> None:
        """Set the epoch's new states: in place for known keys, merged in for new ones."""
        assert self.keys is not None and self.values is not None
        self._unstamp()
        idx = np.searchsorted(self.keys, keys)
        known = idx < len(self.keys)
        known[known] = self.keys[idx[known]] == keys[known]
        self.values[idx[known]] = states[known]
        new = ~known
        if new.any():
            order = np.argsort(keys[new], kind="stable")
            new_keys, at = keys[new][order], idx[new][order]
            self.keys = np.insert(np.asarray(self.keys), at, new_keys)
            self.values = np.insert(np.asarray(self.values), at, states[new][order])
            self._rewrite = True

    def remove(self, keys: np.ndarray) -> None:
        """Drop these keys (expired): the state no longer holds them."""
        assert self.keys is not None and self.values is not None
        if not len(keys) or not len(self.keys):
            return
        self._unstamp()
        idx = np.minimum(np.searchsorted(self.keys, keys), len(self.keys) - 1)
        keep = np.ones(len(self.keys), dtype=bool)
        keep[idx[self.keys[idx] == keys]] = False
        self.keys, self.values, self._rewrite = np.asarray(self.keys)[keep], np.asarray(self.values)[keep], True

    def discard(self) -> None:
        """This attempt cannot keep the mirror whole (it read the shard sparsely)."""
        self._unstamp()
        self.keys = self.values = None

    def commit(self, snapshot_files: FileDigests) -> None:
        """Stamp the mirror with the snapshot it now equals (after that snapshot exists)."""
        if self.keys is None or self.values is None:
            return
        size = self.keys.nbytes + self.values.nbytes
        if size > self._cache.max_bytes:
            self.discard()
            return
        try:
            if self._rewrite:
                for name, arr in ((_KEYS, self.keys), (_VALUES, self.values)):
                    tmp = self.path / f".{name}.tmp"
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
                    with os.fdopen(fd, "wb") as fh:
                        np.save(fh, np.asarray(arr))
                    os.replace(tmp, self.path / name)
            else:
                for arr in (self.keys, self.values):
                    if isinstance(arr, np.memmap):
                        arr.flush()
            write_json_atomic(self.path / _LINEAGE, {"identity": self._identity, "snapshot": lineage_of(snapshot_files)})
            _evict(Path(self._cache.directory), self._cache.max_bytes, keep=self.path)
        except OSError:  # the memory filesystem is full (or gone): the epoch goes on without a mirror
            self.discard()
            for name in (_KEYS, _VALUES, f".{_KEYS}.tmp", f".{_VALUES}.tmp"):
                with contextlib.suppress(OSError):
                    (self.path / name).unlink(missing_ok=True)

    def release(self) -> None:
        self.keys = self.values = None  # unmaps
        os.close(self._lock)

    def _unstamp(self) -> None:
        (self.path / _LINEAGE).unlink(missing_ok=True)


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


def _evict(directory: Path, max_bytes: int, keep: Path) -> None:
    """Drop the least recently stamped mirrors (not locked by a running attempt)
    until the machine's mirrors fit ``max_bytes``."""
    mirrors = []
    for entry in directory.iterdir():
        size = 0
        for f in entry.glob("*.npy"):
            with contextlib.suppress(OSError):  # another attempt may be replacing it
                size += f.stat().st_size
        try:
            mtime = (entry / _LINEAGE).stat().st_mtime
        except OSError:  # unstamped: first to go
            mtime = 0.0
        mirrors.append((entry == keep, mtime, size, entry))
    total = sum(m[2] for m in mirrors)
    for is_keep, _, size, entry in sorted(mirrors):
        if total <= max_bytes or is_keep:
            break
        fd = _try_lock(entry)
        if fd is None:
            continue
        try:
            shutil.rmtree(entry, ignore_errors=True)
            total -= size
        finally:
            os.close(fd)
