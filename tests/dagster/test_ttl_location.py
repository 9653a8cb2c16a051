"""A pipeline with a state TTL in the code location, on a real DagsterInstance: a
backfill over its epochs reports the keys each epoch expired, as the engine recorded
them, and the upsert tables hold only the live keys."""

from __future__ import annotations

from dagster import AssetKey

from tests.ttl_reference import KEY, TtlReference, same_rows, ttl_pipeline, write_ttl_log
from volley_dagster import EpochRunner
from volley_dagster.checkpoint.epoch_log import epoch_key
from volley_dagster.deploy import Deployment
from volley_dagster.settings import RunSettings

STATE = AssetKey(["ttl", "state"])


def test_each_epoch_reports_the_keys_it_expired(location_for, tmp_path):
    deployment = Deployment("ttl", lambda tables: ttl_pipeline(tmp_path / "events", tmp_path / "out",
                                                               tables=tmp_path / "tables"))
    defs, instance, base = location_for(deployment)
    logs = write_ttl_log(base / "events", 4)
    runner = EpochRunner(deployment.build(None), base / "state" / "ttl", RunSettings(max_records_per_epoch=logs[0].num_rows))
    keys = [epoch_key(runner.cut_next().epoch) for _ in logs]
    instance.add_dynamic_partitions("ttl_epochs", keys)
    tags = {"dagster/asset_partition_range_start": keys[0], "dagster/asset_partition_range_end": keys[-1]}
    assert defs.resolve_job_def("ttl_epochs_job").execute_in_process(instance=instance, tags=tags).success

    events = instance.fetch_materializations(STATE, limit=10).records[::-1]
    assert [e.partition_key for e in events] == keys
    reference = TtlReference(ttl_epochs=2)
    expired = [int(reference.run(records)["expired"].sum()) for records in logs]
    assert [e.asset_materialization.metadata["keys_expired"].value for e in events] == expired
    assert [runner.result(epoch).figures["keys_expired"] for epoch in range(1, 5)] == expired and sum(expired) > 0
    same_rows(runner.pipeline.sinks[1].read().to_pandas(), reference.current(), [KEY, "events", "total"])
