"""The sensor and the schedule heal what fails and stop only for what cannot heal, on
a real DagsterInstance: an epoch whose runs fail transiently (the pipeline's lease
held by another process) is requested again, with a new run key each time, after an
exponential backoff with jitter, for as long as it fails, and the budget resets when
it commits; a permanent failure (the checkpoint root written by another pipeline)
stops the requests at once, naming the error, and fails the ``epochs_progress``
check; a schedule-only deployment re-runs a failed epoch as the sensor does."""

from __future__ import annotations

import json
import time
from contextlib import ExitStack
from dataclasses import replace

import pytest
from dagster import (
    AssetKey,
    DagsterInstance,
    DagsterRun,
    DagsterRunStatus,
    DynamicPartitionsDefinition,
    build_schedule_context,
)

from tests.dagster.conftest import ROOT
from tests.dagster.test_location import range_of, run_range, tick
from volley_dagster import EpochRunner
from volley_dagster.checkpoint.epoch_log import epoch_key
from volley_dagster.checkpoint.lease import PipelineLease
from volley_dagster.dagster.location import build_definitions
from volley_dagster.dagster.resources import CheckpointResource, SparkResource, TablesResource
from volley_dagster.dagster.runs import recovery_decision
from volley_dagster.demo.events import generate
from volley_dagster.demo.payments import local_tables, payments_deployment
from volley_dagster.recovery import Backoff

STATE = AssetKey(["payments", "state"])
# The first wait (0.95 s for this pipeline) is well above a tick's latency on a loaded machine.
BACKOFF = Backoff(first_s=1.5, max_s=3.0, alert_after=3, retries_in_run=1)


@pytest.fixture
def fast_backoff(tmp_path, spark):
    """A location whose backoff is scaled down and whose runs give up waiting for a held
    lease after 0.2 s; a schedule-only twin (cron, sensor stopped) over the same state."""
    import shutil

    with ExitStack() as stack:
        home = tmp_path / "dagster_home"
        home.mkdir()
        shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
        deployment = replace(payments_deployment(tmp_path / "events"), min_records=1, max_wait_s=None, backoff=BACKOFF,
                             cron="* * * * *")
        defs = build_definitions(
            [deployment],
            checkpoints=CheckpointResource(root=str(tmp_path / "state"), max_records_per_epoch=2_000, lease_wait_s=0.2),
            tables=TablesResource(warehouse=str(tmp_path / "tables")),
            spark=SparkResource(),
        )
        yield defs, stack.enter_context(DagsterInstance.from_config(str(home))), tmp_path


def run(defs, instance, request):
    return defs.resolve_job_def("payments_epochs_job").execute_in_process(
        instance=instance, partition_key=request.partition_key, tags=request.tags, raise_on_error=False)


def progress_checks(result) -> list:
    return [e for e in result.asset_events if getattr(e, "check_name", None) == "epochs_progress"]


def failure_of(result) -> str:
    return str([e for e in result.all_events if e.is_failure][0].event_specific_data.error)


