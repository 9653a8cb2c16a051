"""An epoch's output as records on a Kafka topic, exactly once: one transaction per
epoch, under ``transactional.id`` ``<pipeline>/<sink>``, so that starting the next
attempt fences a zombie one at the broker (its transaction is aborted).

Each record carries the headers ``volley.pipeline`` and ``volley.epoch`` (and the
rest of the commit's mark). Readers of the topic should read under
``read_committed`` and skip records with the ``volley.marker`` header.

Where the epoch's mark lives. The same transaction records the mark twice:

- in a consumer group of the sink's own, ``volley.<pipeline>.<sink>``, through
  ``send_offsets_to_transaction``: the committed offset of partition 0 is the sink
  epoch, its metadata the mark (as JSON). This is the record that decides. A
  committed offset is read from the group coordinator, not from the topic, so
  another producer's open transaction on the topic cannot hide it (a marker in the
  topic stays behind the last stable offset while any transaction on its partition is
  open), retention cannot remove it (group offsets expire ``offsets.retention.minutes``
  after the last commit, 7 days by default), and compaction does not apply to it. A
  ``read_committed`` read asks for stable offsets (KIP-447): while a transaction's
  offsets are pending the broker answers UNSTABLE_OFFSET_COMMIT and the read waits,
  so it never returns the mark before it;
- as a marker record on partition 0, keyed ``volley.marker/<pipeline>`` (a compacted
  topic refuses records without a key, and keeps each pipeline's latest marker),
  whose value is the mark and the epoch's row count. The markers are the sink's
  history, which the sink check reads back from the end of partition 0 a window at a
  time, only as far as the epochs it checks. They are also the mark of topics
  committed before the group record, or whose group offsets expired.

An attempt reads the mark only after ``init_transactions``, and decides there (the
committer leaves the decision to it, ``commit_deciding``): that call waits for the
previous attempt's transaction to complete, or aborts it. A commit whose outcome the
client cannot know (its reply timed out, the producer was fenced) is never taken as
not committed: the next ``init_transactions`` settles it, and the mark read back after
that decides. When neither the group nor the topic holds a mark of the pipeline but
the epoch log says the sink held the previous epoch, the attempt refuses by name
rather than write the epoch a second time; ``record_mark`` lets a person say what the
topic holds.

Values are the output rows as JSON objects; keys are the key columns as JSON.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from typing import Any

import pyarrow as pa

from volley_dagster import faults
from volley_dagster.errors import ConfigError, SinkCommitError, SinkLineageError, SinkOutcomeUnknownError
from volley_dagster.io import kafka
from volley_dagster.json_records import JsonObject
from volley_dagster.sinks.base import (
    CommitContext,
    Sink,
    SinkCommitResult,
    SinkHistory,
    SinkLocation,
    SinkPosition,
    commit_tags,
)
from volley_dagster.sinks.lineage import ForeignLineage, SinkCommit, SinkMark, check_choice

__all__ = ["KafkaSink"]

MARKER = "volley.marker"
MARKER_PARTITION = 0
SCAN_BACK = 1_000  # offsets of partition 0 in the first window read back from its end; each next one doubles
SCAN_BACK_MAX = 64_000
FETCH_WAIT_MS = 10  # how long a broker may hold a fetch that finds nothing new, when the sink reads its topic back
TIMEOUT_S = 30.0
RETRY_S = 0.1  # between retries of a retriable commit error
BEFORE_PRODUCE = "kafka_before_produce"  # pause point: the attempt decided to write the epoch
BEFORE_COMMIT = "kafka_before_commit"  # kill point: the epoch produced in its transaction, not committed


def marker_group(pipeline: str, sink: str) -> str:
    """The consumer group in which sink ``sink`` of ``pipeline`` records its marks; it
    never consumes (no member ever joins it)."""
    return f"volley.{pipeline}.{sink}"


def marker_key(pipeline: str) -> bytes:
    """The key of a pipeline's marker records: one per pipeline, so compaction keeps its latest."""
    return f"{MARKER}/{pipeline}".encode()


