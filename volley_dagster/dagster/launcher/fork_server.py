"""A fork server for run workers: one process per code location that has imported
Dagster, PySpark and the code location once, and forks a run worker for each run.

Dagster's code server spawns a fresh Python per run, which re-imports Dagster,
PySpark, PyIceberg and the definitions: about 2.5 s of every run on two cores, more
than a small epoch takes. A forked worker starts with all of that in memory.

    launcher (daemon) --connect--> fork server --fork--> monitor --fork--> run worker

The monitor waits for its worker and, if the worker dies before its run ended
(``kill -9``, OOM), marks the run failed at once, as the code server does for the
workers it spawns, so that run retries re-run it. The fork server listens on an
abstract Unix socket named after the code location and the Dagster home, so there is
one per deployment and nothing to clean up. It exits when the process that started
it exits, and refuses to fork once a source file of the code location changed
(its workers would run the old code): the launcher then starts a fresh one.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import signal
import socket
import struct
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, NoReturn

from volley_dagster.json_records import JsonObject

__all__ = ["ForkServerStale", "ForkServerUnavailable", "fork_run_worker", "server_address", "start_fork_server"]

ACCEPT_POLL_S = 1.0  # how often the server checks that its parent lives
REPLY_TIMEOUT_S = 10.0
# imported once by the server, for every worker: what a run imports beyond the definitions
PRELOAD = ("dagster._cli.api", "dagster._core.execution.api", "dagster._core.storage.runs.sqlite",
           "dagster._core.storage.event_log.sqlite", "pyspark.sql.connect.session", "pyspark.sql.connect.functions",
           "pyspark.sql.functions", "pyiceberg.catalog.sql", "deltalake", "pandas", "rocksdict")


class ForkServerUnavailable(Exception):
    """No fork server could take the run now; the launcher launches it the default way."""


class ForkServerStale(ForkServerUnavailable):
    """The fork server's code changed on disk since it loaded it; it has exited."""


def server_address(code_origin_json: str, dagster_home: str) -> str:
    """The abstract socket name of the fork server for this code location and home."""
    digest = hashlib.sha256(f"{dagster_home}\0{code_origin_json}".encode()).hexdigest()[:24]
    return f"\0volley-fork-server-{digest}"


def start_fork_server(address: str, job_origin_json: str, executable: str) -> None:
    """Start a fork server in the background (it preloads for a few seconds before it
    accepts). A second one for the same address exits at once: the socket is its lock."""
    import subprocess

    subprocess.Popen([executable, "-m", "volley_dagster.dagster.launcher.fork_server", "--address", address.lstrip("\0"),
                      "--job-origin", job_origin_json, "--parent", str(os.getpid())],
                     stdin=subprocess.DEVNULL, close_fds=True)


def fork_run_worker(address: str, run_id: str, instance_ref_json: str, repository_origin_json: str) -> tuple[int, int]:
    """Ask the fork server to start a worker for the run: (worker pid, server pid)."""
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.settimeout(REPLY_TIMEOUT_S)
    try:
        try:
            client.connect(address)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise ForkServerUnavailable("no fork server is listening") from exc
        try:
            client.sendall(json.dumps({"run_id": run_id, "instance_ref": instance_ref_json,
                                       "repository_origin": repository_origin_json}).encode() + b"\n")
        except BrokenPipeError:
            pass  # a server that closed early may still have answered (an older one said "stale" first)
        reply = _read_line(client)
    except OSError as exc:
        raise ForkServerUnavailable(f"the fork server did not answer: {exc}") from exc
    finally:
        client.close()
    if not reply:
        raise ForkServerUnavailable("the fork server closed the connection without an answer")
    answer = json.loads(reply)
    if "stale" in answer:
        raise ForkServerStale(answer["stale"])
    if "error" in answer:
        raise ForkServerUnavailable(answer["error"])
    return int(answer["pid"]), int(answer["server_pid"])


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    return data.strip()