def test_transient_failures_are_requested_again_with_backoff_until_the_epoch_commits(fast_backoff):
    defs, instance, base = fast_backoff
    generate(base / "events", 1, 1_500, 300)
    request = tick(defs, instance).run_requests[0]
    assert range_of(request) == (epoch_key(1), epoch_key(1))
    other = PipelineLease(base / "state" / "payments", owner="another process").acquire()  # every run finds it busy
    keys, delays, cursor = [request.run_key], [], None
    try:
        for failures in range(1, 4):
            result = run(defs, instance, request)
            assert not result.success and "PipelineBusyError" in failure_of(result)
            ended = time.time()
            waiting = tick(defs, instance, cursor)
            cursor = waiting.cursor
            assert not waiting.run_requests  # backing off: not at once
            message = waiting.skip_reason.skip_message
            assert f"epoch 1 failed in {failures} run(s) since the last commit" in message and "backing off" in message
            # each failure reported once, with the count: red from alert_after failures on; retries go on
            (reported,) = progress_checks(waiting)
            assert reported.passed == (failures < BACKOFF.alert_after) and "transient" in reported.description
            assert reported.metadata["failed_runs"].value == failures
            due = time.time()
            while not (again := tick(defs, instance, cursor)).run_requests:
                cursor = again.cursor
                assert not progress_checks(again)  # nothing new to say while it backs off
                assert time.time() - due < BACKOFF.max_s + 2, "the backoff never ended"
                time.sleep(0.1)
            cursor, request = again.cursor, again.run_requests[0]
            delays.append(time.time() - ended)
            keys.append(request.run_key)
            assert range_of(request) == (epoch_key(1), epoch_key(1))
    finally:
        other.release()
    assert len(set(keys)) == len(keys)  # a new run key each time: Dagster never dedupes a retry away
    # the k-th wait is min(max_s, first_s * 2**(k-1)) times a jitter in [0.5, 1] (plus a tick's slack)
    for k, delay in enumerate(delays, start=1):
        step = min(BACKOFF.max_s, BACKOFF.first_s * 2 ** (k - 1))
        assert 0.5 * step - 0.05 <= delay <= step + 0.6, (k, delays)
    assert run(defs, instance, request).success  # the other process let go: the epoch commits
    healed = tick(defs, instance, cursor)
    assert [c.passed for c in progress_checks(healed)] == [True]  # the check turns green again
    assert not healed.run_requests and "every cut epoch is committed" in healed.skip_reason.skip_message

    generate(base / "events", 1, 1_500, 300, first_file=1)  # the budget reset: a new failure waits the first step
    request = tick(defs, instance, healed.cursor).run_requests[0]
    with PipelineLease(base / "state" / "payments", owner="another process").acquire():
        failed = run(defs, instance, request)
    assert not failed.success
    # what a tick decides at the moment the run ended (deterministic, however slow the machine ticks)
    ended = instance.get_run_record_by_id(failed.run_id).end_time
    deployment = replace(payments_deployment(base / "events"), backoff=BACKOFF)
    runner = EpochRunner(deployment.build(local_tables(base / "tables")), base / "state" / "payments")
    decision = recovery_decision(instance, runner, deployment, ended)
    assert not decision.request and decision.failures == 1
    assert "epoch 2 failed in 1 run(s) since the last commit" in decision.reason and "backing off" in decision.reason
    assert decision.next_at == pytest.approx(ended + BACKOFF.delay_s(1, "payments"))


def test_a_canceled_run_is_requested_again_and_its_epoch_commits(fast_backoff):
    defs, instance, base = fast_backoff
    generate(base / "events", 1, 1_500, 300)
    first = tick(defs, instance)
    (request,) = first.run_requests
    canceled = instance.add_run(DagsterRun(  # what a cancel from the UI leaves of the sensor's run
        job_name="payments_epochs_job", status=DagsterRunStatus.CANCELED,
        tags={**request.tags, "dagster/partition": request.partition_key, "dagster/run_key": request.run_key}))
    cursor, deadline = first.cursor, time.time() + BACKOFF.first_s + 2
    while not (again := tick(defs, instance, cursor)).run_requests:  # after the first backoff step
        cursor = again.cursor
        assert "canceled" in again.skip_reason.skip_message and time.time() < deadline
        time.sleep(0.1)
    (retry,) = again.run_requests
    assert range_of(retry) == range_of(request) and retry.run_key != request.run_key
    committed = run(defs, instance, retry)
    assert committed.success  # nobody acted
    (progress,) = [e.asset_check_evaluation_data for e in committed.all_events
                   if e.event_type_value == "ASSET_CHECK_EVALUATION"
                   and e.asset_check_evaluation_data.check_name == "epochs_progress"]
    assert progress.passed and progress.metadata["canceled_runs"].value == 1
    assert f"before epoch 1 committed, 1 run(s) ended without committing it, 1 canceled (the newest " \
           f"{canceled.run_id})" in progress.description


def test_a_permanent_failure_stops_the_requests_at_once_and_names_the_error(fast_backoff):
    defs, instance, base = fast_backoff
    generate(base / "events", 1, 1_500, 300)
    first = tick(defs, instance)
    request = first.run_requests[0]
    layout = base / "state" / "payments" / "pipeline.json"
    # the checkpoint root was written by another pipeline: every run of epoch 1 fails, the source stays readable
    layout.write_text(json.dumps({"pipeline": "payments", "key_column": "card_id", "key_kind": "int", "aggregate": {},
                                  "layout": {"num_shards": 4, "num_key_groups": 256}}))
    result = run(defs, instance, request)
    error = failure_of(result)
    assert "StateLayoutError" in error and "different pipeline layout" in error
    assert not [e for e in result.all_events if e.event_type_value == "STEP_UP_FOR_RETRY"]  # not retried in the run
    stopped = tick(defs, instance, first.cursor)
    assert not stopped.run_requests
    message = stopped.skip_reason.skip_message
    assert f"stopped: epoch 1 failed permanently in run {result.run_id}: StateLayoutError" in message
    assert "launch a backfill of epochs 1..1" in message
    (progress,) = progress_checks(stopped)
    assert not progress.passed and "failed permanently" in progress.description
    time.sleep(BACKOFF.max_s + 0.5)  # no backoff ends a permanent stop
    later = tick(defs, instance, stopped.cursor)
    assert not later.run_requests and not progress_checks(later)  # reported once
    layout.unlink()  # a person fixes the cause and backfills: the pipeline goes on
    assert run_range(defs, instance, 1).success
    resumed = tick(defs, instance, later.cursor)
    assert [c.passed for c in progress_checks(resumed)] == [True]


