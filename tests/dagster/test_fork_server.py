"""The warm run launcher (volley_dagster/dagster/launcher/): runs start as workers forked from a fork server,
on a real DagsterInstance and real processes, without Spark. A worker killed with
``kill -9`` fails its run at once; a changed source file retires the fork server."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import textwrap
import time
from pathlib import Path

import pytest
from dagster import DagsterEventType, DagsterInstance, DagsterRunStatus
from dagster._core.definitions.reconstruct import ReconstructableRepository
from dagster._core.launcher import LaunchRunContext, WorkerStatus
from dagster._serdes import serialize_value

from volley_dagster.dagster.launcher import WarmRunLauncher
from volley_dagster.dagster.launcher.fork_server import (
    ForkServerStale,
    ForkServerUnavailable,
    fork_run_worker,
    server_address,
)
from volley_dagster.dagster.launcher.run_launcher import FORK_SERVER_TAG
from volley_dagster.dagster.launcher.workers import run_worker_pid

JOBS = textwrap.dedent('''
    import os, time
    from dagster import Definitions, in_process_executor, job, op

    @op
    def record_pid(context):
        context.log.info(f"worker pid {os.getpid()}")

    @op
    def wait_a_minute():
        time.sleep(60)

    @job
    def quick():
        record_pid()

    # in one process, as the volley location runs its jobs (volley_dagster/dagster/location.py): Dagster's
    # multiprocess executor loses a termination that arrives while it is starting a
    # step's subprocess, which runs on to its end (upstream, whichever launcher)
    @job(executor_def=in_process_executor)
    def slow():
        wait_a_minute()

    defs = Definitions(jobs=[quick, slow])
''')


@pytest.fixture
def instance(tmp_path: Path):
    (tmp_path / "code").mkdir()
    (tmp_path / "home").mkdir()
    (tmp_path / "code" / "jobs.py").write_text(JOBS)
    with DagsterInstance.local_temp(str(tmp_path / "home"), overrides={
            "run_launcher": {"module": "volley_dagster.dagster.launcher", "class": "WarmRunLauncher"}}) as inst:
        yield inst
        for server in {run.tags.get(FORK_SERVER_TAG) for run in inst.get_runs()} - {None}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(server), signal.SIGTERM)  # it would stop with this process anyway


def launch(instance: DagsterInstance, tmp_path: Path, job_name: str):
    repo = ReconstructableRepository.for_file(str(tmp_path / "code" / "jobs.py"), "defs",
                                              working_directory=str(tmp_path / "code"))
    recon = repo.get_reconstructable_job(job_name)
    run = instance.create_run_for_job(job_def=recon.get_definition(), job_code_origin=recon.get_python_origin())
    instance.run_launcher.launch_run(LaunchRunContext(dagster_run=run, workspace=None))
    return run.run_id


def wait_for(predicate, timeout: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def finished(instance: DagsterInstance, run_id: str):
    run = instance.get_run_by_id(run_id)
    return run if run is not None and run.is_finished else None


def engine_messages(instance: DagsterInstance, run_id: str) -> list[str]:
    return [e.message or "" for e in instance.all_logs(run_id, of_type=DagsterEventType.ENGINE_EVENT)]


def test_runs_are_forked_from_one_fork_server(instance, tmp_path):
    assert isinstance(instance.run_launcher, WarmRunLauncher)
    first = launch(instance, tmp_path, "quick")
    second = launch(instance, tmp_path, "quick")
    runs = [wait_for(lambda r=r: finished(instance, r), what=f"run {r}") for r in (first, second)]
    assert [run.status for run in runs] == [DagsterRunStatus.SUCCESS] * 2
    servers = {run.tags[FORK_SERVER_TAG] for run in runs}
    assert len(servers) == 1, servers  # the second run found the first one's server
    workers = {run_worker_pid(instance, run.run_id) for run in runs}
    assert len(workers) == 2 and os.getpid() not in workers
    for run in runs:
        assert any("Forked run worker" in m for m in engine_messages(instance, run.run_id))


def test_a_killed_worker_fails_its_run_at_once_and_its_health_says_so(instance, tmp_path):
    run_id = launch(instance, tmp_path, "slow")
    pid = wait_for(lambda: run_worker_pid(instance, run_id), what="the worker's pid")
    wait_for(lambda: instance.get_run_by_id(run_id).status == DagsterRunStatus.STARTED, what="the run to start")
    assert instance.run_launcher.check_run_worker_health(instance.get_run_by_id(run_id)).status == WorkerStatus.RUNNING
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    run = wait_for(lambda: finished(instance, run_id), timeout=30, what="the run to be marked failed")
    assert run.status == DagsterRunStatus.FAILURE and time.monotonic() - killed < 20  # no daemon here: the launcher saw it
    assert any(f"Run execution process for {run_id}" in m and "signal" in m.lower()
               for m in engine_messages(instance, run_id)), engine_messages(instance, run_id)
    health = instance.run_launcher.check_run_worker_health(run)
    assert health.status == WorkerStatus.FAILED and str(pid) in (health.msg or "")


def test_terminating_a_forked_run_cancels_it(instance, tmp_path):
    run_id = launch(instance, tmp_path, "slow")
    wait_for(lambda: instance.get_run_by_id(run_id).status == DagsterRunStatus.STARTED, what="the run to start")
    assert instance.run_launcher.terminate(run_id)
    run = wait_for(lambda: finished(instance, run_id), timeout=30, what="the run to end")
    assert run.status == DagsterRunStatus.CANCELED


def test_a_changed_source_file_retires_the_fork_server(instance, tmp_path):
    first_id = launch(instance, tmp_path, "quick")
    first = wait_for(lambda: finished(instance, first_id), what="the first run")
    (tmp_path / "code" / "jobs.py").write_text(JOBS.replace("worker pid", "worker process"))
    second_id = launch(instance, tmp_path, "quick")
    second = wait_for(lambda: finished(instance, second_id), what="the second run")
    assert first.status == second.status == DagsterRunStatus.SUCCESS
    assert first.tags[FORK_SERVER_TAG] != second.tags[FORK_SERVER_TAG]  # a new server, with the new code
    logs = [e.message or "" for e in instance.all_logs(second.run_id)]
    assert any("worker process" in m for m in logs), logs


def test_a_retiring_fork_server_says_stale_even_to_a_request_larger_than_the_socket_buffer(instance, tmp_path):
    # a server that answered "stale" before reading the request closed on a client still
    # sending: its broken pipe read as "no answer", and the run went to the code server
    run_id = launch(instance, tmp_path, "quick")
    run = wait_for(lambda: finished(instance, run_id), what="a first run")
    repository = serialize_value(run.job_code_origin.repository_origin)
    address = server_address(repository, str(instance.root_directory))
    (tmp_path / "code" / "jobs.py").write_text(JOBS.replace("worker pid", "worker process"))
    with pytest.raises(ForkServerStale, match="jobs.py changed"):
        fork_run_worker(address, run.run_id, serialize_value(instance.get_ref()) + " " * 4_000_000, repository)


def test_the_fork_server_runs_only_its_own_code_location(instance, tmp_path):
    run_id = launch(instance, tmp_path, "quick")
    run = wait_for(lambda: finished(instance, run_id), what="a first run")
    origin = run.job_code_origin
    repository = serialize_value(origin.repository_origin)
    address = server_address(repository, str(instance.root_directory))
    other = serialize_value(origin.repository_origin._replace(executable_path="/usr/bin/python3"))
    with pytest.raises(ForkServerUnavailable, match="another code location"):
        fork_run_worker(address, run.run_id, serialize_value(instance.get_ref()), other)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as garbage:  # a malformed request is ignored
        garbage.connect(address)
        garbage.sendall(b"not json\n")
        assert garbage.recv(100) == b""
    again = launch(instance, tmp_path, "quick")  # the same fork server still serves
    assert wait_for(lambda: finished(instance, again), what="a run after it").tags[FORK_SERVER_TAG] == \
        run.tags[FORK_SERVER_TAG]
