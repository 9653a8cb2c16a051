"""Kafka access shared by the source and the sink: one way to make a consumer that
reads by assignment (it never commits to its group), a topic's partitions and a
partition's watermarks, and polling in batches that gives up after a quiet spell.

librdkafka's ``consume(n, timeout)`` returns early only once ``n`` records arrived,
so it is called with a short timeout, in a loop.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["KafkaQuiet", "batches", "consumer", "partitions", "require_client", "watermarks"]

POLL_S = 0.05
METADATA_TIMEOUT_S = 15.0


class KafkaQuiet(Exception):
    """No record and no event for the whole quiet spell; the caller names what it waited for."""


def require_client(what: str) -> None:
    """Kafka's client is an optional extra: refuse at construction, naming how to get it."""
    import importlib.util

    from volley_dagster.errors import ConfigError

    if importlib.util.find_spec("confluent_kafka") is None:
        raise ConfigError(f"{what} needs Kafka's client, confluent-kafka, which is not installed: "
                          "pip install 'volley-dagster[kafka]'")


def consumer(bootstrap_servers: str, group_id: str, isolation_level: str = "read_committed",
             config: Mapping[str, Any] | None = None) -> Any:
    from confluent_kafka import Consumer

    return Consumer({"bootstrap.servers": bootstrap_servers, "group.id": group_id, "enable.auto.commit": False,
                     "enable.partition.eof": True, "isolation.level": isolation_level, **(config or {})})


def partitions(client: Any, topic: str) -> list[int] | None:
    """The topic's partition numbers, or None when the brokers do not know the topic."""
    meta = client.list_topics(topic, timeout=METADATA_TIMEOUT_S).topics.get(topic)
    if meta is None or meta.error is not None or not meta.partitions:
        return None
    return sorted(meta.partitions)


def watermarks(client: Any, topic: str, partition: int) -> tuple[int, int]:
    """(earliest offset held, end offset): under ``read_committed`` the end is the last stable offset."""
    from confluent_kafka import TopicPartition

    low, high = client.get_watermark_offsets(TopicPartition(topic, partition), timeout=METADATA_TIMEOUT_S,
                                             cached=False)
    return int(low), int(high)


def batches(client: Any, quiet_s: float) -> Iterator[list[Any]]:
    """Non-empty batches of messages (records and events such as end of partition),
    until the caller stops; ``KafkaQuiet`` after ``quiet_s`` without any."""
    deadline = time.monotonic() + quiet_s
    while True:
        batch = client.consume(10_000, timeout=POLL_S)
        if batch:
            deadline = time.monotonic() + quiet_s
            yield batch
        elif time.monotonic() > deadline:
            raise KafkaQuiet(f"no record for {quiet_s:.0f}s")
