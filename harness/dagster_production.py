"""Dagster's production shape for tests (issue 77): no ``dagster dev``, but the processes
a deployment runs, each on its own, as Dagster's deployment guide lays them out:

- the code location served by ``dagster api grpc`` in its own process, which the
  workspace names by host and port (``grpc_server:``), so the daemon and the webserver
  never import the code;
- ``dagster-daemon run`` (sensors, the run queue, backfills, run retries and monitoring);
- ``dagster-webserver`` (the UI and its GraphQL API);
- run, event log and schedule storage on PostgreSQL (``dagster-postgres``);
- the instance settings the pipelines need, as ``volley dagster-instance`` prints them
  (``volley_dagster.dagster.instance.instance_settings``): the queued run coordinator,
  one run per pipeline pool, run retries and run monitoring. The run launcher is
  Dagster's default: each run is a process the code server starts (see
  ``start_dagster_production``).

    with dagster_production("tests/ui/location.py", postgres, home=tmp / "dagster_home", env=...) as srv:
        srv.client.launch_partition_backfill(...)
        with srv.instance() as instance: ...

Every process is in a process group of its own and carries a token in its
environment; ``stop()`` ends the groups and any straggler with the token (a run
worker, its Spark driver). The logs are ``<home>/<process>.log``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Iterator, Mapping, Sequence

import yaml  # type: ignore[import-untyped]  # PyYAML: a dagster dependency

from harness.dagster_dev import _TOKEN_VAR, _reset_signals_and_detach, stop_process_groups, wait_ready
from harness.dagster_graphql import BACKFILL_DAEMONS, DagsterGraphQL
from harness.postgres import Postgres
from harness.processes import free_ports, tail
from volley_dagster.dagster.instance import instance_settings

LOCATION_NAME = "volley_production"
PROCESSES = ("code_server", "daemon", "webserver")  # in the order they start


def postgres_storage(pg: Postgres, database: str) -> dict[str, Any]:
    """``storage:`` with runs, the event log and schedules (sensor ticks and states) in
    ``database`` (``dagster-postgres``). The scheme names psycopg2, the driver
    dagster-postgres depends on: SQLAlchemy 2.1 maps a bare ``postgresql://`` to psycopg
    3, which nothing installs (``ModuleNotFoundError: No module named 'psycopg'``)."""
    return {"postgres": {"postgres_db": {"hostname": "127.0.0.1", "port": pg.port, "username": pg.user,
                                         "password": pg.password, "db_name": database,
                                         "scheme": "postgresql+psycopg2"}}}


def production_dagster_yaml(pg: Postgres, database: str) -> dict[str, Any]:
    """The instance: PostgreSQL storage and the shipped settings (without this
    package's run launcher: the code server launches the runs), telemetry off."""
    return {"storage": postgres_storage(pg, database), **instance_settings(), "telemetry": {"enabled": False}}


@dataclass
class DagsterProduction:
    """The running processes; stop them with ``stop()`` (idempotent)."""

    home: Path
    workspace: Path
    host: str
    port: int  # the webserver's
    grpc_port: int  # the code server's
    token: str
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)
    _log_files: list[IO[bytes]] = field(default_factory=list)
    client: DagsterGraphQL = field(init=False)

    def __post_init__(self) -> None:
        self.client = DagsterGraphQL(self.url)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def log(self) -> Path:
        return self.logs["webserver"]

    @property
    def code_server(self) -> subprocess.Popen[bytes]:
        return self.procs["code_server"]

    def exited(self) -> str | None:
        """Which process exited, with its code, or None while all of them run."""
        gone = [f"{name} exited with {proc.returncode}" for name, proc in self.procs.items() if proc.poll() is not None]
        return "; ".join(gone) or None

    def logtail(self, lines: int = 60) -> str:
        """The tail of every process's log: a failure shows each side."""
        return "\n".join(f"--- {name} ({self.logs[name]}):\n{tail(self.logs[name], lines)}" for name in self.procs)

    def instance(self) -> Any:
        """A ``DagsterInstance`` on the same storage (PostgreSQL). Caller disposes."""
        from dagster import DagsterInstance

        return DagsterInstance.from_config(str(self.home))

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM every process group, wait, then SIGKILL the groups and anything else
        carrying this deployment's token (a run worker and its Spark driver)."""
        stop_process_groups(list(self.procs.values()), self.token, timeout)
        for fh in self._log_files:
            fh.close()
        self._log_files.clear()

    def _start(self, name: str, cmd: Sequence[str], env: Mapping[str, str], cwd: Path) -> None:
        log = self.home / f"{name}.log"
        fh = open(log, "ab")
        self._log_files.append(fh)
        fh.write(f"$ {' '.join(cmd)}\n".encode())
        fh.flush()
        self.logs[name] = log
        self.procs[name] = subprocess.Popen(list(cmd), cwd=str(cwd), env=dict(env), stdin=subprocess.DEVNULL,
                                            stdout=fh, stderr=subprocess.STDOUT,
                                            preexec_fn=_reset_signals_and_detach)


