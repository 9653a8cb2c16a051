"""The run launcher of ``./dev dagster``: runs start as workers forked from a fork
server that has everything imported (volley_dagster/dagster/launcher/fork_server.py), in a fraction of a
second; Dagster's default launcher spawns a Python per run that re-imports it all.

Anything the fork server cannot do (still starting, code changed, gone) falls back to
the default launcher through the code server, with an engine event that says why.
Runs of either kind are health-checked the same way, so run monitoring marks a run
failed when its worker is gone, and run retries re-run it.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Mapping
from typing import Any

from dagster import DagsterRun, DefaultRunLauncher
from dagster._core.launcher import CheckRunHealthResult, LaunchRunContext, WorkerStatus
from dagster._core.storage.tags import GRPC_INFO_TAG
from dagster._serdes import ConfigurableClassData, serialize_value
from typing_extensions import Self

from volley_dagster.dagster.launcher.fork_server import (
    ForkServerStale,
    ForkServerUnavailable,
    fork_run_worker,
    server_address,
    start_fork_server,
)
from volley_dagster.dagster.launcher.workers import run_worker_pid, worker_gone

FORK_SERVER_TAG = "volley/fork_server"  # on runs started by a fork server: its pid
RESTART_AFTER_S = 30.0  # a fork server started this long ago and still not answering is started again
FIRST_START_WAIT_S = 20.0  # how long a run waits for the fork server it started (it loads in about 3 s)


class WarmRunLauncher(DefaultRunLauncher):
    """Launches each run as a worker forked from the code location's fork server."""

    def __init__(self, inst_data: ConfigurableClassData | None = None) -> None:
        super().__init__(inst_data=inst_data)
        self._started: dict[str, float] = {}  # fork server address -> when this launcher started one

    @classmethod
    def from_config_value(cls, inst_data: ConfigurableClassData, config_value: Mapping[str, Any]) -> Self:
        return cls(inst_data=inst_data)

    def launch_run(self, context: LaunchRunContext) -> None:
        run = context.dagster_run
        began = time.monotonic()
        try:
            pid, server_pid = self._fork(run)
        except ForkServerUnavailable as exc:
            self._instance.report_engine_event(f"Launching through the code server: the fork server is not ready ({exc}).",
                                               run, cls=type(self))
            super().launch_run(context)
            return
        self._instance.add_run_tags(run.run_id, {FORK_SERVER_TAG: str(server_pid)})
        self._instance.report_engine_event(
            f"Forked run worker {pid} from the fork server {server_pid} in {time.monotonic() - began:.2f} s.",
            run, cls=type(self))

    def _fork(self, run: DagsterRun) -> tuple[int, int]:
        if not sys.platform.startswith("linux"):
            raise ForkServerUnavailable("the fork server needs Linux (an abstract Unix socket, SO_PEERCRED)")
        origin = run.job_code_origin
        if origin is None:
            raise ForkServerUnavailable("the run has no code origin")
        repository = serialize_value(origin.repository_origin)
        address = server_address(repository, str(self._instance.root_directory))
        instance_ref = serialize_value(self._instance.get_ref())
        try:
            return fork_run_worker(address, run.run_id, instance_ref, repository)
        except ForkServerStale:
            pass
        except ForkServerUnavailable:
            started = self._started.get(address)
            if started is not None and time.monotonic() - started < RESTART_AFTER_S:
                raise  # still loading: this run goes the default way
        # None yet, or it exited (code changed, dagster dev restarted): start one and wait
        # for it, rather than spawn a Python for this run that imports the same modules
        self._started[address] = time.monotonic()
        start_fork_server(address, serialize_value(origin), origin.executable_path)
        deadline = time.monotonic() + FIRST_START_WAIT_S
        while True:
            try:
                return fork_run_worker(address, run.run_id, instance_ref, repository)
            except ForkServerUnavailable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def terminate(self, run_id: str) -> bool:
        run = self._instance.get_run_by_id(run_id)
        if run is None or run.is_finished or FORK_SERVER_TAG not in run.tags or GRPC_INFO_TAG in run.tags:
            return super().terminate(run_id)
        pid = run_worker_pid(self._instance, run_id)
        self._instance.report_run_canceling(run)
        if pid is None:
            return False
        try:
            os.kill(pid, signal.SIGTERM)  # Dagster's handler turns it into an interrupt of the run
        except ProcessLookupError:
            return False
        return True

    @property
    def supports_check_run_worker_health(self) -> bool:
        return True

    def check_run_worker_health(self, run: DagsterRun) -> CheckRunHealthResult:
        record = self._instance.get_run_record_by_id(run.run_id)
        why = worker_gone(self._instance, record) if record is not None else None
        if why is not None:
            return CheckRunHealthResult(WorkerStatus.FAILED, why)
        return CheckRunHealthResult(WorkerStatus.RUNNING)
