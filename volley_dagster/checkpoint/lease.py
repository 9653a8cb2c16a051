"""One writer per pipeline: a lease in the checkpoint root, with a fencing token.

Layout under the checkpoint root::

    lease/lock                         flock'ed by the holder for as long as it lives
    lease/tokens/0000000007.json       who took token 7: host, boot, pid, owner (a Dagster
                                       run id), when; renewed by a heartbeat while held

Taking the lease (``PipelineLease.acquire``):

1. ``flock`` the lock file, waiting up to ``wait_s``. The kernel frees it when the
   holder dies, ``kill -9`` included, so on one machine a crashed holder never
   blocks the next.
2. If the newest token record names a holder on another machine whose heartbeat has
   not expired and that did not release it, wait for that too: a shared disk whose
   locks do not reach across machines is fenced by the expiry (``ttl_s``).
3. Create the next token record exclusively. Tokens only grow, and each is taken once.

Fencing: whatever makes an epoch's work visible checks first that its token is still
the newest (``Fence.check``): a snapshot install and an S3 shard manifest on the
executors, each sink commit, the epoch manifest, a layout record and retention on the
driver. A holder that lost the lease (its heartbeat stalled past ``ttl_s`` and another
machine took over) then stops with ``FencedError`` before writing. Cutting a range
takes no lease: a range is created exclusively, so of two cutters one wins and the
other reads the recorded range back.

Self-fencing: on the driver, ``PipelineLease.check`` also refuses once the holder's own
lease is within ``margin_s`` of its expiry (``LeaseLapsedError``), and a heartbeat that
wakes to a lapsed lease stops renewing it: a holder paused past its lease (a long GC
pause, a suspended VM) stops before its next write even before anyone took over. A
taker on another machine waits ``margin_s`` past the expiry (clock skew between the
machines), so the two never both believe they hold it. The stopped holder heals by
``PipelineLease.retake``: a new token, taken as ``acquire`` takes one, so the lapsed
token fences whatever of its old attempt still runs. What this leaves open is a write
already past its check when the pause begins: the window between one check and the
write after it (manifests, layout records and attempt directories are created
exclusively; Delta and Iceberg commits are optimistic; Kafka fences at the broker).

Executors whose disk does not hold the checkpoint root (a snapshot store on S3, no
shared disk) find no token records: they carry the driver's token without checking
it. Their writes are attempt-scoped (nothing names them until a manifest does), and
the driver checks the fence before every write that makes them visible.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, TypeVar

from volley_dagster.errors import FencedError, LeaseLapsedError, PipelineBusyError
from volley_dagster.io.atomic import create_json_exclusive, read_json, write_json_atomic
from volley_dagster.process import boot_id, is_alive, start_ticks

DEFAULT_WAIT_S = 60.0
DEFAULT_TTL_S = 30.0
_KEEP_RECORDS = 16
MAX_RETAKES = 2  # lapses healed in one call of ``retaking_on_lapse``: a process that keeps pausing fails loudly
_log = logging.getLogger(__name__)
_T = TypeVar("_T")


def _now() -> float:
    return time.time()


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True)
class LeaseRecord:
    """``lease/tokens/<token>.json``: who holds (or held) the token."""

    token: int
    host: str
    boot: str
    pid: int
    pid_ticks: int | None
    owner: str  # e.g. "dagster run 1f2e..." or "cli"
    acquired_at: float
    renewed_at: float
    expires_at: float
    released_at: float | None = None

    @classmethod
    def read(cls, path: Path) -> LeaseRecord:
        return cls(**read_json(path))

    def on_this_machine(self) -> bool:
        return self.host == socket.gethostname() and self.boot == boot_id()

    def is_live(self, now: float) -> bool:
        """Held, as far as this machine can tell: on this machine the process must still
        run; on another one the heartbeat must be fresh."""
        if self.released_at is not None:
            return False
        if self.on_this_machine():
            return is_alive(self.pid, self.pid_ticks)
        return now < self.expires_at + clock_margin_s(self.expires_at - self.renewed_at)

    def describe(self) -> str:
        owner = f" ({self.owner})" if self.owner else ""
        return (f"host {self.host} pid {self.pid}{owner}, token {self.token}, "
                f"taken {_iso(self.acquired_at)}, last renewed {_iso(self.renewed_at)}")


@dataclass(frozen=True)
class Fence:
    """A holder's token, checked where work becomes visible. Settings only: shipped to
    Spark executors, which reach the checkpoint root."""

    root: str
    token: int

    def check(self, what: str) -> None:
        root = Path(self.root)
        if not _tokens_dir(root).is_dir():
            return  # an executor without the root's disk: the driver fences (module docstring)
        newest = newest_token(root)
        if newest != self.token:
            raise FencedError(
                f"{what}: stopped, the lease of {self.root} moved on to token {newest} (this runner holds {self.token}); "
                "another runner took the pipeline over, so nothing more is written by this one"
            )


def clock_margin_s(ttl_s: float) -> float:
    """How far two machines' clocks may disagree: a holder stops this long before its
    lease expires, a taker waits this long after."""
    return min(5.0, ttl_s / 6)


def _tokens_dir(root: Path) -> Path:
    return root / "lease" / "tokens"


def _record_path(root: Path, token: int) -> Path:
    return _tokens_dir(root) / f"{token:010d}.json"


def _tokens(root: Path) -> list[int]:
    d = _tokens_dir(root)
    if not d.is_dir():
        return []
    return sorted(int(p.name[:-5]) for p in d.iterdir() if p.name.endswith(".json") and p.name[:-5].isdigit())


def newest_token(root: Path) -> int:
    """The fencing token of the newest lease taken on this root (0: never leased)."""
    tokens = _tokens(root)
    return tokens[-1] if tokens else 0


def current_holder(root: Path) -> LeaseRecord | None:
    """The newest lease record, whether or not it is still held."""
    token = newest_token(root)
    if not token:
        return None
    try:
        return LeaseRecord.read(_record_path(root, token))
    except FileNotFoundError:
        return None


class PipelineLease:
    """``with PipelineLease(root, owner="dagster run ...").acquire(): ...``; ``fence``
    while held."""

    def __init__(
        self,
        root: str | Path,
        owner: str = "",
        *,
        wait_s: float = DEFAULT_WAIT_S,
        ttl_s: float = DEFAULT_TTL_S,
        pipeline: str = "",
        notify: Callable[[str], None] | None = None,
    ) -> None:
        """``notify`` hears what a user watching the run should know: a wait for another
        holder, a lapsed lease taken again (default: a warning on this module's logger)."""
        self.root = Path(root).absolute()
        self.owner = owner
        self.wait_s = wait_s
        self.ttl_s = ttl_s
        self.pipeline = pipeline
        self.notify = notify or _log.warning
        self.record: LeaseRecord | None = None
        self.waited_s = 0.0
        self._fd: int | None = None
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._lapsed_at: float | None = None
        self._beat_at: float | None = None  # when the heartbeat last woke, and what its write raised
        self._beat_error: str | None = None

    @property
    def held(self) -> bool:
        return self.record is not None

    @property
    def fence(self) -> Fence:
        if self.record is None:
            raise FencedError(f"the lease of {self.root} is not held")
        return Fence(str(self.root), self.record.token)

    def check(self, what: str) -> None:
        """Before a write that makes work visible, on the driver: the lease has not
        lapsed under this holder (``Fence.check`` cannot tell: the token may still be
        the newest) and no one took it over."""
        record = self.record
        if record is None:
            raise FencedError(f"{what}: the lease of {self.root} is not held")
        now = _now()
        if self._lapsed_at is not None or now >= record.expires_at - clock_margin_s(self.ttl_s):
            self._lapsed_at = self._lapsed_at or now
            raise LeaseLapsedError(
                f"{what}: stopped, this runner's lease of {self.root} (token {record.token}) lapsed: it was due "
                f"{_iso(record.expires_at)} and it is {_iso(now)}; {self._heartbeat_account(record, now)}. Another runner "
                "may hold it now, so nothing more is written under this token; a retry takes a new lease"
            )
        self.fence.check(what)

    def _heartbeat_account(self, record: LeaseRecord, now: float) -> str:
        """What the heartbeat did since the last renewal: a failed write, or no beat in
        time (the process or its machine paused, or the wall clock stepped forward)."""
        every = f"its heartbeat is due every {self.ttl_s / 3:.1f}s"
        if self._beat_error is not None:
            return f"{every} and could not write the record ({self._beat_error})"
        woke = "has not woken since" if self._beat_at is None else f"last woke {now - self._beat_at:.1f}s ago"
        return (f"it was last renewed {now - record.renewed_at:.1f}s ago; {every} and {woke}, so the process or its "
                "machine was paused, a renewal's write stalled, or the wall clock stepped forward")

    # -- taking and giving back ------------------------------------------------------------

    def acquire(self) -> PipelineLease:
        started = time.monotonic()
        deadline = started + self.wait_s
        lock = self.root / "lease" / "lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            self._wait(lambda: _try_flock(fd), deadline)
            self.record = self._take_token_after_others(deadline)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.waited_s = time.monotonic() - started
        self._prune_records()
        self._start_heartbeat()
        return self

    def retake(self, why: str) -> LeaseRecord:
        """After ``LeaseLapsedError`` (``why``), with the flock still held: a new token,
        taken as ``acquire`` takes one (a live holder on another machine is waited out).
        The lapsed token then fences whatever of the stopped attempt still runs."""
        lapsed = self.record
        if lapsed is None or self._fd is None:
            raise FencedError(f"{why}: the lease of {self.root} is not held, so it cannot be taken again")
        self._stop_heartbeat()
        self.record = self._take_token_after_others(time.monotonic() + self.wait_s)
        self._start_heartbeat()
        self.notify(f"{why}; took the lease of {self.pipeline or self.root.name!r} again (fencing token "
                    f"{self.record.token}, was {lapsed.token}) and runs again")
        return self.record

    def retaking_on_lapse(self, attempt: Callable[[], _T]) -> _T:
        """``attempt()``, called again under a new token (``retake``) each time the lease
        lapses under it, at most ``MAX_RETAKES`` times: it wrote nothing after the lapse,
        and running an epoch again commits it at most once."""
        retakes = 0
        while True:
            try:
                return attempt()
            except LeaseLapsedError as exc:
                if retakes == MAX_RETAKES:
                    raise
                retakes += 1
                self.retake(str(exc))

    def release(self) -> None:
        if self.record is None:
            return
        self._stop_heartbeat()
        with contextlib.suppress(OSError):
            if newest_token(self.root) == self.record.token:
                write_json_atomic(_record_path(self.root, self.record.token),
                                  asdict(replace(self.record, released_at=_now())))
        self.record = None
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> PipelineLease:
        return self if self.held else self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    # -- internals ----------------------------------------------------------------------------

    def _wait(self, ready: Callable[[], bool], deadline: float) -> None:
        told = False
        while not ready():
            holder = current_holder(self.root)
            if time.monotonic() >= deadline:
                who = holder.describe() if holder is not None else "a runner that has not written its record yet"
                raise PipelineBusyError(
                    f"pipeline {self.pipeline or self.root.name!r} is busy: its lease in {self.root / 'lease'} is held "
                    f"by {who}; waited {self.wait_s:.0f}s. Another run of this pipeline is in progress: let it "
                    f"finish and run again (a holder killed on this machine frees the lease at once; on another "
                    f"machine, {self.ttl_s:.0f}s after its last heartbeat)"
                )
            if not told:
                self.notify(f"waiting for the lease of {self.pipeline or self.root.name!r}, held by "
                            f"{holder.describe() if holder is not None else 'another runner'}")
                told = True
            time.sleep(0.2)

    def _held_elsewhere(self) -> bool:
        """Holding the flock settles it on this machine; a holder on another machine
        that is still renewing its record holds the lease too."""
        holder = current_holder(self.root)
        return holder is not None and not holder.on_this_machine() and holder.is_live(_now())

    def _take_token_after_others(self, deadline: float) -> LeaseRecord:
        """With the flock held: the next token, once no holder on another machine is live."""
        self._wait(lambda: not self._held_elsewhere(), deadline)
        return self._take_token()

    def _take_token(self) -> LeaseRecord:
        while True:
            now = _now()
            record = LeaseRecord(
                token=newest_token(self.root) + 1, host=socket.gethostname(), boot=boot_id(), pid=os.getpid(),
                pid_ticks=start_ticks(os.getpid()), owner=self.owner, acquired_at=now, renewed_at=now,
                expires_at=now + self.ttl_s,
            )
            if create_json_exclusive(_record_path(self.root, record.token), asdict(record)):
                return record

    def _start_heartbeat(self) -> None:
        self._lapsed_at = self._beat_at = self._beat_error = None
        self._stop.clear()
        self._heartbeat = threading.Thread(target=self._renew_until_stopped, name="volley-lease", daemon=True)
        self._heartbeat.start()

    def _stop_heartbeat(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
            self._heartbeat = None

    def _renew_until_stopped(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            record = self.record
            if record is None or newest_token(self.root) != record.token:
                return  # taken over: the fence stops this holder's writes
            now = self._beat_at = _now()
            if now >= record.expires_at - clock_margin_s(self.ttl_s):
                self._lapsed_at = now  # paused past the lease: renewing now would hide it; check() stops the holder
                return
            renewed = replace(record, renewed_at=now, expires_at=now + self.ttl_s)
            try:
                write_json_atomic(_record_path(self.root, record.token), asdict(renewed))
            except OSError as exc:  # a missed beat only shortens the lease; check() names it if it lapses
                self._beat_error = f"{type(exc).__name__}: {exc}"
                continue
            self.record, self._beat_error = renewed, None

    def _prune_records(self) -> None:
        for token in _tokens(self.root)[:-_KEEP_RECORDS]:
            with contextlib.suppress(FileNotFoundError):
                _record_path(self.root, token).unlink()


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True
