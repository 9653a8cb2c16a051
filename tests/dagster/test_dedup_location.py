"""A pipeline that deduplicates in the code location, on a real DagsterInstance: a
backfill over its epochs reports the duplicates (and late records) each epoch
dropped and where they are written, as the engine recorded them, and the state holds the aggregate of the
kept records."""

from __future__ import annotations

from dagster import AssetKey

from tests.dedup_reference import KEY, DedupReference, dedup_pipeline, write_dedup_log
from tests.ttl_reference import same_rows
from volley_dagster import EpochRunner
from volley_dagster.checkpoint.epoch_log import epoch_key
from volley_dagster.deploy import Deployment
from volley_dagster.settings import RunSettings

STATE = AssetKey(["dedup", "state"])


def test_each_epoch_reports_the_duplicates_it_dropped(location_for, tmp_path):
    deployment = Deployment("dedup", lambda tables: dedup_pipeline(tmp_path / "events", tmp_path / "out"))
    defs, instance, base = location_for(deployment)
    logs = write_dedup_log(base / "events", 3)
    runner = EpochRunner(deployment.build(None), base / "state" / "dedup", RunSettings(max_records_per_epoch=logs[0].num_rows))
    keys = [epoch_key(runner.cut_next().epoch) for _ in logs]
    instance.add_dynamic_partitions("dedup_epochs", keys)
    tags = {"dagster/asset_partition_range_start": keys[0], "dagster/asset_partition_range_end": keys[-1]}
    assert defs.resolve_job_def("dedup_epochs_job").execute_in_process(instance=instance, tags=tags).success

    events = instance.fetch_materializations(STATE, limit=10).records[::-1]
    assert [e.partition_key for e in events] == keys
    reference = DedupReference()
    verdicts = [reference.run(records) for records in logs]
    dropped = [len(d) - len(late) for _, d, late in verdicts]  # duplicates: the dropped records not late
    metadata = [e.asset_materialization.metadata for e in events]
    assert [m["duplicates"].value for m in metadata] == dropped
    assert [m["dedup_late"].value for m in metadata] == [len(late) for _, _, late in verdicts]
    assert [runner.result(epoch).figures["duplicates"] for epoch in range(1, 4)] == dropped and sum(dropped) > 0
    assert [m["duplicates_path"].value for m in metadata] == [runner.result(e).duplicates_path for e in range(1, 4)]
    same_rows(runner.read_state().to_pandas(), reference.current(), [KEY, "events", "total"])
