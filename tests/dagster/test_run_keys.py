"""A run the sensor requested ends without committing its epochs (canceled, or failed
any number of times), and the next request launches: Dagster's sensor daemon skips a
run key it already used, whatever became of that run, so a key that came back would
leave the epoch waiting for a new cut, forever at the end of a stream. On a real
DagsterInstance, each request submitted through the daemon's own functions
(``tests/dagster/daemon.py``); no Spark. The ``epochs_progress`` check says what
happened meanwhile."""

from __future__ import annotations

import shutil
from contextlib import ExitStack
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Iterator

import pytest
from dagster import AssetCheckEvaluation, DagsterInstance, DagsterRun, DagsterRunStatus

from tests.dagster.conftest import ROOT, build_location
from tests.dagster.daemon import SensorDaemon, sensor_daemon, tick_sensor
from tests.dagster.synthetic import write_history
from tests.dagster.test_location import range_of
from volley_dagster.checkpoint.epoch_log import epoch_key
from volley_dagster.dagster.epochs import epochs_job_name
from volley_dagster.dagster.runs import PIPELINE_TAG
from volley_dagster.demo.events import generate
from volley_dagster.demo.payments import payments_deployment


@pytest.fixture
def daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SensorDaemon]:
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
    generate(tmp_path / "events", 1, 500, 50)
    with DagsterInstance.from_config(str(home)) as instance, sensor_daemon(instance, tmp_path, monkeypatch) as daemon:
        yield daemon


def launched(daemon: SensorDaemon) -> DagsterRun:
    """The next tick's request of epoch 1, and the run the daemon creates for it."""
    (request,) = daemon.tick().run_requests or []
    assert range_of(request) == (epoch_key(1), epoch_key(1))
    run = daemon.submit(request)
    assert run is not None, f"the daemon skipped run key {request.run_key!r}: it was used already"
    return run


def fail(daemon: SensorDaemon, run: DagsterRun) -> None:
    """The run fails transiently, past Dagster's own run retries (else the sensor waits for those)."""
    daemon.instance.report_run_failed(run, "a transient failure")
    daemon.instance.add_run_tags(run.run_id, {"dagster/will_retry": "false"})


def progress_said(daemon: SensorDaemon, data) -> list[AssetCheckEvaluation]:
    return [e for e in data.asset_events if isinstance(e, AssetCheckEvaluation) and e.check_name == "epochs_progress"]


def test_a_canceled_run_is_requested_again_under_a_new_key(daemon: SensorDaemon) -> None:
    first = launched(daemon)
    daemon.instance.report_run_canceled(first)  # from the UI, or by a dagster/max_runtime limit
    after = daemon.tick()
    (request,) = after.run_requests or []
    assert request.run_key != first.tags["dagster/run_key"]
    again = daemon.submit(request)
    assert again is not None and again.status == DagsterRunStatus.NOT_STARTED
    (said,) = progress_said(daemon, after)  # what happened meanwhile: still green, naming the cancel
    assert said.passed and said.metadata["canceled_runs"].value == 1
    assert f"1 of those runs canceled, the newest {first.run_id}" in said.description
    assert "requested again" in said.description


def test_past_a_hundred_failures_each_request_still_launches(daemon: SensorDaemon) -> None:
    for _ in range(99):  # failed runs of epoch 1, as run retries would leave them
        daemon.instance.add_run(DagsterRun(job_name=epochs_job_name("payments"), status=DagsterRunStatus.FAILURE,
                                           tags={PIPELINE_TAG: "payments", "dagster/partition": epoch_key(1)}))
    keys = []
    for _ in range(3):  # the 100th, 101st and 102nd failures
        run = launched(daemon)
        keys.append(run.tags["dagster/run_key"])
        fail(daemon, run)
    assert len(set(keys)) == 3
    launched(daemon)  # and the request after the 102nd


def test_a_request_repeated_before_its_run_was_created_is_deduped(daemon: SensorDaemon) -> None:
    """The daemon restarted between the tick and the run's creation: the same key, one run."""
    (request,) = daemon.tick().run_requests or []
    daemon.cursor = None  # the tick's cursor was lost with it
    (repeated,) = daemon.tick().run_requests or []
    assert repeated.run_key == request.run_key
    assert daemon.submit(request) is not None
    assert daemon.submit(repeated) is not None  # the same NOT_STARTED run: Dagster launches it once
    assert len(daemon.instance.get_runs()) == 1


def test_a_range_run_canceled_after_committing_part_of_it_counts_for_the_rest(tmp_path: Path) -> None:
    """The run of epochs 1..3 committed epoch 1, then was canceled: it was created before
    that commit, yet it is what happened to epoch 2 (backoff, and the progress check)."""
    deployment = replace(payments_deployment(tmp_path / "events"), min_records=1, max_wait_s=None)
    (tmp_path / "events").mkdir()
    write_history(tmp_path / "state" / "payments", "payments", 1, 3,
                  committed_at=datetime.now(timezone.utc) - timedelta(minutes=1))
    with ExitStack() as stack:
        defs, instance, _ = build_location(deployment, tmp_path, stack)
        canceled = instance.add_run(DagsterRun(  # ended now: after epoch 1 committed
            job_name=epochs_job_name("payments"), status=DagsterRunStatus.CANCELED,
            tags={PIPELINE_TAG: "payments", "dagster/asset_partition_range_start": epoch_key(1),
                  "dagster/asset_partition_range_end": epoch_key(3)}))
        waiting = tick_sensor(defs, instance, "payments_new_data")
        assert not waiting.run_requests  # the first backoff step after it
        assert "epoch 2 failed in 1 run(s) since the last commit" in waiting.skip_reason.skip_message
        assert f"1 of those runs canceled, the newest {canceled.run_id}" in waiting.skip_reason.skip_message
        (said,) = [e for e in waiting.asset_events
                   if isinstance(e, AssetCheckEvaluation) and e.check_name == "epochs_progress"]
        assert said.passed and said.metadata["canceled_runs"].value == 1
