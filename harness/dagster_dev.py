"""A real ``dagster dev`` for tests, and a small client for its GraphQL API.

``start_dagster_dev(workspace_yaml)`` runs ``python -m dagster dev -w <workspace.yaml>
-h 127.0.0.1 -p <free port>`` from this interpreter's environment, with a private
``DAGSTER_HOME`` (a temp dir holding the ``dagster.yaml`` you pass in), in its own
process group, logging to ``<home>/dagster-dev.log``. It returns once the webserver
answers GraphQL, every code location is LOADED and (by default) the daemons the
backfills need report healthy; otherwise it fails loudly with the log's tail.

    with dagster_dev("workspace.yaml", dagster_yaml="dagster.yaml") as server:
        gql = server.client
        backfill_id = gql.launch_partition_backfill(["pipe", "state"], ["0001", "0002"])
        result = gql.wait_backfill(backfill_id, timeout=180)
        assert result.succeeded, result
        gql.asset_materializations(["pipe", "state"])  # [{partition, metadata, ...}]

Facts measured with dagster 1.13.27 on this machine:
the backfill daemon ticks every 30 s (hard-coded) and a run launch costs ~5 s with the
in-process executor. A trivial backfill waits for one tick to submit its run and
another to notice it finished: ~58 s to COMPLETED_SUCCESS, 18-36 s with
``wait_backfill(..., until="runs")``; give ``wait_backfill`` a few minutes. ``dagster dev`` started from a non-interactive shell has
SIGINT (and hence its SIGTERM handling) ignored: we reset both to their defaults in
the child before exec, or it cannot be stopped short of SIGKILL.

Only the standard library and ``requests`` (a dagster dependency) are used, so the
module imports without Spark or the project's code."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Protocol, Sequence

import psutil
import requests

from harness.dagster_graphql import BACKFILL_DAEMONS, DEFAULT_DAGSTER_YAML, DagsterGraphQL, GraphQLError
from harness.processes import free_port, tail


def _reset_signals_and_detach() -> None:  # runs in the child between fork and exec
    # A non-interactive shell (or CI runner) may start us with SIGINT ignored; ignored
    # dispositions survive exec, and `dagster dev` then never stops on SIGINT/SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.setsid()  # own session and process group: stop() signals the whole tree


_TOKEN_VAR = "VOLLEY_TEST_DAGSTER_DEV"


def _pids_with_env(var: str, value: str) -> list[int]:
    """Processes whose environment has ``var=value``: with the per-server token set only
    in the server's environment, its descendants even if one left the process group."""
    pids = []
    for process in psutil.process_iter():
        if process.pid == os.getpid():
            continue
        try:
            if process.environ().get(var) == value:
                pids.append(process.pid)
        except psutil.Error:
            continue
    return pids


