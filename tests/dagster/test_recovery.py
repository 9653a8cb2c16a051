"""The sensor heals what fails and says when it cannot: on a real DagsterInstance,
an epoch whose runs keep failing is requested again, each time with a new run key,
a bounded number of times; then the tick says recovery is exhausted and the
``epochs_progress`` check fails naming the run to read."""

from __future__ import annotations

import json

from dagster import AssetKey, DynamicPartitionsDefinition

from assets.runs import MAX_RECOVERY_REQUESTS
from tests.dagster.test_location import key, range_of, run_range, tick
from volley_dagster.demo.events import generate

STATE = AssetKey(["payments", "state"])


def test_a_failing_epoch_is_requested_again_until_recovery_is_exhausted(location):
    defs, instance, base = location
    generate(base / "events", 2, 2_000, 300)
    first = tick(defs, instance)
    assert [range_of(r) for r in first.run_requests] == [(key(1), key(1))]
    # the checkpoint root was written by another pipeline: every run of epoch 1 fails, the source stays readable
    (base / "state" / "payments" / "pipeline.json").write_text(json.dumps(
        {"pipeline": "payments", "key_column": "card_id", "key_kind": "int", "aggregate": {},
         "layout": {"num_shards": 4, "num_key_groups": 256}}))

    cursor, keys = first.cursor, []
    request = first.run_requests[0]
    for attempt in range(MAX_RECOVERY_REQUESTS + 1):
        keys.append(request.run_key)
        job = defs.resolve_job_def("payments_epochs_job")
        run = job.execute_in_process(instance=instance, partition_key=request.partition_key, tags=request.tags,
                                     raise_on_error=False)
        assert not run.success
        error = str([e for e in run.all_events if e.is_failure][0].event_specific_data.error)
        assert "StateLayoutError" in error and "different pipeline layout" in error  # failed once, not retried in the run
        assert not [e for e in run.all_events if e.event_type_value == "STEP_UP_FOR_RETRY"]
        result = tick(defs, instance, cursor)
        cursor = result.cursor
        if attempt < MAX_RECOVERY_REQUESTS:
            assert [range_of(r) for r in result.run_requests] == [(key(1), key(1))]
            request = result.run_requests[0]
    assert len(set(keys)) == len(keys)  # a new run key each time: Dagster never dedupes a retry away

    assert not result.run_requests  # recovery is exhausted: the tick reports the epochs_progress check failed
    progress = [e for e in result.asset_events if getattr(e, "check_name", None) == "epochs_progress"]
    assert len(progress) == 1 and not progress[0].passed
    assert "recovery is exhausted" in progress[0].description and "epoch 1 (of 1 cut) is not committed" in progress[0].description
    exhausted = tick(defs, instance, cursor)
    assert not exhausted.run_requests
    assert not [e for e in exhausted.asset_events if getattr(e, "check_name", None) == "epochs_progress"]  # once
    assert "recovery exhausted: epoch 1 failed in" in exhausted.skip_reason.skip_message
    assert "backfill of epochs 1..1" in exhausted.skip_reason.skip_message


def test_a_range_run_that_fails_at_epoch_k_keeps_the_epochs_before_it(location):
    defs, instance, base = location
    generate(base / "events", 4, 2_000, 300)
    cut = tick(defs, instance)
    assert [range_of(r) for r in cut.run_requests] == [(key(1), key(3))]  # cut while 3,000+ wait: three epochs
    (base / "events" / "events-000002.parquet").unlink()  # epoch 3's file is lost before its run

    run = run_range(defs, instance, 1, 3)
    assert not run.success
    error = str([e for e in run.all_events if e.is_failure][0].event_specific_data.error)
    assert "SourceError: epoch 3: source file" in error and "is missing" in error
    keys = [key(e) for e in (1, 2, 3)]
    status = instance.get_status_by_partition(STATE, keys, DynamicPartitionsDefinition(name="payments_epochs"))
    assert {k: v.value for k, v in status.items()} == {key(1): "MATERIALIZED", key(2): "MATERIALIZED", key(3): "FAILED"}
    committed = [m.partition for m in (r.asset_materialization for r in
                 instance.fetch_materializations(STATE, limit=10, ascending=True).records)]
    assert committed == [key(1), key(2)]
