"""A team's asset takes our Delta table as an input (``AssetIn``), loaded by the
maintained ``dagster-deltalake`` IO manager: partitioned by the same epochs, each of
its partitions reads exactly the rows that epoch wrote (the sink's ``epoch_column``
is the IO manager's ``partition_expr``; the table lives at ``<root>/<pipeline>/<asset>``,
the IO manager's own path convention)."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
from dagster import AssetIn, AssetKey, Definitions, FilesystemIOManager, asset, define_asset_job
from dagster_deltalake import DeltaLakePyarrowIOManager, LocalConfig
from deltalake import DeltaTable

from tests.dagster.conftest import build_location
from tests.dagster.test_location import tick
from volley_dagster import DeltaSink, FileLog, Pipeline, count, sum_
from volley_dagster.checkpoint.epoch_log import epoch_key
from volley_dagster.dagster.epochs import epochs_partitions, make_runner
from volley_dagster.demo.events import generate
from volley_dagster.deploy import Deployment, TableSettings

CHANGES = AssetKey(["payments", "delta_changes"])


def changes_pipeline(events: Path, tables: TableSettings) -> Pipeline:
    """Each epoch's changed totals appended to a Delta table named as the IO manager names it."""
    return (
        Pipeline("payments").source(FileLog(events)).where("status = 'active'").key_by("merchant_id")
        .aggregate(total=sum_("amount"), events=count())
        .sink(DeltaSink(f"{tables.warehouse}/payments/delta_changes", name="changes", epoch_column="epoch"))
    )


def test_a_partitioned_team_asset_reads_each_epochs_rows_through_the_delta_io_manager(spark, tmp_path):
    deployment = Deployment(name="payments", build=lambda tables: changes_pipeline(tmp_path / "events", tables),
                            min_records=1)

    @asset(partitions_def=epochs_partitions(deployment), group_name="team",
           ins={"changes": AssetIn(key=CHANGES, input_manager_key="delta_reader")})
    def epoch_summary(changes: pa.Table) -> dict:
        """The team's per-epoch asset: what one epoch changed."""
        return {"rows": changes.num_rows, "epochs": pc.unique(changes.column("epoch")).to_pylist(),
                "total": pc.sum(changes.column("total")).as_py()}

    with ExitStack() as stack:
        ours, instance, base = build_location(deployment, tmp_path, stack)
        reader = DeltaLakePyarrowIOManager(root_uri=str(base / "tables"), storage_options=LocalConfig())
        theirs = Definitions(assets=[epoch_summary], jobs=[define_asset_job("team_summary_job", [epoch_summary])],
                             resources={"delta_reader": reader,
                                        "io_manager": FilesystemIOManager(base_dir=str(base / "team_io"))})
        merged = Definitions.merge(ours, theirs)
        assert merged.resolve_asset_graph().get(CHANGES).metadata["partition_expr"] == "epoch"
        for file in range(2):  # a file lands, the sensor cuts it: two epochs
            generate(base / "events", 1, 1_000, 100, first_file=file)
            tick(merged, instance)
        assert merged.resolve_job_def("payments_epochs_job").execute_in_process(
            instance=instance, tags={"dagster/asset_partition_range_start": epoch_key(1),
                                     "dagster/asset_partition_range_end": epoch_key(2)}).success
        runner = make_runner(deployment, ours.resources["volley_checkpoints"], ours.resources["volley_tables"])
        table = DeltaTable(str(base / "tables" / "payments" / "delta_changes")).to_pyarrow_table()
        for epoch in range(1, runner.committed_epoch() + 1):
            run = merged.resolve_job_def("team_summary_job").execute_in_process(instance=instance,
                                                                               partition_key=epoch_key(epoch))
            summary = run.output_for_node("epoch_summary")
            written = table.filter(pc.equal(table.column("epoch"), epoch_key(epoch)))
            assert summary["epochs"] == [epoch_key(epoch)]
            assert summary["rows"] == runner.result(epoch).records_out == written.num_rows > 0
            assert abs(summary["total"] - pc.sum(written.column("total")).as_py()) < 1e-9
        assert runner.committed_epoch() == 2