@dataclass
class DagsterDev:
    """A running ``dagster dev``; stop it with ``stop()`` (idempotent)."""

    proc: subprocess.Popen[bytes]
    host: str
    port: int
    home: Path
    log: Path
    workspace: Path
    token: str = ""
    started_seconds: float = 0.0
    _owns_home: bool = False
    _log_file: Any = None
    client: DagsterGraphQL = field(init=False)

    def __post_init__(self) -> None:
        self.client = DagsterGraphQL(self.url)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def logtail(self, lines: int = 60) -> str:
        return tail(self.log, lines)

    def instance(self) -> Any:
        """A ``DagsterInstance`` on the server's DAGSTER_HOME (the test's side of the
        same storage, e.g. for ``instance.add_dynamic_partitions``). Caller disposes."""
        from dagster import DagsterInstance

        return DagsterInstance.from_config(str(self.home))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def exited(self) -> str | None:
        """Why the server cannot come up any more (it exited), or None while it runs."""
        return None if self.alive() else f"exited with {self.proc.returncode}"

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the process group, wait, then SIGKILL it (and any straggler that still
        carries this server's token in its environment, e.g. a run worker or a JVM that
        started its own session)."""
        stop_process_groups([self.proc], self.token, timeout)
        if self._log_file is not None and not self._log_file.closed:
            self._log_file.close()
        if self._owns_home:
            shutil.rmtree(self.home, ignore_errors=True)

    def __enter__(self) -> "DagsterDev":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_process_groups(procs: Sequence[subprocess.Popen[bytes]], token: str, timeout: float) -> None:
    """SIGTERM each process's group, wait up to ``timeout``, then SIGKILL the groups and
    any straggler carrying ``token`` in its environment (a run worker, its Spark driver)."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    # a group leader may be gone while its children linger
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(_group_alive(p.pid) for p in procs):
        time.sleep(0.1)
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in _pids_with_env(_TOKEN_VAR, token):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for proc in procs:
        if proc.poll() is None:
            proc.wait(10)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def start_dagster_dev(workspace: str | os.PathLike[str], *,
                      dagster_yaml: str | os.PathLike[str] | None = None,
                      dagster_yaml_text: str | None = None,
                      home: str | os.PathLike[str] | None = None,
                      port: int | None = None,
                      env: Mapping[str, str] | None = None,
                      cwd: str | os.PathLike[str] | None = None,
                      wait_daemons: Sequence[str] = BACKFILL_DAEMONS,
                      timeout: float = 180.0,
                      keep_home: bool = False,
                      overrides: Mapping[str, Any] | None = None,
                      live_data_poll_rate_ms: int | None = 500,
                      daemon_interval_s: float | None = 2.0,
                      extra_args: Sequence[str] = ()) -> DagsterDev:
    """Start ``dagster dev -w workspace -h 127.0.0.1 -p <port>`` and wait until it is usable.

    ``dagster_yaml`` (a file, copied) or ``dagster_yaml_text`` becomes
    ``$DAGSTER_HOME/dagster.yaml`` (default: telemetry off). ``home`` defaults to a fresh
    temp dir, removed by ``stop()`` unless ``keep_home``; logs go to
    ``<home>/dagster-dev.log`` (pass ``home=tmp_path / "dagster_home"`` in pytest to keep
    them for post-mortems). ``cwd`` defaults to the workspace file's directory.
    ``wait_daemons``: daemon types that must report healthy before returning
    (``()`` to skip). ``overrides`` is deep-merged into that dagster.yaml, e.g.
    ``{"run_coordinator": {"config": {"dequeue_interval_seconds": 1}}}`` (the queued run
    coordinator otherwise waits up to 5 s before launching a queued run).
    ``live_data_poll_rate_ms``: how often the UI refreshes asset live data (dagster's
    default 2000 ms left lineage nodes showing "Loading…" for ~6 s after a navigation
    one time in two; 500 ms made it ~0.3 s). ``None`` keeps dagster's default.
    ``daemon_interval_s``: the backfill daemon's wait between iterations (dagster's is a
    fixed 30 s, which paced every backfill test; ``harness/pace/sitecustomize.py``).
    ``None`` keeps dagster's.
    """
    workspace = Path(workspace).resolve()
    if not workspace.is_file():
        raise FileNotFoundError(workspace)
    owns_home = home is None
    home_path = Path(tempfile.mkdtemp(prefix="dagster_home_")) if home is None else Path(home)
    home_path.mkdir(parents=True, exist_ok=True)
    home_path = home_path.resolve()
    if dagster_yaml is not None and dagster_yaml_text is not None:
        raise ValueError("pass dagster_yaml or dagster_yaml_text, not both")
    if dagster_yaml is not None:
        shutil.copyfile(dagster_yaml, home_path / "dagster.yaml")
    elif dagster_yaml_text is not None:
        (home_path / "dagster.yaml").write_text(dagster_yaml_text)
    elif not (home_path / "dagster.yaml").exists():
        (home_path / "dagster.yaml").write_text(DEFAULT_DAGSTER_YAML)
    if overrides:
        import yaml  # PyYAML: a dagster dependency

        config = yaml.safe_load((home_path / "dagster.yaml").read_text()) or {}
        (home_path / "dagster.yaml").write_text(yaml.safe_dump(_deep_merge(config, overrides), sort_keys=False))

    host = "127.0.0.1"
    port = port or free_port()
    log = home_path / "dagster-dev.log"
    token = uuid.uuid4().hex
    child_env = {**os.environ, **(env or {}), "DAGSTER_HOME": str(home_path), "PYTHONUNBUFFERED": "1",
                 _TOKEN_VAR: token}
    if daemon_interval_s is not None:
        pace = str(Path(__file__).resolve().parent / "pace")
        child_env["PYTHONPATH"] = os.pathsep.join(p for p in (pace, child_env.get("PYTHONPATH")) if p)
        child_env["HARNESS_DAEMON_INTERVAL_S"] = str(daemon_interval_s)
    cmd = [sys.executable, "-m", "dagster", "dev", "-w", str(workspace), "-h", host, "-p", str(port),
           *(["--live-data-poll-rate", str(live_data_poll_rate_ms)] if live_data_poll_rate_ms else []),
           *extra_args]
    log_file = open(log, "ab")
    log_file.write(f"$ {' '.join(cmd)}\n".encode())
    log_file.flush()
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=str(cwd or workspace.parent), env=child_env, stdin=subprocess.DEVNULL,
                            stdout=log_file, stderr=subprocess.STDOUT, preexec_fn=_reset_signals_and_detach)
    server = DagsterDev(proc=proc, host=host, port=port, home=home_path, log=log, workspace=workspace,
                        token=token, _owns_home=owns_home and not keep_home, _log_file=log_file)
    try:
        wait_ready(server, timeout, wait_daemons)
    except BaseException:
        server._owns_home = False  # keep the log for the post-mortem
        server.stop()
        raise
    server.started_seconds = time.monotonic() - t0
    return server


