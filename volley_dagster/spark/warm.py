"""A warm Spark for Dagster runs: one supervised Spark Connect server per home
directory, which every run reaches in about a second instead of starting a JVM.

The first run that needs it (or ``./dev dagster``, before the UI starts) spawns a
supervisor process (``python -m volley_dagster.spark.warm``). The supervisor starts
the server on a free loopback port and records it in ``<home>/warm-spark.json``.
It checks the server every ``CHECK_EVERY_S`` seconds and starts a new one if it
died. It stops the server and exits when its owner exits: the ``dagster dev``
process the run descends from, so the server ends with the deployment.

A run whose server dies mid-epoch fails that attempt like a lost executor, and is
retried: nothing was committed (the manifest is written last). Runs that cannot
reach a server fall back to a local Spark (``resources.SparkResource``).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from volley_dagster.errors import ConfigError, VolleyError
from volley_dagster.io.atomic import read_json, write_json_atomic
from volley_dagster.process import boot_id, command_line, is_alive, parent_pid, start_ticks
from volley_dagster.spark.connect import ConnectServer, listening, start_connect_server

__all__ = ["WarmSpark", "WarmSparkUnavailable", "dagster_dev_ancestor", "default_home", "find_or_start", "read_record", "stop", "warm_session"]

RECORD = "warm-spark.json"
CHECK_EVERY_S = 2.0
START_TIMEOUT_S = 180.0
SUPERVISOR_START_S = 30.0
SESSION_RETRIES = 5  # about 4 s of retries against an unreachable server
# the shared session lives as long as its server (its default idle timeout is an hour)
SERVER_CONF = {"spark.connect.session.manager.defaultSessionTimeout": "3650d"}  # a supervisor records itself as it starts; none by then means it failed


class WarmSparkUnavailable(VolleyError):
    """No warm Spark could be reached or started; the caller decides what to fall back to."""


@dataclass(frozen=True)
class WarmSpark:
    """The record a supervisor keeps of itself and its server (``<home>/warm-spark.json``):
    written as it starts (no server yet: ``url`` None), then for each server it starts."""

    supervisor_pid: int
    supervisor_ticks: int | None
    owner_pid: int
    boot: str
    url: str | None = None
    port: int | None = None
    server_pid: int | None = None
    session_id: str | None = None  # the server-side session every run attaches to
    restarts: int = 0
    start_failures: int = 0  # servers that would not start, in a row

    def supervisor_alive(self) -> bool:
        return self.boot == boot_id() and is_alive(self.supervisor_pid, self.supervisor_ticks)

    def accepting(self) -> bool:
        return self.port is not None and self.supervisor_alive() and listening(self.port)


def default_home() -> Path:
    """The Dagster instance's directory when there is one: one warm Spark per deployment."""
    base = os.environ.get("VOLLEY_WARM_SPARK_HOME") or os.environ.get("DAGSTER_HOME")
    return Path(base) / "warm-spark" if base else Path.home() / ".cache" / "volley" / "warm-spark"


def dagster_dev_ancestor(pid: int | None = None) -> int:
    """The ``dagster dev`` process this one descends from, else this process's parent:
    what the server should live as long as."""
    current = os.getppid() if pid is None else pid
    while current > 1:
        parent = parent_pid(current)
        if parent is None:
            break
        words = [Path(w).name for w in command_line(current) if w]
        if "dev" in words and any(w == "dagster" or w.endswith("/dagster") for w in words):
            return current
        current = parent
    return os.getppid()


def read_record(home: Path) -> WarmSpark | None:
    path = home / RECORD
    try:
        return WarmSpark(**read_json(path))
    except (OSError, ValueError, TypeError):
        return None


