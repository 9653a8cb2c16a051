"""The background compactor: one low-priority process per driver that writes the
compacted alternates (``compacted.py``) of the snapshots each committed epoch leaves.

A compaction in the shard task held up the epoch that ran it: a running aggregate
that rewrites most of its keys compacts every shard every third epoch, and those
epochs took a fifth longer. Here it runs after the commit, while the driver plans
the next epoch and a core sits idle, at the lowest CPU priority (nice 19), so it
takes only time the epochs leave. The next epoch restores a shard's alternate when
it is ready; when it is not, the task restores the snapshot itself and compacts
only as a backstop (``RocksDBOptions.compaction_due``), so a compactor that lags,
dies or never starts costs speed, never state.

The driver writes one JSON job per line to the process's stdin. A newer job for a
shard replaces one still waiting (only the latest committed snapshot is restored
from); jobs run oldest epoch first, shards in order, as the tasks take them. The
process finishes its queue and exits when its driver closes the pipe (or dies), or
after ``IDLE_EXIT_S`` without work; the next submission starts another.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from volley_dagster.json_records import JsonObject
from volley_dagster.state.compacted import compact_snapshot
from volley_dagster.state.digests import FileDigests
from volley_dagster.state.options import RocksDBOptions

IDLE_EXIT_S = 30.0


@dataclass(frozen=True)
class CompactionJob:
    """Compact one committed shard snapshot, if due."""

    root: str  # the checkpoint root: with ``shard``, the slot a newer job replaces
    epoch: int
    shard: int
    snapshot: str  # absolute
    files: FileDigests
    options: RocksDBOptions
    moot_once: str = ""  # a file whose existence means the next epoch committed: nothing would restore the copy

    @property
    def slot(self) -> tuple[str, int]:
        return self.root, self.shard

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "options": dataclasses.asdict(self.options)})

    @classmethod
    def from_json(cls, line: str) -> CompactionJob:
        d: JsonObject = json.loads(line)
        return cls(d["root"], d["epoch"], d["shard"], d["snapshot"], d["files"], RocksDBOptions(**d["options"]),
                   d.get("moot_once", ""))

    def run(self) -> bool:
        """Whether the snapshot has an alternate now."""
        if self.moot():
            return False
        return compact_snapshot(Path(self.root), Path(self.snapshot), self.files, self.options,
                                self.options.compaction_turn(self.epoch, self.shard))

    def moot(self) -> bool:
        """The next epoch committed: nothing restores the copy, and the prune (or retention) may remove it under us."""
        return bool(self.moot_once) and Path(self.moot_once).exists()


def worth_compacting(files: FileDigests) -> bool:
    """A snapshot of one SST has nothing to fold (``RocksDBOptions.compaction_due``
    says no to a lone file): no job, and no process started for it."""
    return sum(name.endswith(".sst") for name in files) >= 2


class BackgroundCompactor:
    """The driver's handle on its compactor process, started on the first job."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def submit(self, jobs: list[CompactionJob]) -> None:
        """Hand jobs over; never raises (a lost compaction costs the next epoch time only)."""
        if not jobs:
            return
        payload = "".join(job.to_json() + "\n" for job in jobs).encode()
        with self._lock:
            for _ in range(2):  # a process that exited idle, or died: start another once
                proc = self._running()
                if proc is None or proc.stdin is None:
                    return
                try:
                    proc.stdin.write(payload)
                    proc.stdin.flush()
                    return
                except OSError:
                    self._proc = None

    def _running(self) -> subprocess.Popen[bytes] | None:
        if self._proc is None or self._proc.poll() is not None:
            try:
                self._proc = subprocess.Popen([sys.executable, "-m", "volley_dagster.state.compactor"],
                                              stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
            except OSError as exc:
                print(f"volley: cannot start the background compactor ({exc}); shards compact in their tasks",
                      file=sys.stderr)
                self._proc = None
        return self._proc

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def close(self, timeout: float | None = None) -> None:
        """Close the pipe: the process finishes its queue and exits (waited for ``timeout``)."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.stdin is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass
        if timeout is not None:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


_SHARED: tuple[int, BackgroundCompactor] | None = None
_SHARED_LOCK = threading.Lock()


def shared_compactor() -> BackgroundCompactor:
    """This process's compactor: one per driver, whatever number of runners it holds."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None or _SHARED[0] != os.getpid():  # a forked child starts its own
            _SHARED = (os.getpid(), BackgroundCompactor())
        return _SHARED[1]


class _Queue:
    """The jobs waiting in the process: one per slot, the newest."""

    def __init__(self) -> None:
        self.waiting: dict[tuple[str, int], CompactionJob] = {}
        self.closed = False
        self.changed = threading.Condition()

    def read(self, stream: IO[str]) -> None:
        for line in stream:
            if not line.strip():
                continue
            try:
                job = CompactionJob.from_json(line)
            except (ValueError, KeyError, TypeError) as exc:
                print(f"volley compactor: ignoring a job it cannot read ({exc}): {line[:200]!r}", file=sys.stderr)
                continue
            with self.changed:
                held = self.waiting.get(job.slot)
                if held is None or held.epoch <= job.epoch:
                    self.waiting[job.slot] = job
                self.changed.notify()
        with self.changed:
            self.closed = True
            self.changed.notify()

    def next(self, idle_exit_s: float) -> CompactionJob | None:
        """The next job; None when the driver is gone and the queue is empty, or nothing came for ``idle_exit_s``."""
        with self.changed:
            if not self.waiting and not self.closed:
                self.changed.wait(idle_exit_s)
            if not self.waiting:
                return None
            job = min(self.waiting.values(), key=lambda j: (j.epoch, j.shard, j.root))
            del self.waiting[job.slot]
            return job


def serve(stream: IO[str], idle_exit_s: float = IDLE_EXIT_S) -> None:
    """Run jobs from ``stream`` until it closes and the queue is empty, or it idles."""
    queue = _Queue()
    threading.Thread(target=queue.read, args=(stream,), daemon=True, name="jobs").start()
    while (job := queue.next(idle_exit_s)) is not None:
        try:
            job.run()
        except Exception as exc:  # the next epoch restores the snapshot itself
            if job.moot():
                continue  # removed under it: nothing restores from it any more
            print(f"volley compactor: epoch {job.epoch} shard {job.shard} ({job.snapshot}): {exc}; the next epoch "
                  "restores the snapshot itself", file=sys.stderr)


def main() -> None:
    try:
        os.nice(19)  # before RocksDB starts its threads: they inherit it
    except OSError:
        pass
    serve(sys.stdin)


if __name__ == "__main__":
    main()