def test_a_schedule_only_deployment_re_runs_a_failed_epoch(fast_backoff):
    defs, instance, base = fast_backoff
    clock = defs.resolve_schedule_def("payments_clock")

    def tick_clock():
        with build_schedule_context(instance=instance, resources=defs.resources,
                                    repository_def=defs.get_repository_def()) as ctx:
            return clock.evaluate_tick(ctx)

    generate(base / "events", 1, 1_500, 300)
    (request,) = tick_clock().run_requests
    assert range_of(request) == (epoch_key(1), epoch_key(1))
    with PipelineLease(base / "state" / "payments", owner="another process").acquire():
        assert not run(defs, instance, request).success
    generate(base / "events", 1, 1_500, 300, first_file=1)
    deadline = time.time() + BACKOFF.first_s + 2
    while not (data := tick_clock()).run_requests:  # epoch 2 is cut at once; 1..2 are requested after the backoff
        assert "backing off" in data.skip_message and time.time() < deadline
        time.sleep(0.2)
    (request,) = data.run_requests
    assert range_of(request) == (epoch_key(1), epoch_key(2))  # from the failed epoch, not only the newest
    assert run(defs, instance, request).success
    status = instance.get_status_by_partition(STATE, [epoch_key(1), epoch_key(2)], DynamicPartitionsDefinition(name="payments_epochs"))
    assert {k: v.value for k, v in status.items()} == {epoch_key(1): "MATERIALIZED", epoch_key(2): "MATERIALIZED"}
    assert "every cut epoch is committed" in tick_clock().skip_message

def test_a_range_run_that_fails_at_epoch_k_keeps_the_epochs_before_it(location):
    defs, instance, base = location
    generate(base / "events", 4, 2_000, 300)
    cut = tick(defs, instance)
    assert [range_of(r) for r in cut.run_requests] == [(epoch_key(1), epoch_key(3))]  # cut while 3,000+ wait: three epochs
    (base / "events" / "events-000002.parquet").unlink()  # epoch 3's file is lost before its run

    run = run_range(defs, instance, 1, 3)
    assert not run.success
    error = str([e for e in run.all_events if e.is_failure][0].event_specific_data.error)
    assert "SourceError: epoch 3: source file" in error and "is missing" in error
    keys = [epoch_key(e) for e in (1, 2, 3)]
    status = instance.get_status_by_partition(STATE, keys, DynamicPartitionsDefinition(name="payments_epochs"))
    assert {k: v.value for k, v in status.items()} == {epoch_key(1): "MATERIALIZED", epoch_key(2): "MATERIALIZED", epoch_key(3): "FAILED"}
    committed = [m.partition for m in (r.asset_materialization for r in
                 instance.fetch_materializations(STATE, limit=10, ascending=True).records)]
    assert committed == [epoch_key(1), epoch_key(2)]


def test_a_missing_source_folder_and_a_hand_broken_pipeline_json_are_named_not_crashes(fast_backoff):
    defs, instance, base = fast_backoff
    missing = tick(defs, instance)  # no events folder yet
    assert not missing.run_requests
    assert "cannot cut epochs of 'payments': SourceError: source directory" in missing.skip_reason.skip_message
    assert "does not exist" in missing.skip_reason.skip_message
    generate(base / "events", 1, 1_000, 300)
    first = tick(defs, instance, missing.cursor)
    assert run(defs, instance, first.run_requests[0]).success
    (base / "state" / "payments" / "pipeline.json").write_text('{"pipeline": "payments", "lay')  # cut short
    generate(base / "events", 1, 1_000, 300, first_file=1)
    request = tick(defs, instance, first.cursor).run_requests[0]
    failed = run(defs, instance, request)
    assert "StateLayoutError" in failure_of(failed) and "pipeline.json is not valid JSON" in failure_of(failed)
    stopped = tick(defs, instance, first.cursor).skip_reason.skip_message
    assert "failed permanently" in stopped and "pipeline.json is not valid JSON" in stopped