def find_or_start(home: Path | None = None, owner_pid: int | None = None,
                  timeout: float = START_TIMEOUT_S) -> WarmSpark:
    """The warm Spark under ``home``, serving: the running one, else one a new
    supervisor starts (owned by ``owner_pid``, default the ``dagster dev`` ancestor)."""
    home = (home or default_home()).absolute()
    home.mkdir(parents=True, exist_ok=True)
    record = read_record(home)
    if record is not None and record.url is not None and record.accepting():
        return record
    with _locked(home):  # one supervisor per home, however many runs start at once
        record = read_record(home)
        if record is None or not record.supervisor_alive():
            with contextlib.suppress(FileNotFoundError):
                (home / RECORD).unlink()  # a dead supervisor's
            _spawn_supervisor(home, owner_pid or dagster_dev_ancestor())
        started = time.monotonic()
        why = f"none served within {timeout:.0f}s"
        while time.monotonic() - started < timeout:  # a new server, or one the supervisor is restarting
            record = read_record(home)
            if record is not None and record.url is not None and record.accepting():
                return record
            waited = time.monotonic() - started
            if record is not None and (not record.supervisor_alive() or record.start_failures):
                # it died, or its server will not start (no Java 17, a port taken): its logs say why
                why = (f"its supervisor died after {waited:.0f}s" if not record.supervisor_alive() else
                       f"its Spark Connect server failed to start ({record.start_failures} time(s) in {waited:.0f}s)")
                break
            if record is None and waited > SUPERVISOR_START_S:
                why = f"its supervisor did not start within {SUPERVISOR_START_S:.0f}s"
                break
            time.sleep(0.5)
    raise WarmSparkUnavailable(
        f"no warm Spark under {home}: {why}; see {home / 'supervisor.log'} and {home / 'spark-connect.log'}"
    )


def warm_session(url: str, session_id: str | None = None) -> Any:
    """A client of the warm Spark, attached to its shared server-side session: a run's
    first epoch then finds the session's Python workers and caches warm (a 1,000-record
    epoch takes about 1 s instead of 4 s in a new session). It gives up on a dead
    server in seconds (PySpark's default retries for 10 minutes): the failed attempt is
    retried, and the retry finds the server the supervisor started in its place."""
    from pyspark.sql import SparkSession
    from pyspark.sql.connect.client.retries import DefaultPolicy

    def connect(target: str) -> Any:
        spark = SparkSession.builder.remote(target).create()
        spark.client.set_retry_policies([DefaultPolicy(max_retries=SESSION_RETRIES, max_backoff=2_000)])
        return spark

    if session_id is None:
        return connect(url)
    spark = connect(f"{url}/;session_id={session_id}")
    try:
        spark.sql("SELECT 1").schema  # noqa: B018 - one round trip: is the shared session still open?
    except Exception as exc:  # closed (released, or the server forgot it): a session of this run's own
        if "SESSION_CLOSED" not in str(exc) and "INVALID_HANDLE" not in str(exc):
            raise
        return connect(url)
    return spark


def prime(url: str, session_id: str) -> float:
    """Start the shared session's Python workers, one per core, and have them import
    what epoch tasks import, so that the first run's epoch is as quick as the next
    ones (about 1 s rather than 7 s for 1,000 records on two cores). Returns seconds."""
    began = time.monotonic()
    spark = warm_session(url, session_id)
    cores = os.cpu_count() or 1
    ids = spark.range(0, 4 * cores, 1, cores)
    ids.mapInArrow(_import_task_modules, "id long").collect()
    ids.repartition(cores, "id").mapInArrow(_import_task_modules, "id long").collect()  # an epoch's shape (per_shard)
    return time.monotonic() - began


def _import_task_modules(batches: Iterator[Any]) -> Iterator[Any]:
    import volley_dagster.operators  # noqa: F401
    import volley_dagster.spark.tasks  # noqa: F401

    yield from batches


