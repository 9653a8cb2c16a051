"""Demo events on a Kafka topic: the same payment events as the file demo, as JSON
values keyed by merchant, so each merchant's events keep their order in one partition."""

from __future__ import annotations

import json
from typing import Any

from volley_dagster.demo.events import events_for_file

__all__ = ["produce_events"]


def produce_events(bootstrap_servers: str, topic: str, batches: int, records_per_batch: int, keys: int, *,
                   first_batch: int = 0, seed: int = 7, transactional_id: str | None = None,
                   config: dict[str, Any] | None = None) -> int:
    """Produce ``batches`` batches of events (batch ``i`` holds ``events_for_file(i, ...)``,
    the records file ``i`` of ``generate`` holds); with ``transactional_id``, each batch
    is one transaction. Returns the number produced."""
    from confluent_kafka import Producer

    settings = {"bootstrap.servers": bootstrap_servers, "linger.ms": 5, "enable.idempotence": True, **(config or {})}
    if transactional_id:
        settings["transactional.id"] = transactional_id
    producer = Producer(settings)
    if transactional_id:
        producer.init_transactions(30)
    produced = 0
    for i in range(first_batch, first_batch + batches):
        if transactional_id:
            producer.begin_transaction()
        for row in events_for_file(i, records_per_batch, keys, seed).to_pylist():  # demo data only
            value = json.dumps({**row, "event_time": row["event_time"].isoformat()}).encode()
            producer.produce(topic, key=str(row["merchant_id"]).encode(), value=value)
            producer.poll(0)
            produced += 1
        if transactional_id:
            producer.commit_transaction(30)
    if producer.flush(30):
        raise RuntimeError(f"could not deliver every event to {topic!r} at {bootstrap_servers}")
    return produced
