"""The demo window deployment under Dagster: a range run commits epochs whose fired
windows land in the Delta table once, with the watermark and late records shown."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timezone

import pyarrow.compute as pc
import pyarrow.parquet as pq
from dagster import AssetKey
from deltalake import DeltaTable

from volley_dagster import EpochRunner
from volley_dagster.checkpoint.epoch_log import epoch_key
from volley_dagster.demo.events import generate
from volley_dagster.demo.payments import local_tables, merchant_minutes_deployment, merchant_minutes_pipeline
from volley_dagster.settings import RunSettings

STATE = AssetKey(["merchant_minutes", "state"])
MINUTES = AssetKey(["merchant_minutes", "delta_minutes"])


def test_window_epochs_as_partitions(location_for, tmp_path):
    defs, instance, base = location_for(replace(merchant_minutes_deployment(tmp_path / "events"), max_wait_s=None))
    files = generate(base / "events", 3, 2_000, 50, events_per_second=10, disorder_s=30)  # 200 s of events a file
    runner = EpochRunner(merchant_minutes_pipeline(base / "events", local_tables(base / "tables")), base / "state" / "merchant_minutes", RunSettings(max_records_per_epoch=2_000))
    for _ in files:
        runner.cut_next()
    instance.add_dynamic_partitions("merchant_minutes_epochs", [epoch_key(e) for e in (1, 2, 3)])
    job = defs.resolve_job_def("merchant_minutes_epochs_job")
    tags = {"dagster/asset_partition_range_start": epoch_key(1), "dagster/asset_partition_range_end": epoch_key(3)}
    assert job.execute_in_process(instance=instance, tags=tags).success

    state = {r.asset_materialization.partition: r.asset_materialization.metadata
             for r in instance.fetch_materializations(STATE, limit=10).records}
    minutes = {r.asset_materialization.partition: r.asset_materialization.metadata
               for r in instance.fetch_materializations(MINUTES, limit=10).records}
    events = [pq.read_table(base / "events" / f) for f in files]
    active = [t.filter(pc.equal(t.column("status"), "active")) for t in events]  # what the pipeline keeps
    for epoch in (1, 2, 3):
        latest = max(pc.max(t.column("event_time")).as_py() for t in active[:epoch])
        mark = datetime.fromtimestamp(state[epoch_key(epoch)]["watermark"].value, tz=timezone.utc)  # a timestamp
        assert (latest - mark).total_seconds() == 30  # max event time so far - 30 s out-of-orderness
        assert state[epoch_key(epoch)]["late_records"].value == runner.result(epoch).late_records
        assert minutes[epoch_key(epoch)]["dagster/partition_row_count"].value == state[epoch_key(epoch)]["records_out"].value > 0

    fired = DeltaTable(str(base / "tables" / "delta" / "merchant_minutes")).to_pyarrow_table()
    assert fired.num_rows == sum(m["dagster/partition_row_count"].value for m in minutes.values())
    assert fired.group_by(["merchant_id", "window_start"]).aggregate([]).num_rows == fired.num_rows  # each once
    late = sum(runner.result(e).late_records for e in (1, 2, 3))
    still_open = pc.sum(runner.read_state().column("events")).as_py()
    assert pc.sum(fired.column("events")).as_py() + still_open + late == sum(t.num_rows for t in active)  # no record lost or counted twice