def stop(home: Path | None = None, timeout: float = 30.0) -> bool:
    """Stop the supervisor under ``home`` (and so its server); False if none ran."""
    record = read_record((home or default_home()).absolute())
    if record is None or not record.supervisor_alive():
        return False
    os.kill(record.supervisor_pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and record.supervisor_alive():
        time.sleep(0.2)
    return True


def _spawn_supervisor(home: Path, owner_pid: int) -> None:
    """Detached: its own session, and not a child of this process (a run that is killed
    with its children, as run launchers and tests do, leaves the warm Spark running)."""
    command = [sys.executable, "-m", "volley_dagster.spark.warm", "--home", str(home), "--owner", str(owner_pid)]
    env = {**os.environ, "PYSPARK_PYTHON": os.environ.get("PYSPARK_PYTHON", sys.executable)}
    with open(home / "supervisor.log", "ab") as log:
        launcher = subprocess.Popen(
            [sys.executable, "-c", "import subprocess, sys; subprocess.Popen(sys.argv[1:], start_new_session=True)",
             *command],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
        )
    launcher.wait(30)


@contextlib.contextmanager
def _locked(home: Path) -> Iterator[None]:
    with open(home / "warm-spark.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Supervisor:
    """Keeps one server alive while its owner lives; removes its record when it stops."""

    def __init__(self, home: Path, owner_pid: int, master: str) -> None:
        self.home, self.owner_pid, self.master = home, owner_pid, master
        self.owner_ticks = start_ticks(owner_pid)
        self.server: ConnectServer | None = None
        self.restarts = 0
        self.start_failures = 0
        self.next_start = 0.0
        self.stopping = False

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGINT, self._on_term)
        self._record()
        try:
            while not self.stopping and is_alive(self.owner_pid, self.owner_ticks):
                dead = self.server is None or self.server.process.poll() is not None
                if dead and time.monotonic() >= self.next_start:
                    self._start()
                time.sleep(CHECK_EVERY_S)
            _log(f"owner {self.owner_pid} exited" if not self.stopping else "asked to stop")
        finally:
            self._shutdown()
        return 0

    def _start(self) -> None:
        if self.server is not None:
            self.restarts += 1
            _log(f"server (pid {self.server.process.pid}) exited with {self.server.process.returncode}: restarting")
        port = _free_port()
        try:
            self.server = start_connect_server(port, self.master, self.home / "spark-connect.log",
                                               extra_conf=SERVER_CONF)
        except ConfigError as exc:
            self.server, self.start_failures = None, self.start_failures + 1
            self.next_start = time.monotonic() + min(300.0, 15.0 * 2 ** self.start_failures)  # back off
            _log(f"could not start a server ({self.start_failures} in a row): {exc}")
            self._record()
            return
        self.start_failures = 0
        self._record(self.server, port)
        _log(f"Spark Connect at {self.server.url} (pid {self.server.process.pid}, restarts {self.restarts})")
        record = read_record(self.home)
        if record is not None and record.url is not None and record.session_id is not None:
            subprocess.Popen([sys.executable, "-m", "volley_dagster.spark.warm", "--prime", record.url,
                              "--session-id", record.session_id], stdin=subprocess.DEVNULL)

    def _record(self, server: ConnectServer | None = None, port: int | None = None) -> None:
        write_json_atomic(self.home / RECORD, asdict(WarmSpark(
            os.getpid(), start_ticks(os.getpid()), self.owner_pid, boot_id(),
            server.url if server else None, port, server.process.pid if server else None,
            str(uuid.uuid4()) if server else None, self.restarts, self.start_failures,
        )))

    def _on_term(self, *_: object) -> None:
        self.stopping = True

    def _shutdown(self) -> None:
        record = read_record(self.home)
        if record is not None and record.supervisor_pid == os.getpid():
            with contextlib.suppress(OSError):
                (self.home / RECORD).unlink()
        if self.server is not None:
            self.server.stop()
            _log("server stopped")


def _log(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} warm Spark: {message}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Supervise a warm Spark Connect server for Dagster runs")
    parser.add_argument("--home")
    parser.add_argument("--owner", type=int, help="stop when this process exits")
    parser.add_argument("--master", default=os.environ.get("VOLLEY_WARM_SPARK_MASTER", "local[*]"))
    parser.add_argument("--prime", metavar="URL", help="only warm up this server's shared session, then exit")
    parser.add_argument("--session-id")
    args = parser.parse_args(argv)
    if args.prime:
        _log(f"shared session primed in {prime(args.prime, args.session_id):.1f} s")
        return 0
    if args.home is None or args.owner is None:
        parser.error("--home and --owner are required")
    return _Supervisor(Path(args.home), args.owner, args.master).run()


if __name__ == "__main__":
    sys.exit(main())