def _deep_merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


class Served(Protocol):
    """What ``wait_ready`` watches: a ``dagster dev``, or the separate processes of
    Dagster's production shape (``harness/dagster_production.py``)."""

    @property
    def url(self) -> str: ...
    @property
    def client(self) -> DagsterGraphQL: ...
    @property
    def log(self) -> Path: ...
    def exited(self) -> str | None: ...
    def logtail(self, lines: int = 60) -> str: ...


def wait_ready(server: Served, timeout: float, wait_daemons: Sequence[str]) -> None:
    """Until the webserver answers GraphQL, every code location is LOADED and the
    ``wait_daemons`` report healthy; fails loudly, with the log's tail, otherwise."""
    deadline = time.monotonic() + timeout
    stage, last = "webserver", "no answer yet"

    def fail(why: str) -> None:
        raise RuntimeError(f"dagster on {server.url}: {why} (stage: {stage}; last: {last}); "
                           f"log {server.log}:\n{server.logtail()}")

    while True:
        if (exited := server.exited()) is not None:
            fail(exited)
        if time.monotonic() > deadline:
            fail(f"not ready after {timeout:.0f}s")
        try:
            if stage == "webserver":
                requests.get(f"{server.url}/server_info", timeout=5).raise_for_status()
                stage = "locations"
            if stage == "locations":
                entries = server.client.location_entries()
                errors = server.client.location_errors()
                if errors:
                    fail("code location(s) failed to load:\n" + "\n".join(f"{k}: {v}" for k, v in errors.items()))
                statuses = {e["name"]: e["loadStatus"] for e in entries}
                last = f"locations {statuses}"
                if entries and all(s == "LOADED" for s in statuses.values()):
                    stage = "daemons"
            if stage == "daemons":
                if not wait_daemons:
                    return
                statuses = server.client.daemon_statuses()
                last = {k: v["healthy"] for k, v in statuses.items()}
                unhealthy = [d for d in wait_daemons if d in statuses and not statuses[d]["healthy"]]
                if not unhealthy:
                    return
        except (requests.RequestException, GraphQLError) as exc:
            last = repr(exc)[:500]
        time.sleep(0.25)


@contextmanager
def dagster_dev(workspace: str | os.PathLike[str], **kwargs: Any) -> Iterator[DagsterDev]:
    """``start_dagster_dev`` as a context manager (stops the server on exit)."""
    server = start_dagster_dev(workspace, **kwargs)
    try:
        yield server
    finally:
        server.stop()