def group_offset(tags: Mapping[str, str]) -> tuple[int, str]:
    """The committed offset and metadata that record one commit in the sink's group:
    the sink epoch, and the commit's tags as JSON (the marker record's value)."""
    return int(tags["volley.epoch"]), json.dumps(dict(tags))


def group_commit(pipeline: str, topic: str, group: str, offset: int, metadata: str | None) -> SinkCommit | None:
    """The commit that the group's answer for partition 0 records; None when the group
    holds no offset for it (never committed; expired after ``offsets.retention.minutes``;
    removed with the topic). Rows are -1 when the mark was recorded by hand."""
    if offset < 0:
        return None
    try:
        tags = json.loads(metadata or "")
        if tags["volley.pipeline"] == pipeline and int(tags["volley.epoch"]) == offset:
            return SinkCommit(SinkMark.from_tags(tags), int(tags.get("volley.rows", -1)))
    except (ValueError, KeyError, TypeError):
        pass
    raise SinkLineageError(
        f"kafka topic {topic!r}: consumer group {group!r} holds offset {offset} with metadata {metadata!r}, which is "
        f"not a mark of pipeline {pipeline!r}: the group is a Kafka sink's record of the epochs it committed, and "
        "something else committed to it. Nothing was written. Stop what commits to it, delete its offsets "
        f"(kafka-consumer-groups --delete-offsets --group {group} --topic {topic}) and run the epoch again: the "
        "topic's markers decide then, or the error that follows says how to record the mark"
    )


