"""The code location on a real DagsterInstance: sensor-cut epochs, ordered
single-run backfills, the ordering guard, hand-made partition keys, asset checks."""

from __future__ import annotations

from dagster import AssetKey, DagsterInstance, build_sensor_context

from tests.helpers import assert_state_equal, log_records, reference_state
from volley_dagster.demo.events import generate

STATE = AssetKey(["payments", "state"])
DELTA = AssetKey(["payments", "delta_balances"])
ICEBERG = AssetKey(["payments", "iceberg_changes"])
KEYS = 300


def key(epoch: int) -> str:
    return f"{epoch:010d}"


def tick(defs, instance: DagsterInstance, cursor: str | None = None):
    with build_sensor_context(instance=instance, cursor=cursor, resources=defs.resources, definitions=defs) as ctx:
        result = defs.resolve_sensor_def("payments_new_data")(ctx)
    for req in result.dynamic_partitions_requests or []:
        instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))
    return result


def range_of(request) -> tuple[str, str]:
    """The epochs a sensor's run request covers."""
    if request.partition_key is not None:
        return request.partition_key, request.partition_key
    return request.tags["dagster/asset_partition_range_start"], request.tags["dagster/asset_partition_range_end"]


def run_range(defs, instance, start: int, end: int | None = None):
    """What a single-run backfill launches: one run over a partition range."""
    job = defs.resolve_job_def("payments_epochs_job")
    tags = {"dagster/asset_partition_range_start": key(start), "dagster/asset_partition_range_end": key(end or start)}
    return job.execute_in_process(instance=instance, tags=tags, raise_on_error=False)


def materializations(instance, asset: AssetKey) -> list[tuple[str, dict]]:
    records = instance.fetch_materializations(asset, limit=1000, ascending=True).records
    return [(r.asset_materialization.partition, r.asset_materialization.metadata) for r in records]


def test_sensor_backfill_order_guard_and_checks(location):
    defs, instance, base = location
    generate(base / "events", 1, 2_000, KEYS)
    first = tick(defs, instance)
    assert not first.run_requests  # 2,000 waiting < min_records 3,000

    generate(base / "events", 2, 2_000, KEYS, first_file=1)
    second = tick(defs, instance, first.cursor)
    assert [range_of(r) for r in second.run_requests] == [(key(1), key(2))]  # 6,000 -> 2,000 + 2,000, one run
    assert all(r.tags["volley/pipeline"] == "payments" for r in second.run_requests)
    assert instance.get_dynamic_partitions("payments_epochs") == [key(1), key(2)]

    # the run the daemon launches for it commits both epochs, in order
    assert run_range(defs, instance, 1, 2).success
    restarted = tick(defs, instance, second.cursor)  # a restarted daemon: same cursor, nothing repeats
    assert not restarted.run_requests and "every cut epoch is committed" in restarted.skip_reason.skip_message
    # a single-run backfill over 1..3 after epoch 3 was cut: 1 and 2 are no-ops, 3 commits
    generate(base / "events", 1, 2_000, KEYS, first_file=3)
    third = tick(defs, instance, restarted.cursor)
    assert [range_of(r) for r in third.run_requests] == [(key(3), key(3))]
    backfill = run_range(defs, instance, 1, 3)
    assert backfill.success
    state_events = materializations(instance, STATE)
    assert [p for p, _ in state_events[:2]] == [key(1), key(2)]  # one event per epoch, as it commits
    in_backfill = dict((p, m) for p, m in state_events[2:])
    assert {p: m["noop_already_committed"].value for p, m in in_backfill.items()} == {key(1): 1, key(2): 1, key(3): 0}
    messages = [e.user_message for e in instance.all_logs(backfill.run_id) if e.user_message.startswith("epoch ")]
    assert [m.split(":")[0] for m in messages] == [  # processed in ascending epoch order
        "epoch 1 was already committed", "epoch 2 was already committed", "epoch 3 committed"]
    last = in_backfill[key(3)]
    assert last["records_in"].value == 2_000 and last["epoch"].value == 3
    assert last["state_reads"].value == {"resident": last["shards"].value}  # epoch 2's mirror, from another run
    assert isinstance(last["seconds_total"].value, float)
    delta_md = dict(materializations(instance, DELTA))[key(3)]
    assert delta_md["delta_table_version"].value == 2 and delta_md["dagster/uri"].value.endswith("merchant_balances")
    iceberg_md = dict(materializations(instance, ICEBERG))[key(3)]
    assert iceberg_md["rows"].value > 0 and iceberg_md["dagster/table_name"].value == "payments.merchant_changes"
    assert [c.name for c in iceberg_md["dagster/column_schema"].schema.columns][:2] == ["merchant_id", "total"]

    expected = reference_state(log_records(3, 2_000, KEYS))  # epochs 1..3 hold the first 6,000 records
    from deltalake import DeltaTable

    delta = DeltaTable(str(base / "tables" / "delta" / "merchant_balances")).to_pyarrow_table()
    got = delta.select(["merchant_id", "total", "events", "avg_amount", "largest", "last_seen"])
    assert_state_equal(got, expected[["merchant_id", "total", "events", "avg_amount", "largest", "last_seen"]])

    # the guard: epoch 5 before epoch 4 fails naming epoch 4, and commits nothing
    generate(base / "events", 2, 2_000, KEYS, first_file=4)
    fourth = tick(defs, instance, third.cursor)
    assert [range_of(r) for r in fourth.run_requests] == [(key(4), key(5))]
    early = run_range(defs, instance, 5)
    assert not early.success
    failure = [e for e in early.all_events if e.is_failure]
    assert "needs epoch 4 committed first" in str(failure[0].event_specific_data.error)
    assert not (base / "state" / "payments" / "epochs" / key(5) / "manifest.json").exists()

    # a partition key added by hand, with no recorded offsets, is refused, not run empty
    instance.add_dynamic_partitions("payments_epochs", [key(42)])
    rogue = run_range(defs, instance, 42)
    assert not rogue.success
    assert "epoch 42 has no recorded offset range" in str([e for e in rogue.all_events if e.is_failure][0].event_specific_data.error)

    # asset checks over what committed: all pass; a corrupted snapshot is caught
    checks = defs.resolve_job_def("payments_checks_job").execute_in_process(instance=instance)
    results = {(e.asset_check_evaluation_data.asset_key, e.asset_check_evaluation_data.check_name):
               e.asset_check_evaluation_data.passed for e in checks.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"}
    assert len(results) == 8, results
    assert all(results.values()), results
    sst = next((base / "state" / "payments" / "snapshots" / key(3)).glob("shard-*/*.sst"))
    data = bytearray(sst.read_bytes())
    data[-1] ^= 1
    sst.write_bytes(bytes(data))
    checks = defs.resolve_job_def("payments_checks_job").execute_in_process(instance=instance, raise_on_error=False)
    failed = [e.asset_check_evaluation_data for e in checks.all_events
              if e.event_type_value == "ASSET_CHECK_EVALUATION" and not e.asset_check_evaluation_data.passed]
    assert [(f.asset_key, f.check_name) for f in failed] == [(STATE, "snapshot_checksums")]
