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

An attempt reads the marker only after ``init_transactions``: that call waits for
the previous attempt's transaction to complete, or aborts it, so no transaction of
this sink is still open to hide a marker behind the last stable offset. A commit
whose outcome the client cannot know (its reply timed out, the producer was fenced)
is never taken as not committed: the next ``init_transactions`` settles it, and the
marker read back after that decides.

Values are the output rows as JSON objects; keys are the key columns as JSON.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from typing import Any

import pyarrow as pa

from volley_dagster import faults
from volley_dagster.errors import ConfigError, SinkCommitError, SinkOutcomeUnknownError
from volley_dagster.io import kafka
from volley_dagster.json_records import JsonObject
from volley_dagster.sinks.base import CommitContext, Sink, SinkCommitResult, SinkLocation, SinkPosition, commit_tags
from volley_dagster.sinks.lineage import ForeignLineage, SinkCommit, SinkMark, check_choice

__all__ = ["KafkaSink"]

MARKER = "volley.marker"
MARKER_PARTITION = 0
SCAN_BACK = 1_000  # offsets of partition 0 looked at per step, newest first, for the last marker
TIMEOUT_S = 30.0
RETRY_S = 0.1  # between retries of a retriable commit error
BEFORE_PRODUCE = "kafka_before_produce"  # pause point: the attempt decided to write the epoch
BEFORE_COMMIT = "kafka_before_commit"  # kill point: the epoch produced in its transaction, not committed


class KafkaSink(Sink):
    """``KafkaSink("merchant-totals", bootstrap_servers="broker:9092")``. ``timeout_s``
    bounds each exchange with the brokers: initialising the transactions, committing
    (retries of a retriable error included) and reading the marker back."""

    def __init__(self, topic: str, bootstrap_servers: str, name: str = "kafka", *,
                 key_columns: tuple[str, ...] | None = None, on_foreign_lineage: ForeignLineage = "fail",
                 config: Mapping[str, Any] | None = None, timeout_s: float = TIMEOUT_S) -> None:
        kafka.require_client(f"KafkaSink({topic!r})")
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
        self.timeout_s = timeout_s

    def location(self) -> SinkLocation:
        return SinkLocation("kafka", uri=f"kafka://{self.bootstrap_servers.split(',')[0]}/{self.topic}", mode="append")

    def describe(self) -> JsonObject:
        return {**super().describe(), "topic": self.topic}

    # -- the commit ---------------------------------------------------------------------

    def commit(self, output: pa.Table, ctx: CommitContext) -> SinkCommitResult:
        producer = self._producer(ctx)  # settles the previous attempt's transaction: none of ours is open now
        try:
            held = self.committed_mark(ctx.pipeline)
            if not ctx.should_commit(self.name, held):
                return SinkCommitResult(skipped=True, held_epoch=held.epoch if held else None,
                                        position=SinkPosition(topic=self.topic))
            faults.fault_pause(BEFORE_PRODUCE, ctx.epoch)
            self._produce(producer, output, ctx)
            faults.fault_point(BEFORE_COMMIT, ctx.epoch)
            committed = self._end(producer)
        finally:
            del producer  # destroyed: nothing of it is retried later; what it left open, init_transactions aborts
        read_back = committed is None
        if committed is None:
            committed = self._settle(ctx)
        if not committed:
            how = " (read back after init_transactions settled it)" if read_back else ""
            raise SinkCommitError(f"sink {self.name!r}: epoch {ctx.epoch} to kafka topic {self.topic!r}: the "
                                  f"transaction was aborted{how}, the epoch will be tried again")
        return SinkCommitResult(skipped=False, rows=output.num_rows, mode="append",
                                position=SinkPosition(topic=self.topic, read_back=read_back))

    def _producer(self, ctx: CommitContext) -> Any:
        """A transactional producer of this sink, its transactions initialised: a broker
        first completes or aborts whatever an earlier attempt left (and fences it)."""
        from confluent_kafka import KafkaException, Producer

        producer = Producer({"bootstrap.servers": self.bootstrap_servers, "transactional.id": f"{ctx.pipeline}/{self.name}",
                             "linger.ms": 5, **self.config})
        try:
            producer.init_transactions(self.timeout_s)
        except KafkaException as exc:
            raise SinkCommitError(f"sink {self.name!r}: epoch {ctx.epoch} to kafka topic {self.topic!r}: "
                                  f"init_transactions: {exc}; nothing of this attempt was written") from exc
        return producer

    def _produce(self, producer: Any, output: pa.Table, ctx: CommitContext) -> None:
        """The epoch's records, then its marker on partition 0, in one open transaction."""
        from confluent_kafka import KafkaException

        tags = commit_tags(ctx, output.num_rows)
        headers: list[tuple[str, str | bytes | None]] = [(k, v.encode()) for k, v in tags.items()]
        keys = self.key_columns or ctx.key_columns
        try:
            producer.begin_transaction()
            for key, value in _records(output, keys):
                producer.produce(self.topic, key=key, value=value, headers=headers)
                producer.poll(0)
            producer.produce(self.topic, partition=MARKER_PARTITION, value=json.dumps(tags).encode(),
                             headers=[*headers, (MARKER, b"1")])
            producer.flush(self.timeout_s)
        except (KafkaException, BufferError) as exc:  # never committed, so it cannot commit
            aborted = False
            try:  # whichever error surfaced first (an earlier delivery's, or the _STATE that follows it)
                producer.abort_transaction(self.timeout_s)
                aborted = True
            except KafkaException:
                pass  # the next init_transactions aborts it
            raise SinkCommitError(f"sink {self.name!r}: epoch {ctx.epoch} to kafka topic {self.topic!r}: {exc}; the "
                                  f"transaction was {'aborted' if aborted else 'not committed'}, the epoch will be "
                                  "tried again") from exc

    def _end(self, producer: Any) -> bool | None:
        """Commit, as librdkafka's contract on ``commit_transaction`` errors says: retry
        a retriable error, abort when the error requires it. True: committed; False:
        aborted; None: unknown (the reply never came in time, the producer was fenced
        or failed, the abort failed)."""
        from confluent_kafka import KafkaException

        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                producer.commit_transaction(max(deadline - time.monotonic(), 0.1))
                return True
            except KafkaException as exc:
                error = exc.args[0]
                if error.txn_requires_abort():
                    try:
                        producer.abort_transaction(self.timeout_s)
                        return False
                    except KafkaException:
                        return None
                if error.retriable() and not error.fatal() and time.monotonic() < deadline:
                    time.sleep(min(RETRY_S, max(deadline - time.monotonic(), 0.0)))
                    continue  # resumes the same commit (a timed-out one may still complete)
                return None

    def _settle(self, ctx: CommitContext) -> bool:
        """Whether this epoch's transaction committed, after a commit of unknown outcome:
        a new producer's ``init_transactions`` completes or aborts it (and fences the
        old producer), then the marker read back says which."""
        try:
            self._producer(ctx)
            held = self.committed_mark(ctx.pipeline)
        except SinkCommitError as exc:
            raise SinkOutcomeUnknownError(
                f"sink {self.name!r}: epoch {ctx.epoch} to kafka topic {self.topic!r}: the commit's outcome is unknown "
                f"and could not be read back ({exc}); the next attempt settles the transaction and reads the marker "
                "before it writes anything") from exc
        return held == ctx.mark

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
            for batch in kafka.batches(client, self.timeout_s):
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
