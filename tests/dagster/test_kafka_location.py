"""The code location over a Kafka topic (librdkafka's mock cluster): the sensor cuts
epochs of offset ranges and observes each partition's lag; a backfill of committed
epochs re-runs them as no-ops."""

from __future__ import annotations

import uuid

from dagster import AssetKey, AssetObservation

from tests.dagster.test_location import materializations, run_range, tick
from tests.helpers import assert_state_equal, log_records, reference_state
from volley_dagster import EpochRunner
from volley_dagster.demo.events import EVENT_SCHEMA
from volley_dagster.demo.kafka import produce_events
from volley_dagster.demo.payments import local_tables, payments_deployment
from volley_dagster.sources.kafka import KafkaSource

STATE = AssetKey(["payments", "state"])
COLUMNS = ["merchant_id", "total", "events", "avg_amount", "largest", "last_seen"]


def test_the_sensor_cuts_kafka_epochs_and_a_backfill_re_runs_them_as_no_ops(location_for, kafka, tmp_path):
    topic = f"payments-{uuid.uuid4().hex[:8]}"
    produce_events(kafka.bootstrap_servers, topic, 3, 1_000, 100)
    source = KafkaSource(topic, kafka.bootstrap_servers, EVENT_SCHEMA)
    defs, instance, base = location_for(payments_deployment(source))

    result = tick(defs, instance)
    (request,) = result.run_requests  # 3,000 offsets at 2,000 an epoch: epochs 1..2 in one run
    assert request.tags["dagster/asset_partition_range_start"] == "0000000001"
    assert request.tags["dagster/asset_partition_range_end"] == "0000000002"
    (observed,) = [e for e in result.asset_events if isinstance(e, AssetObservation)]
    lag = {k: v.value for k, v in observed.metadata.items() if k.startswith("records_waiting_partition_")}
    assert len(lag) == 4 and sum(lag.values()) == 0  # all cut: nothing waits in any partition
    assert observed.metadata["records_uncommitted"].value == 3_000

    assert run_range(defs, instance, 1, 2).success
    runner = EpochRunner(payments_deployment(source).build(local_tables(base / "tables")), base / "state" / "payments")
    assert runner.committed_epoch() == 2
    expected = reference_state(log_records(3, 1_000, 100))[COLUMNS]
    assert_state_equal(runner.read_state().select(COLUMNS), expected)

    assert run_range(defs, instance, 1, 2).success  # a backfill over committed epochs
    noops = [md["noop_already_committed"].value for _, md in materializations(instance, STATE)]
    assert noops == [False, False, True, True]
    assert not tick(defs, instance).run_requests  # nothing new on the topic: nothing to request
