"""An epoch's output as records on a Kafka topic, exactly once: one transaction per
epoch, under ``transactional.id`` ``<pipeline>/<sink>``, so that starting the next
attempt fences a zombie one at the broker (its transaction is aborted).

Each record carries the headers ``volley.pipeline`` and ``volley.epoch`` (and the
rest of the commit's mark); the transaction ends with one marker record on
partition 0 that holds the whole mark and the epoch's row count. Whether an epoch is
already in is read from the topic itself, as every sink does: the newest committed
marker of the pipeline, read back under ``read_committed``. Readers of the topic
should read under ``read_committed`` too, and skip records with the
``volley.marker`` header.

Values are the output rows as JSON objects; keys are the key columns as JSON.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

import pyarrow as pa

from volley_dagster.errors import ConfigError, SinkCommitError
from volley_dagster.io import kafka
from volley_dagster.sinks.base import CommitContext, Sink, SinkCommitResult, SinkLocation, commit_tags
from volley_dagster.sinks.lineage import ForeignLineage, SinkCommit, SinkMark, check_choice

__all__ = ["KafkaSink"]

MARKER = "volley.marker"
MARKER_PARTITION = 0
SCAN_BACK = 1_000  # offsets of partition 0 looked at per step, newest first, for the last marker
TIMEOUT_S = 30.0


class KafkaSink(Sink):
    """``KafkaSink("merchant-totals", bootstrap_servers="broker:9092")``."""

    def __init__(self, topic: str, bootstrap_servers: str, name: str = "kafka", *,
                 key_columns: tuple[str, ...] | None = None, on_foreign_lineage: ForeignLineage = "fail",
                 config: Mapping[str, Any] | None = None) -> None:
        self.topic = topic
        self.bootstrap_servers = bootstrap_servers
        self.name = name
        self.key_columns = key_columns
        self.on_foreign_lineage = check_choice(name, on_foreign_lineage)
        if self.on_foreign_lineage == "replace":
            raise ConfigError(f"sink {name!r}: a Kafka topic cannot remove the records another lineage wrote, so "
                              "on_foreign_lineage='replace' is not possible; use 'fail' (the default), 'continue', "
                              "or write to a new topic")
        self.config = dict(config or {})

    def location(self) -> SinkLocation:
        return SinkLocation("kafka", uri=f"kafka://{self.bootstrap_servers.split(',')[0]}/{self.topic}", mode="append")

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "topic": self.topic}

    # -- the commit ---------------------------------------------------------------------

    def commit(self, output: pa.Table, ctx: CommitContext) -> SinkCommitResult:
        held = self.committed_mark(ctx.pipeline)
        if not ctx.should_commit(self.name, held):
            return SinkCommitResult(skipped=True, held_epoch=held.epoch if held else None, position={"topic": self.topic})
        from confluent_kafka import KafkaException, Producer

        producer = Producer({"bootstrap.servers": self.bootstrap_servers, "transactional.id": f"{ctx.pipeline}/{self.name}",
                             "linger.ms": 5, **self.config})
        tags = commit_tags(ctx, output.num_rows)
        headers: list[tuple[str, str | bytes | None]] = [(k, v.encode()) for k, v in tags.items()]
        keys = self.key_columns or ctx.key_columns
        try:
            producer.init_transactions(TIMEOUT_S)  # fences (aborts) whatever a previous attempt left open
            producer.begin_transaction()
            for key, value in _records(output, keys):
                producer.produce(self.topic, key=key, value=value, headers=headers)
                producer.poll(0)
            producer.produce(self.topic, partition=MARKER_PARTITION, value=json.dumps(tags).encode(),
                             headers=[*headers, (MARKER, b"1")])
            producer.commit_transaction(TIMEOUT_S)
        except KafkaException as exc:
            raise SinkCommitError(f"sink {self.name!r}: epoch {ctx.epoch} to kafka topic {self.topic!r}: {exc}; "
                                  "the transaction was not committed, the epoch will be tried again") from exc
        return SinkCommitResult(skipped=False, rows=output.num_rows, mode="append", position={"topic": self.topic})

    # -- what the topic holds -------------------------------------------------------------

    def committed_mark(self, pipeline: str) -> SinkMark | None:
        low, high = self._watermarks()
        end = high
        while end > low:  # newest first, a window at a time: the marker is near the end
            start = max(low, end - SCAN_BACK)
            markers = list(self._markers(pipeline, start, end))
            if markers:
                return markers[-1].mark
            end = start
        return None

    def commits(self, pipeline: str) -> list[SinkCommit]:
        low, high = self._watermarks()
        return list(self._markers(pipeline, low, high))

    def read(self, pipeline: str | None = None) -> list[dict[str, Any]]:
        """Every committed output record (markers left out), as dicts with the
        record's ``volley.epoch`` under ``_epoch``: for tests and checks."""
        rows = []
        for msg in self._scan(None, 0, None):
            headers = dict(msg.headers() or [])
            if MARKER in headers or (pipeline and headers.get("volley.pipeline", b"").decode() != pipeline):
                continue
            rows.append({**json.loads(msg.value()), "_epoch": int(headers["volley.epoch"])})
        return rows

    def _markers(self, pipeline: str, start: int, end: int) -> Iterator[SinkCommit]:
        for msg in self._scan(MARKER_PARTITION, start, end):
            headers = {k: v.decode() for k, v in (msg.headers() or [])}
            if MARKER in headers and headers.get("volley.pipeline") == pipeline:
                yield SinkCommit(SinkMark.from_tags(headers), int(headers.get("volley.rows", -1)))

    def _consumer(self) -> Any:
        return kafka.consumer(self.bootstrap_servers, f"volley-sink-{self.topic}", "read_committed", self.config)

    def _watermarks(self) -> tuple[int, int]:
        """Of the marker partition; (0, 0) while the topic does not exist: it holds nothing."""
        from confluent_kafka import KafkaException

        client = self._consumer()
        try:
            if MARKER_PARTITION not in (kafka.partitions(client, self.topic) or []):
                return 0, 0
            return kafka.watermarks(client, self.topic, MARKER_PARTITION)
        except KafkaException as exc:
            raise SinkCommitError(f"sink {self.name!r}: kafka topic {self.topic!r}: {exc}") from exc
        finally:
            client.close()

    def _scan(self, partition: int | None, start: int, end: int | None) -> Iterator[Any]:
        """Committed records of one partition from ``start`` to ``end`` (or of every
        partition to its end), skipping the gaps transactions leave."""
        from confluent_kafka import KafkaError, TopicPartition

        client = self._consumer()
        try:
            parts = [p for p in kafka.partitions(client, self.topic) or [] if partition is None or p == partition]
            if not parts:
                return
            client.assign([TopicPartition(self.topic, p, start if partition is not None else 0) for p in parts])
            done: set[int] = set()
            for batch in kafka.batches(client, TIMEOUT_S):
                for msg in batch:
                    if msg.error() is not None:
                        if msg.error().code() == KafkaError._PARTITION_EOF:
                            done.add(msg.partition())
                            continue
                        raise SinkCommitError(f"sink {self.name!r}: kafka topic {self.topic!r}: {msg.error()}")
                    if end is not None and msg.offset() >= end:
                        done.add(msg.partition())
                    elif msg.partition() not in done:
                        yield msg
                if len(done) == len(parts):
                    return
        except kafka.KafkaQuiet as exc:
            raise SinkCommitError(f"sink {self.name!r}: kafka topic {self.topic!r}: {exc}") from exc
        finally:
            client.close()


def _records(output: pa.Table, keys: tuple[str, ...]) -> Iterator[tuple[bytes | None, bytes]]:
    """(key, value) per output row, as JSON: Kafka's client takes one record at a time."""
    for row in output.to_pylist():
        key = json.dumps([row.get(k) for k in keys], default=str).encode() if keys else None
        yield key, json.dumps(row, default=str).encode()