class _ForkServer:
    def __init__(self, address: str, job_origin_json: str, parent: int) -> None:
        self.address = "\0" + address
        self.job_origin_json = job_origin_json
        self.parent = parent
        self.sources: dict[str, float] = {}
        self.repository_origin_json = ""

    def serve(self) -> int:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(self.address)  # the abstract name is the lock: one server per location and home
        except OSError:
            return 0
        began = time.monotonic()
        self._preload()
        listener.listen(64)
        listener.settimeout(ACCEPT_POLL_S)
        _log(f"ready in {time.monotonic() - began:.1f} s (pid {os.getpid()})")
        while os.getppid() == self.parent:
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            with conn:
                conn.settimeout(REPLY_TIMEOUT_S)
                if _peer_uid(conn) != os.getuid():  # an abstract socket has no file permissions to guard it
                    continue
                try:
                    request = json.loads(_read_line(conn))
                    run_id, instance_ref = str(request["run_id"]), str(request["instance_ref"])
                except (OSError, ValueError, KeyError, TypeError) as exc:  # a half-sent or foreign request
                    _log(f"ignored a malformed request: {exc!r}")
                    continue
                # read the whole request before refusing it: closing on a client still
                # sending breaks its pipe, and it would read "no answer" for "stale"
                changed = self._changed_source()
                if changed:
                    _reply(conn, {"stale": f"{changed} changed since the fork server loaded it; starting a new one"})
                    _log(f"{changed} changed: exiting, so that a new fork server loads the new code")
                    return 0
                if request.get("repository_origin") != self.repository_origin_json:
                    _reply(conn, {"error": "the run is of another code location than this fork server's"})
                    continue
                if os.fork() == 0:
                    listener.close()
                    _exit_with(functools.partial(_monitor, conn, run_id, instance_ref))
        _log("the process that started the fork server exited: stopping")
        return 0

    def _preload(self) -> None:
        import importlib

        from dagster._core.origin import JobPythonOrigin
        from dagster._serdes import deserialize_value, serialize_value
        from dagster._utils.hosted_user_process import recon_job_from_origin

        origin = deserialize_value(self.job_origin_json, JobPythonOrigin)
        self.repository_origin_json = serialize_value(origin.repository_origin)
        recon_job_from_origin(origin).get_definition()
        for module in PRELOAD:
            importlib.import_module(module)
        root = getattr(origin.repository_origin.code_pointer, "working_directory", None) or os.getcwd()
        self.sources = _module_files(Path(root).resolve())

    def _changed_source(self) -> str | None:
        for path, mtime in self.sources.items():
            try:
                if os.stat(path).st_mtime != mtime:
                    return path
            except OSError:
                return path
        return None


def _peer_uid(conn: socket.socket) -> int:
    pid_uid_gid = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", pid_uid_gid)[1])


def _module_files(root: Path) -> dict[str, float]:
    """The loaded modules that live under the code location's directory, with their
    modification times."""
    files: dict[str, float] = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if path and Path(path).resolve().is_relative_to(root) and "site-packages" not in path:
            files[path] = os.stat(path).st_mtime
    return files


def _exit_with(body: Callable[[], int]) -> NoReturn:
    """In a forked child: run ``body``, then exit with its code (1 if it raised), never
    returning into the fork server's loop."""
    code = 1
    try:
        code = body()
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _monitor(conn: socket.socket, run_id: str, instance_ref_json: str) -> int:
    """In the forked monitor: fork the worker, report its pid, wait for it, and mark
    its run failed if it died before the run ended."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of dagster dev is the worker's to handle
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    worker = os.fork()
    if worker == 0:
        conn.close()
        _exit_with(lambda: _work(run_id, instance_ref_json))
    _reply(conn, {"pid": worker, "server_pid": os.getppid()})
    conn.close()
    _, status = os.waitpid(worker, 0)
    exit_code = os.waitstatus_to_exitcode(status)
    if exit_code != 0:
        _fail_if_unfinished(run_id, instance_ref_json, exit_code)
    return 0


def _work(run_id: str, instance_ref_json: str) -> int:
    """In the forked worker: run the run, as ``dagster api execute_run`` does."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    from dagster import DagsterInstance
    from dagster._cli.api import _execute_run_command_body
    from dagster._core.instance.ref import InstanceRef
    from dagster._serdes import deserialize_value
    from dagster._utils.interrupts import capture_interrupts

    with capture_interrupts(), DagsterInstance.from_ref(deserialize_value(instance_ref_json, InstanceRef)) as instance:
        return _execute_run_command_body(run_id, instance, write_stream_fn=lambda _event: None,
                                         set_exit_code_on_failure=False)


def _fail_if_unfinished(run_id: str, instance_ref_json: str, exit_code: int) -> None:
    from dagster import DagsterInstance
    from dagster._core.instance.ref import InstanceRef
    from dagster._serdes import deserialize_value
    from dagster._utils import get_run_crash_explanation

    with DagsterInstance.from_ref(deserialize_value(instance_ref_json, InstanceRef)) as instance:
        run = instance.get_run_by_id(run_id)
        if run is None or run.is_finished:
            return
        message = get_run_crash_explanation(prefix=f"Run execution process for {run_id}", exit_code=exit_code)
        instance.report_engine_event(message, run)
        instance.report_run_failed(run)


def _reply(conn: socket.socket, answer: JsonObject) -> None:
    conn.sendall(json.dumps(answer).encode() + b"\n")


def _log(message: str) -> None:
    print(f"volley fork server: {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", required=True, help="abstract socket name, without the leading NUL")
    parser.add_argument("--job-origin", required=True, help="a run's serialized JobPythonOrigin")
    parser.add_argument("--parent", type=int, required=True, help="exit when this process exits")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # monitors are reaped by the kernel
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C of dagster dev: just go
    return _ForkServer(args.address, args.job_origin, args.parent).serve()


if __name__ == "__main__":
    sys.exit(main())
