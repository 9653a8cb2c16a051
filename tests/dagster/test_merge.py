"""A team's own Dagster project adopts a pipeline: ``Definitions.merge`` of ours with a
project that has its own ``spark`` and ``io_manager`` resources and its own executor.
An epoch and a downstream asset of the team's, reading our Delta table through the
maintained ``dagster-deltalake`` resource, both materialize in the merged project."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pyarrow.compute as pc
from dagster import (
    AssetKey,
    ConfigurableResource,
    Definitions,
    FilesystemIOManager,
    asset,
    define_asset_job,
    in_process_executor,
    multiprocess_executor,
)
from dagster_deltalake import DeltaTableResource, LocalConfig

from tests.dagster.conftest import payments_cutting_at_3000
from tests.dagster.test_location import tick
from tests.helpers import log_records, reference_state
from volley_dagster.checkpoint.epoch_log import epoch_key
from volley_dagster.demo.events import generate

BALANCES = AssetKey(["payments", "delta_balances"])
KEYS = 300


class TeamSpark(ConfigurableResource):
    """The team's own resource under the key ``spark``, as ``dagster_pyspark`` would put one."""

    app_name: str = "team-analytics"


def test_a_project_with_its_own_spark_io_manager_and_executor_merges_ours_and_runs_both(location_for, tmp_path):
    ours, instance, base = location_for(replace(payments_cutting_at_3000(tmp_path), min_records=2_000))
    balances_uri = str(base / "tables" / "delta" / "merchant_balances")

    @asset(deps=[BALANCES], group_name="team")
    def merchant_report(spark: TeamSpark, balances: DeltaTableResource) -> dict:
        """The team's asset: reads our Delta table as a Dagster project reads any."""
        table = balances.load().to_pyarrow_table()
        return {"made_by": spark.app_name, "merchants": table.num_rows, "total": pc.sum(table.column("total")).as_py()}

    theirs = Definitions(
        assets=[merchant_report],
        jobs=[define_asset_job("team_report_job", selection=[merchant_report])],
        resources={"spark": TeamSpark(), "io_manager": FilesystemIOManager(base_dir=str(base / "team_io")),
                   "balances": DeltaTableResource(url=balances_uri, storage_options=LocalConfig())},
        executor=multiprocess_executor,
    )
    merged = Definitions.merge(ours, theirs)  # raised on the shared "spark" key and executor before

    assert merged.executor is multiprocess_executor  # the team's default stays theirs
    assert merged.resolve_job_def("payments_epochs_job").executor_def is in_process_executor
    assert {"spark", "io_manager", "volley_spark", "volley_checkpoints", "volley_tables"} <= set(merged.resources)

    generate(base / "events", 2, 1_000, KEYS)  # one epoch's worth (max_records_per_epoch 2,000)
    request = tick(merged, instance).run_requests[0]  # the sensor, from the merged definitions
    assert request.partition_key == epoch_key(1)
    epoch = merged.resolve_job_def("payments_epochs_job").execute_in_process(
        instance=instance, partition_key=epoch_key(1))
    assert epoch.success
    assert instance.get_latest_materialization_event(BALANCES).asset_materialization.partition == epoch_key(1)

    report = merged.resolve_job_def("team_report_job").execute_in_process(instance=instance)
    assert report.success
    with open(base / "team_io" / "merchant_report", "rb") as stored:  # through the team's own IO manager
        made = pickle.load(stored)
    expected = reference_state(log_records(2, 1_000, KEYS))
    assert made["made_by"] == "team-analytics" and made["merchants"] == len(expected)
    assert abs(made["total"] - expected["total"].sum()) < 1e-6 * abs(expected["total"].sum())