def _entry_point(name: str) -> str:
    """A console script of this interpreter's environment (``dagster-daemon``, ...)."""
    path = Path(sys.executable).parent / name
    if not path.is_file():
        raise RuntimeError(f"{path} is missing: install the test extra (`uv pip install -e '.[test]'`)")
    return str(path)


def _wait_code_server(srv: DagsterProduction, timeout: float) -> None:
    """Until the code server answers (it serves once it has loaded the code location)."""
    from dagster._grpc.client import DagsterGrpcClient

    client = DagsterGrpcClient(port=srv.grpc_port, host=srv.host)
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        if srv.code_server.poll() is not None:
            raise RuntimeError(f"the code server exited with {srv.code_server.returncode}:\n{srv.logtail()}")
        try:
            client.ping("")
            return
        except Exception as exc:  # not serving yet
            last = exc
        time.sleep(0.5)
    raise RuntimeError(f"the code server did not answer in {timeout:.0f}s ({last!r}):\n{srv.logtail()}")


def start_dagster_production(location_file: str | os.PathLike[str], pg: Postgres, *, home: str | os.PathLike[str],
                             working_directory: str | os.PathLike[str], env: Mapping[str, str] | None = None,
                             database: str | None = None, daemon_interval_s: float | None = 2.0,
                             timeout: float = 240.0) -> DagsterProduction:
    """Start the code server (``location_file`` with ``env``), then the daemon and the
    webserver on a workspace that names the code server by host and port, and wait
    until the location is LOADED and the daemons a backfill needs are healthy.

    ``database``: created on ``pg`` for the instance's storage (default: a fresh name).
    ``daemon_interval_s``: the backfill daemon's wait between iterations, as
    ``start_dagster_dev`` paces it (``harness/pace``); ``None`` keeps Dagster's 30 s.

    The run launcher is Dagster's default: the daemon asks the code server to start
    each run, and the code server marks a run failed when its process dies (``kill -9``
    included), which run retries then re-run. This package's ``WarmRunLauncher`` forks
    runs from a fork server that the daemon starts on its own machine from the run's
    code origin: it bypasses the code server, and so the shape tested here."""
    home_path = Path(home).resolve()
    home_path.mkdir(parents=True, exist_ok=True)
    database = pg.create_database(database or f"dagster_{uuid.uuid4().hex[:12]}")
    (home_path / "dagster.yaml").write_text(yaml.safe_dump(production_dagster_yaml(pg, database), sort_keys=False))
    from dagster import DagsterInstance

    with DagsterInstance.from_config(str(home_path)):  # creates the schema once, before three processes race to
        pass
    host = "127.0.0.1"
    port, grpc_port = free_ports(2)
    workspace = home_path / "workspace.yaml"
    workspace.write_text(yaml.safe_dump({"load_from": [{"grpc_server": {
        "host": host, "port": grpc_port, "location_name": LOCATION_NAME}}]}, sort_keys=False))
    token = uuid.uuid4().hex
    base_env = {**os.environ, "DAGSTER_HOME": str(home_path), "PYTHONUNBUFFERED": "1", _TOKEN_VAR: token}
    srv = DagsterProduction(home_path, workspace, host, port, grpc_port, token)
    try:
        srv._start("code_server", [
            _entry_point("dagster"), "api", "grpc", "-h", host, "-p", str(grpc_port), "-f",
            str(Path(location_file).resolve()), "-d", str(Path(working_directory).resolve()),
            "--location-name", LOCATION_NAME], {**base_env, **(env or {})}, Path(working_directory))
        _wait_code_server(srv, timeout)
        daemon_env = dict(base_env)
        if daemon_interval_s is not None:
            pace = str(Path(__file__).resolve().parent / "pace")
            daemon_env["PYTHONPATH"] = os.pathsep.join(p for p in (pace, daemon_env.get("PYTHONPATH")) if p)
            daemon_env["HARNESS_DAEMON_INTERVAL_S"] = str(daemon_interval_s)
        srv._start("daemon", [_entry_point("dagster-daemon"), "run", "-w", str(workspace)], daemon_env, home_path)
        srv._start("webserver", [_entry_point("dagster-webserver"), "-w", str(workspace), "-h", host, "-p", str(port)],
                   base_env, home_path)
        wait_ready(srv, timeout, BACKFILL_DAEMONS)
    except BaseException:
        srv.stop()
        raise
    return srv


@contextmanager
def dagster_production(location_file: str | os.PathLike[str], pg: Postgres, **kwargs: Any) -> Iterator[DagsterProduction]:
    """``start_dagster_production`` as a context manager (stops every process on exit)."""
    srv = start_dagster_production(location_file, pg, **kwargs)
    try:
        yield srv
    finally:
        srv.stop()
