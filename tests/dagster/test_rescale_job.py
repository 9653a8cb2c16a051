"""``payments_rescale_job`` on a real DagsterInstance: it rewrites the state into 7
shards under the pipeline's run tag and lease, takes an epoch cut meanwhile along,
and the next epoch run uses the new layout."""

from __future__ import annotations

from dataclasses import replace

from dagster import AssetKey

from tests.helpers import assert_state_equal, log_records, reference_state
from volley_dagster import EpochRunner
from volley_dagster.checkpoint.epoch_log import epoch_key
from volley_dagster.demo.events import generate
from volley_dagster.demo.payments import local_tables, payments_deployment, payments_pipeline
from volley_dagster.settings import RunSettings
from volley_dagster.state.keys import ShardLayout

STATE = AssetKey(["payments", "state"])
KEYS = 300


def run_epochs(defs, instance, start: int, end: int):
    tags = {"dagster/asset_partition_range_start": epoch_key(start), "dagster/asset_partition_range_end": epoch_key(end)}
    return defs.resolve_job_def("payments_epochs_job").execute_in_process(instance=instance, tags=tags)


def rescale(defs, instance, shards: int, raise_on_error: bool = True):
    return defs.resolve_job_def("payments_rescale_job").execute_in_process(
        instance=instance, run_config={"ops": {"payments_rescale": {"config": {"num_shards": shards}}}},
        raise_on_error=raise_on_error,
    )


def test_rescale_job_then_epoch_run(location_for, tmp_path):
    defs, instance, base = location_for(replace(payments_deployment(tmp_path / "events"), max_wait_s=None))
    generate(base / "events", 2, 2_000, KEYS)
    runner = EpochRunner(payments_pipeline(base / "events", local_tables(base / "tables")), base / "state" / "payments", RunSettings(max_records_per_epoch=2_000))
    for _ in range(2):
        runner.cut_next()
    instance.add_dynamic_partitions("payments_epochs", [epoch_key(1), epoch_key(2)])
    assert run_epochs(defs, instance, 1, 2).success
    assert runner.layout() == ShardLayout(4)

    result = rescale(defs, instance, 7)
    assert result.success
    assert instance.get_run_by_id(result.run_id).tags["volley/pipeline"] == "payments"  # one run per pipeline at a time
    (observation,) = result.asset_observations_for_node("payments_rescale")
    assert observation.asset_key == STATE
    md = observation.metadata
    assert (md["shards"].value, md["previous_shards"].value, md["rescaled_epoch"].value, md["from_epoch"].value) == (7, 4, 2, 3)
    assert md["keys"].value == runner.read_state().num_rows and md["noop"].value is False
    assert runner.layout() == ShardLayout(7)
    assert_state_equal(runner.read_state(), reference_state(log_records(2, 2_000, KEYS))[runner.read_state().column_names])

    generate(base / "events", 1, 2_000, KEYS, first_file=2)
    runner.cut_next()  # the sensor keeps cutting: a rescale takes the cut epoch along
    assert rescale(defs, instance, 2).success
    assert runner.layout() == ShardLayout(2)

    instance.add_dynamic_partitions("payments_epochs", [epoch_key(3)])
    assert run_epochs(defs, instance, 3, 3).success
    assert len(runner.result(3).shards) == 2
    expected = reference_state(log_records(3, 2_000, KEYS))
    assert_state_equal(runner.read_state(), expected[runner.read_state().column_names])