class KafkaSink(Sink):
    """``KafkaSink("merchant-totals", bootstrap_servers="broker:9092")``. ``timeout_s``
    bounds each exchange with the brokers: initialising the transactions, committing
    (retries of a retriable error included) and reading the mark back."""

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
        return self.commit_deciding(output, ctx, None)

    def commit_deciding(self, output: pa.Table, ctx: CommitContext, recorded: int | None) -> SinkCommitResult:
        """Decide, after ``init_transactions``, whether to write, skip or refuse, and write.
        ``recorded``: the sink epoch the epoch log records this sink holding at the
        previous epoch (``sinks/committer.py``), to refuse when every mark is gone."""
        producer = self._producer(ctx)  # settles the previous attempt's transaction: none of ours is open now
        try:
            held = self._held(ctx, recorded)
            if not ctx.should_commit(self.name, held):
                return SinkCommitResult(skipped=True, held_epoch=held.epoch if held else None,
                                        position=SinkPosition(topic=self.topic))
            faults.fault_pause(BEFORE_PRODUCE, ctx.epoch)
            self._produce(producer, output, ctx)
            faults.fault_point(BEFORE_COMMIT, ctx.epoch)
            committed = self._end(producer, ctx)
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

    def _held(self, ctx: CommitContext, recorded: int | None) -> SinkMark | None:
        """The mark to decide on, read after ``init_transactions``: refused when the
        sink's marks are gone (the epoch log says it held ``recorded``, it shows less);
        for an epoch it holds beyond this one, the mark of this one (its range is checked)."""
        held = self.committed_mark(ctx.pipeline)
        if recorded is not None and (held is None or (ctx.lineage.owns(held) and held.epoch < recorded)):
            raise SinkLineageError(self._lost(ctx, recorded, held))
        if held is not None and ctx.lineage.owns(held) and held.epoch > ctx.sink_epoch:
            held = self.commit_of(ctx.pipeline, ctx.sink_epoch) or ctx.mark
        return held

    def _lost(self, ctx: CommitContext, recorded: int, held: SinkMark | None) -> str:
        group = marker_group(ctx.pipeline, self.name)
        before = SinkMark(recorded, ctx.lineage.id, ctx.epoch - 1, None)
        holds = "no mark of the pipeline" if held is None else f"only {held.describe()}"
        return (
            f"sink {self.name!r}: epoch {ctx.epoch} of pipeline {ctx.pipeline!r} to kafka topic {self.topic!r}: the "
            f"epoch log records that this sink held epoch {recorded}, but consumer group {group!r} and the topic's "
            f"markers hold {holds} (group offsets expire offsets.retention.minutes after the last commit; the topic's "
            "retention or compaction removes markers; deleting the topic removes both), so whether epoch "
            f"{ctx.sink_epoch} is in the topic already cannot be known. Nothing was written. Look in the topic for "
            f"records with the headers volley.pipeline={ctx.pipeline} and volley.epoch={ctx.sink_epoch}, record what "
            f"it holds, then run the epoch again: KafkaSink(...).record_mark({ctx.pipeline!r}, {ctx.mark!r}) if they "
            f"are there, record_mark({ctx.pipeline!r}, {before!r}) if not (SinkMark from "
            "volley_dagster.sinks.lineage); or write to a new topic. Keep offsets.retention.minutes above the longest "
            "pause of the pipeline"
        )

    def record_mark(self, pipeline: str, mark: SinkMark) -> None:
        """Record in the sink's group that the topic holds ``pipeline``'s epochs up to
        ``mark``: a person's answer to the refusal that follows the loss of every mark
        (the error names both possible marks). A plain offset commit, outside any
        transaction; the next attempt decides from it."""
        from confluent_kafka import KafkaException, TopicPartition

        offset, metadata = group_offset({"volley.pipeline": pipeline, **mark.tags()})
        client = self._group_client(pipeline)
        try:
            client.commit(offsets=[TopicPartition(self.topic, MARKER_PARTITION, offset, metadata)], asynchronous=False)
        except KafkaException as exc:
            raise SinkCommitError(f"sink {self.name!r}: kafka topic {self.topic!r}: recording {mark.describe()} in "
                                  f"consumer group {marker_group(pipeline, self.name)!r}: {exc}") from exc
        finally:
            client.close()

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
        """The epoch's records, its keyed marker on partition 0 and its offset in the
        sink's group, in one open transaction."""
        from confluent_kafka import KafkaException, TopicPartition

        tags = commit_tags(ctx, output.num_rows)
        headers: list[tuple[str, str | bytes | None]] = [(k, v.encode()) for k, v in tags.items()]
        keys = self.key_columns or ctx.key_columns
        refused: list[Any] = []  # the delivery errors: a refusal surfaces here before a later produce() fails _STATE

        def delivered(error: Any, _message: Any) -> None:
            if error is not None:
                refused.append(error)

        try:
            producer.begin_transaction()
            for key, value in _records(output, keys):
                producer.produce(self.topic, key=key, value=value, headers=headers, on_delivery=delivered)
                producer.poll(0)
            producer.produce(self.topic, partition=MARKER_PARTITION, key=marker_key(ctx.pipeline),
                             value=json.dumps(tags).encode(), headers=[*headers, (MARKER, b"1")])
            producer.flush(self.timeout_s)
            offset, metadata = group_offset(tags)
            producer.send_offsets_to_transaction([TopicPartition(self.topic, MARKER_PARTITION, offset, metadata)],
                                                 self._group_metadata(ctx.pipeline), self.timeout_s)
        except (KafkaException, BufferError) as exc:  # never committed, so it cannot commit
            aborted = False
            try:  # whichever error surfaced first (an earlier delivery's, or the _STATE that follows it)
                producer.abort_transaction(self.timeout_s)
                aborted = True
            except KafkaException:
                pass  # the next init_transactions aborts it
            producer.poll(0)  # serve the delivery reports still queued
            self._refuse_invalid([exc.args[0] if exc.args else None, *refused], exc, ctx)
            raise SinkCommitError(f"sink {self.name!r}: epoch {ctx.epoch} to kafka topic {self.topic!r}: {exc}; the "
                                  f"transaction was {'aborted' if aborted else 'not committed'}, the epoch will be "
                                  "tried again") from exc

    def _group_metadata(self, pipeline: str) -> Any:
        """What ``send_offsets_to_transaction`` needs of the sink's group: a consumer of it
        that never joins, so the broker takes the offsets as a standalone consumer's."""
        client = self._group_client(pipeline)
        try:
            return client.consumer_group_metadata()
        finally:
            client.close()

    def _refuse_invalid(self, errors: list[Any], exc: Exception, ctx: CommitContext) -> None:
        """A record the broker refused as invalid is refused again on every retry: a
        permanent error that says what to change, instead of retries forever. ``errors``:
        the one raised, and the deliveries' (the refusal may be only there)."""
        from confluent_kafka import KafkaError

        for error in errors:
            if not (isinstance(error, KafkaError) and error.code() == KafkaError.INVALID_RECORD):
                continue
            raise ConfigError(
                f"sink {self.name!r}: epoch {ctx.epoch} to kafka topic {self.topic!r}: the broker refused a record as "
                f"invalid (INVALID_RECORD: {error.str()}). A topic with cleanup.policy=compact refuses records without "
                "a key, which this sink writes when the output has no key columns. Nothing of the epoch was "
                "committed; give the sink key_columns=(...), or write to a topic without compaction"
            ) from exc

    def _end(self, producer: Any, ctx: CommitContext) -> bool | None:
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
                    except KafkaException:
                        return None
                    self._refuse_invalid([error], exc, ctx)
                    return False
                if error.retriable() and not error.fatal() and time.monotonic() < deadline:
                    time.sleep(min(RETRY_S, max(deadline - time.monotonic(), 0.0)))
                    continue  # resumes the same commit (a timed-out one may still complete)
                return None

    def _settle(self, ctx: CommitContext) -> bool:
        """Whether this epoch's transaction committed, after a commit of unknown outcome:
        a new producer's ``init_transactions`` completes or aborts it (and fences the
        old producer), then the mark read back says which."""
        try:
            self._producer(ctx)
            held = self.committed_mark(ctx.pipeline)
        except SinkCommitError as exc:
            raise SinkOutcomeUnknownError(
                f"sink {self.name!r}: epoch {ctx.epoch} to kafka topic {self.topic!r}: the commit's outcome is unknown "
                f"and could not be read back ({exc}); the next attempt settles the transaction and reads the mark "
                "before it writes anything") from exc
        return held == ctx.mark

    # -- what the group and the topic hold ------------------------------------------------

    def committed_mark(self, pipeline: str) -> SinkMark | None:
        """The group's record; else, for a topic committed before it or a group whose
        offsets expired, the newest marker of the topic."""
        recorded = self._group_commit(pipeline)
        if recorded is not None:
            return recorded.mark
        return next((commit.mark for commit in self._markers_back(pipeline)), None)

    def commits(self, pipeline: str) -> list[SinkCommit]:
        return self.history_from(pipeline, 0).commits

    def history_from(self, pipeline: str, sink_epoch: int) -> SinkHistory:
        """The markers of ``pipeline`` from ``sink_epoch`` on, read back from the end of
        partition 0 and no further than the first marker below it, so a check costs the
        epochs it checks (at most twice their records, plus a window), not the topic's
        age. The group's record adds the newest commit when its marker cannot be read
        (another producer's open transaction holds it back, retention removed it)."""
        newest_first: list[SinkCommit] = []
        complete = False
        for commit in self._markers_back(pipeline):
            if commit.mark.epoch < sink_epoch:
                complete = True
                break
            newest_first.append(commit)
        commits = newest_first[::-1]
        complete = complete or (bool(commits) and commits[0].mark.epoch <= sink_epoch)
        recorded = self._group_commit(pipeline)
        if (recorded is not None and recorded.rows >= 0 and recorded.mark.epoch >= sink_epoch
                and (not commits or recorded.mark.epoch > commits[-1].mark.epoch)):
            commits.append(recorded)
            complete = complete or recorded.mark.epoch == sink_epoch
        return SinkHistory(commits, complete)

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

    def _group_commit(self, pipeline: str) -> SinkCommit | None:
        """The commit the sink's group records, read as stable (KIP-447): while a
        transaction's offsets are pending, librdkafka asks again until ``timeout_s``;
        an answer that never becomes stable fails, it is never taken as no record."""
        from confluent_kafka import KafkaError, KafkaException, TopicPartition

        group = marker_group(pipeline, self.name)
        client = self._group_client(pipeline)
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                try:
                    [answer] = client.committed([TopicPartition(self.topic, MARKER_PARTITION)],
                                                timeout=max(deadline - time.monotonic(), 0.1))
                except KafkaException as exc:
                    raise SinkCommitError(
                        f"sink {self.name!r}: kafka topic {self.topic!r}: consumer group {group!r} gave no stable "
                        f"record of the sink's last epoch in {self.timeout_s:.0f}s ({exc}); while a transaction of "
                        "this sink is open its offsets stay unstable, and the next attempt's init_transactions "
                        "settles it") from exc
                error = answer.error
                if error is None:
                    return group_commit(pipeline, self.topic, group, answer.offset, answer.metadata)
                if error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                    return None  # no topic, no commit (a broker answers so before the first epoch created it)
                if error.code() != KafkaError.UNSTABLE_OFFSET_COMMIT or time.monotonic() > deadline:
                    raise SinkCommitError(f"sink {self.name!r}: kafka topic {self.topic!r}: consumer group {group!r} "
                                          f"gave no stable record of the sink's last epoch: {error}")
                time.sleep(RETRY_S)
        finally:
            client.close()

    def _group_client(self, pipeline: str) -> Any:
        """A consumer of the sink's group that never joins it: it reads and commits the
        group's offsets as a standalone consumer, and ``read_committed`` asks for stable ones."""
        return kafka.consumer(self.bootstrap_servers, marker_group(pipeline, self.name), "read_committed", self.config)

    def _markers_back(self, pipeline: str) -> Iterator[SinkCommit]:
        """The topic's markers of ``pipeline``, newest first: partition 0 read back from
        its end, a window at a time, each twice as long as the one before."""
        low, high = self._watermarks()
        end, window = high, SCAN_BACK
        while end > low:
            start = max(low, end - window)
            yield from reversed(list(self._markers(pipeline, start, end)))
            end, window = start, min(2 * window, SCAN_BACK_MAX)

    def _markers(self, pipeline: str, start: int, end: int) -> Iterator[SinkCommit]:
        for msg in self._scan(MARKER_PARTITION, start, end):
            headers = {k: v.decode() for k, v in (msg.headers() or [])}
            if MARKER in headers and headers.get("volley.pipeline") == pipeline:
                yield SinkCommit(SinkMark.from_tags(headers), int(headers.get("volley.rows", -1)))

    def _consumer(self) -> Any:
        """A reader of a bounded range: the end of a partition shows only in a fetch that
        comes back empty, which a broker holds ``fetch.wait.max.ms`` (500 ms by default)."""
        return kafka.consumer(self.bootstrap_servers, f"volley-sink-{self.topic}", "read_committed",
                              {"fetch.wait.max.ms": FETCH_WAIT_MS, **self.config})

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
        partition, from its earliest record held, to its end), skipping the gaps
        transactions leave."""
        from confluent_kafka import OFFSET_BEGINNING, KafkaError, TopicPartition

        client = self._consumer()
        try:
            parts = [p for p in kafka.partitions(client, self.topic) or [] if partition is None or p == partition]
            if not parts:
                return
            client.assign([TopicPartition(self.topic, p, start if partition is not None else OFFSET_BEGINNING)
                           for p in parts])
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
