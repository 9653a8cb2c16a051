"""An S3 outage under a real ``dagster dev``, as a team running a pipeline meets it.

The test code location (``tests/ui/location.py``: the demo payments pipeline, its
sensor running, runs on the warm Spark) keeps every snapshot on a real S3 server
(SeaweedFS) too. Files land every few seconds. After the first epoch commits, the S3
server is stopped for a while (files keep landing), then started again on the same
data, address and credentials. Nobody touches the pipeline: ``run_outage`` waits for
every landed record to be committed and reports what happened. Used by
``tests/ui/test_outage.py`` (backoff scaled down) and ``bench/outage.py`` (the shipped
backoff, a 10-minute outage)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable

from dagster import DagsterRunStatus

from harness.dagster_dev import dagster_dev
from harness.seaweedfs import start_seaweedfs
from volley_dagster import EpochRunner
from volley_dagster.dagster.runs import pool_runs, run_in_flight
from volley_dagster.demo.events import generate
from volley_dagster.demo.payments import local_tables, payments_pipeline

ROOT = Path(__file__).resolve().parents[1]
WORKSPACE = ROOT / "tests" / "ui" / "workspace.yaml"
BUCKET = "volley-outage"
KEYS, PER_FILE = 200, 1_000


@dataclass(frozen=True)
class OutageReport:
    outage_s: float  # how long S3 was down
    files: int  # files landed in all
    failed_runs: int  # runs of the pipeline that failed while S3 was down
    runs_during: int  # runs of the pipeline created while S3 was down
    first_commit_after_s: float  # from S3 answering again to the first epoch committed after it
    all_committed_after_s: float  # from S3 answering again to every landed record committed
    epochs: int  # epochs committed in all
    human_actions: int = 0  # what anyone did to the pipeline: nothing

    def describe(self) -> str:
        return (f"S3 down {self.outage_s:.0f}s while {self.files} files landed; {self.failed_runs} of "
                f"{self.runs_during} runs failed during it; first epoch committed {self.first_commit_after_s:.1f}s "
                f"after S3 came back, every record {self.all_committed_after_s:.1f}s after; {self.epochs} epochs; "
                f"human actions: {self.human_actions}")


def runner_for(base: Path) -> EpochRunner:
    return EpochRunner(payments_pipeline(base / "events", local_tables(base / "tables")), base / "state" / "payments")


def _wait(predicate: Callable[[], object], timeout: float, what: str, srv) -> object:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{srv.logtail(60)}")
        time.sleep(0.2)
    return value


def run_outage(base: Path, *, land_every_s: float, backoff: str | None, outage_s: float | None = None,
               until_failed_runs: int | None = None, max_outage_s: float = 900.0, heal_within_s: float = 900.0,
               say: Callable[[str], None] = print) -> OutageReport:
    """``backoff``: ``first_s,max_s,retries_in_run`` or None for the shipped defaults. The
    outage lasts ``outage_s``, or until ``until_failed_runs`` runs failed (at most
    ``max_outage_s``)."""
    s3 = start_seaweedfs(base / "s3", bucket=BUCKET)
    env = {"VOLLEY_TEST_BASE": str(base), "VOLLEY_TEST_SENSOR": "1", "VOLLEY_TEST_WARM": "1",
           "VOLLEY_TEST_SNAPSHOT_STORE": f"s3://{BUCKET}/snapshots", "VOLLEY_TEST_S3_ENDPOINT": s3.s3.endpoint_url,
           "AWS_ACCESS_KEY_ID": s3.s3.access_key_id, "AWS_SECRET_ACCESS_KEY": s3.s3.secret_access_key,
           **({"VOLLEY_TEST_BACKOFF": backoff} if backoff else {})}
    runner = runner_for(base)
    landed = [0]
    stop_landing = threading.Event()

    def land() -> None:
        while not stop_landing.is_set():
            generate(base / "events", 1, PER_FILE, KEYS, first_file=landed[0])
            landed[0] += 1
            stop_landing.wait(land_every_s)

    try:
        with dagster_dev(WORKSPACE, dagster_yaml=ROOT / "dagster.yaml",
                         overrides={"run_coordinator": {"config": {"dequeue_interval_seconds": 1}}},
                         home=base / "dagster_home", env=env) as srv:
            generate(base / "events", 1, PER_FILE, KEYS, first_file=0)
            landed[0] = 1
            _wait(lambda: runner.committed_epoch() >= 1, 300, "the first epoch to commit", srv)
            lander = threading.Thread(target=land, daemon=True)
            lander.start()
            down_at = time.time()
            s3.stop(grace_s=0)
            say(f"S3 stopped at {datetime.fromtimestamp(down_at).isoformat(timespec='seconds')}")
            with srv.instance() as instance:
                def failed_since() -> int:
                    return len(pool_runs(instance, "payments", [DagsterRunStatus.FAILURE], created_after=down_at))

                while True:
                    elapsed, failed = time.time() - down_at, failed_since()
                    if outage_s is not None and elapsed >= outage_s:
                        break
                    if until_failed_runs is not None and failed >= until_failed_runs:
                        break
                    assert elapsed < max_outage_s, f"only {failed} runs failed in {elapsed:.0f}s of outage"
                    time.sleep(1)
                stop_landing.set()
                lander.join()
                s3.restart()
                up_at = time.time()
                failed = failed_since()
                during = len(pool_runs(instance, "payments", list(DagsterRunStatus), created_after=down_at))
                say(f"S3 back after {up_at - down_at:.0f}s; {failed} runs failed meanwhile; {landed[0]} files landed")
                _wait(lambda: runner.records_waiting() == 0 and runner.committed_epoch() == runner.log.last_cut(),
                      heal_within_s, "every landed record to commit after the outage", srv)
                done_at = time.time()
                _wait(lambda: run_in_flight(instance, "payments") is None, 120, "the last run to finish", srv)
            committed = runner.committed_epoch()
            commits = [datetime.fromisoformat(runner.result(e).committed_at).timestamp() for e in range(1, committed + 1)]
            first_after = min(t for t in commits if t >= up_at)
            return OutageReport(up_at - down_at, landed[0], failed, during, first_after - up_at, done_at - up_at,
                                committed)
    finally:
        stop_landing.set()
        s3.stop()
