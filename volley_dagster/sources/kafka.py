"""A Kafka topic as a source: an epoch is, per topic partition, the half-open offset
range ``[start, end)``, recorded before the first attempt like a file log's segments.

Cutting asks the brokers for each partition's watermarks (under ``read_committed``
the high one is the last stable offset, so an open transaction is never cut into).
Reading happens in Spark tasks, one per partition range: ``assign`` at the recorded
start and consume up to the recorded end, with no consumer group and no commits. An
offset range may hold fewer records than offsets: aborted transactions, their control
records and compaction leave gaps, which are accepted. What is not accepted is a
range whose start the brokers no longer have (retention deleted it before it was
read): ``SourceDataLostError`` names the lost offsets, and nothing is skipped.

Partitions are named by their number (``"0"``, ``"1"``, ...). A partition added to
the topic is read from its earliest offset at the next cut; a partition or offsets
that disappear (a topic deleted and re-created) are a ``SourceError``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from volley_dagster.errors import ConfigError, SourceDataLostError, SourceError, SourceUnavailableError
from volley_dagster.io import kafka
from volley_dagster.json_records import JsonObject
from volley_dagster.sources import formats
from volley_dagster.sources.base import Source, SourceSnapshot
from volley_dagster.sources.offsets import Backlog, EpochRange, Offset, Segment, SourcePosition, fair_shares

__all__ = ["KafkaSource", "Watermarks", "plan_cut"]

READ_TIMEOUT_S = 60.0  # a read task that gets no record for this long names the range it could not finish


@dataclass(frozen=True)
class Watermarks:
    """A partition's offsets: the earliest the brokers still hold, and the end (the
    next offset to be written, or under ``read_committed`` the last stable offset)."""

    low: int
    high: int


def plan_cut(topic: str, epoch: int, after: Mapping[str, SourcePosition], marks: Mapping[str, Watermarks],
             max_records: int | None) -> EpochRange:
    """The range from ``after`` to the watermarks, at most ``max_records`` offsets,
    fair across partitions; a partition not in ``after`` starts at its earliest offset."""
    starts = {name: start_offset(topic, name, after, marks) for name in marks}
    for name in after:
        if name not in marks:
            raise SourceError(f"kafka topic {topic!r}: partition {name} was read before and is gone; "
                              "was the topic deleted or re-created? Nothing was cut")
    quota = fair_shares({name: marks[name].high - starts[name] for name in marks}, max_records)
    segments: list[Segment] = []
    end: dict[str, SourcePosition] = {}
    for name in sorted(marks, key=int):
        take = quota[name]
        if take > 0:
            segments.append(Segment(len(segments), name, topic, starts[name], starts[name] + take, 0))
        end[name] = Offset(starts[name] + take)
    start: dict[str, SourcePosition] = {name: Offset(starts[name]) for name in marks}
    return EpochRange(epoch, start, end, tuple(segments))


def start_offset(topic: str, partition: str, after: Mapping[str, SourcePosition],
                 marks: Mapping[str, Watermarks]) -> int:
    """Where a cut resumes in a partition, checked against what the brokers hold."""
    mark = marks[partition]
    pos = after.get(partition)
    if pos is None:
        return mark.low  # a partition never read: from its earliest record
    if not isinstance(pos, Offset):
        raise SourceError(f"kafka topic {topic!r}: partition {partition} was read up to {pos}, a position of another "
                          "kind of source; a checkpoint root reads one source: start a new one for this topic")
    if pos.offset > mark.high:
        raise SourceError(f"kafka topic {topic!r}: partition {partition} ends at offset {mark.high}, before offset "
                          f"{pos.offset} that was already read; was the topic deleted or re-created? Nothing was cut")
    if pos.offset < mark.low:
        raise SourceDataLostError(f"kafka topic {topic!r}: partition {partition} offsets {pos.offset}..{mark.low - 1} "
                                  "were deleted (retention or compaction of a deleted range) before they were read; "
                                  "nothing was cut. Raise the topic's retention, or accept the loss by starting a new "
                                  "checkpoint root")
    return pos.offset


class KafkaSource(Source):
    """``KafkaSource("payments", bootstrap_servers="broker:9092", schema=pa.schema([...]))``:
    JSON values decoded with an explicit schema (as a JSON file log), keys and headers
    ignored; or values of any format decoded by ``decode`` (``formats.decode_values_with``:
    a binary array in, the schema's columns out, in bulk). ``commit_group``: a consumer
    group the committed end offsets are written to after each epoch, so Kafka's own
    lag tools see the pipeline's progress (the epoch log, not the group, is where the
    pipeline resumes). ``config``: further librdkafka consumer settings (security)."""

    def __init__(self, topic: str, bootstrap_servers: str, schema: pa.Schema, *,
                 decode: Callable[[pa.BinaryArray], pa.Table] | None = None, commit_group: str | None = None,
                 isolation_level: str = "read_committed", config: Mapping[str, Any] | None = None) -> None:
        kafka.require_client(f"KafkaSource({topic!r})")
        if isolation_level not in ("read_committed", "read_uncommitted"):
            raise ConfigError(f"isolation_level {isolation_level!r}: use 'read_committed' or 'read_uncommitted'")
        self.decode = decode
        self.commit_group = commit_group
        self.topic = topic
        self.bootstrap_servers = bootstrap_servers
        self.isolation_level = isolation_level
        self.config = dict(config or {})
        self._schema = schema
        self.uri = f"kafka://{bootstrap_servers.split(',')[0]}/{topic}"

    def describe(self) -> JsonObject:
        # the brokers' addresses are not the source's identity: a cluster may move
        value_format = "json" if self.decode is None else f"decoded by {getattr(self.decode, '__qualname__', 'a function')}"
        return {"type": "kafka", "topic": self.topic, "format": value_format, "isolation_level": self.isolation_level}

    def schema(self) -> pa.Schema:
        return self._schema

    def _consumer(self, group_id: str | None = None) -> Any:
        return kafka.consumer(self.bootstrap_servers, group_id or f"volley-reader-{self.topic}", self.isolation_level,
                              {"auto.offset.reset": "error", **self.config})

    def watermarks(self) -> dict[str, Watermarks]:
        """Each partition's watermarks, from the brokers."""
        from confluent_kafka import KafkaException

        client = self._consumer()
        try:
            numbers = kafka.partitions(client, self.topic)
            if numbers is None:
                raise SourceError(f"kafka topic {self.topic!r} at {self.bootstrap_servers}: not found")
            return {str(n): Watermarks(*kafka.watermarks(client, self.topic, n)) for n in numbers}
        except KafkaException as exc:
            raise SourceUnavailableError(f"kafka topic {self.topic!r} at {self.bootstrap_servers}: {exc}") from exc
        finally:
            client.close()

    def cut(self, epoch: int, after: Mapping[str, SourcePosition], max_records: int | None,
            final: bool = False) -> EpochRange:
        return plan_cut(self.topic, epoch, after, self.watermarks(), max_records)

    def backlog(self, after: Mapping[str, SourcePosition]) -> Backlog:
        marks = self.watermarks()
        starts = {name: start_offset(self.topic, name, after, marks) for name in marks}
        waiting = {name: marks[name].high - start for name, start in starts.items()}
        unread = {name: start for name, start in starts.items() if waiting[name] > 0}
        return Backlog(sum(waiting.values()), len(unread), self._oldest_timestamp(unread), waiting)

    def _oldest_timestamp(self, starts: Mapping[str, int]) -> float | None:
        """When the oldest waiting record was written (its timestamp), from the first
        waiting record of each partition: what the freshness check ages."""
        if not starts:
            return None
        from confluent_kafka import TopicPartition

        client = self._consumer()
        found: dict[int, float] = {}
        try:
            client.assign([TopicPartition(self.topic, int(name), offset) for name, offset in starts.items()])
            for batch in kafka.batches(client, kafka.METADATA_TIMEOUT_S):
                for msg in batch:
                    kind, stamp = msg.timestamp() if msg.error() is None else (0, 0)
                    if kind and msg.partition() not in found:
                        found[msg.partition()] = stamp / 1000.0
                        client.pause([TopicPartition(self.topic, msg.partition())])
                if len(found) == len(starts):
                    break
        except kafka.KafkaQuiet:
            pass  # what was found is the best estimate
        finally:
            client.close()
        return min(found.values()) if found else None

    def verify(self, rng: EpochRange) -> None:
        marks = self.watermarks()
        for seg in rng.segments:
            mark = marks.get(seg.partition)
            if mark is None:
                raise SourceError(f"epoch {rng.epoch}: kafka topic {self.topic!r} has no partition {seg.partition} "
                                  "any more; was the topic deleted or re-created? Nothing was committed")
            if mark.low > seg.start:
                raise SourceDataLostError(
                    f"epoch {rng.epoch}: kafka topic {self.topic!r} partition {seg.partition} offsets "
                    f"{seg.start}..{min(mark.low, seg.end) - 1} of the recorded range {seg.start}..{seg.end - 1} were "
                    "deleted (retention) before the epoch committed. Nothing was committed; the range cannot be read "
                    "exactly any more: raise the topic's retention, or start a new checkpoint root")
            if mark.high < seg.end:
                raise SourceError(f"epoch {rng.epoch}: kafka topic {self.topic!r} partition {seg.partition} ends at "
                                  f"offset {mark.high}, before the recorded range's end {seg.end}; was the topic "
                                  "deleted or re-created? Nothing was committed")

    def read_segment(self, seg: Segment, schema: pa.Schema, epoch: int) -> pa.Table:
        values, offsets = self._fetch(seg, epoch)
        at = np.asarray(offsets, dtype=np.int64)
        if self.decode is not None:
            return formats.decode_values_with(self.decode, values, at, schema, seg.position_base())
        return formats.decode_json_values(values, at, schema, seg.position_base())

    def committed(self, rng: EpochRange) -> None:
        if self.commit_group is None:
            return
        from confluent_kafka import KafkaException, TopicPartition

        ends = [TopicPartition(self.topic, int(name), pos.offset) for name, pos in rng.end.items()
                if isinstance(pos, Offset)]
        client = self._consumer(self.commit_group)
        try:
            client.commit(offsets=ends, asynchronous=False)
        except KafkaException:
            pass  # best effort: the next epoch's commit writes the group's offsets again
        finally:
            client.close()

    def _fetch(self, seg: Segment, epoch: int) -> tuple[list[bytes | None], list[int]]:
        """The records at offsets ``[start, end)`` of the segment's partition (gaps allowed)."""
        from confluent_kafka import KafkaError, TopicPartition

        client = self._consumer()
        values: list[bytes | None] = []
        offsets: list[int] = []
        where = f"epoch {epoch}: kafka topic {self.topic!r} partition {seg.partition} offsets {seg.start}..{seg.end - 1}"
        next_offset = seg.start
        try:
            client.assign([TopicPartition(self.topic, int(seg.partition), seg.start)])
            for batch in kafka.batches(client, READ_TIMEOUT_S):
                for msg in batch:
                    err = msg.error()
                    if err is not None:
                        if err.code() == KafkaError._PARTITION_EOF:
                            next_offset = max(next_offset, msg.offset())
                            continue
                        if err.code() in (KafkaError.OFFSET_OUT_OF_RANGE, KafkaError._AUTO_OFFSET_RESET):
                            raise SourceDataLostError(f"{where}: the brokers no longer hold offset {next_offset} "
                                                      "(retention deleted it before the epoch committed)")
                        raise SourceError(f"{where}: {err}")
                    if msg.offset() >= seg.end:
                        next_offset = seg.end
                        break
                    if not offsets and msg.offset() > seg.start and \
                            kafka.watermarks(client, self.topic, int(seg.partition))[0] > seg.start:
                        raise SourceDataLostError(f"{where}: offsets {seg.start}..{msg.offset() - 1} were deleted "
                                                  "(retention) before the epoch committed")
                    values.append(msg.value())
                    offsets.append(msg.offset())
                    next_offset = msg.offset() + 1
                position = client.position([TopicPartition(self.topic, int(seg.partition))])[0].offset
                next_offset = max(next_offset, position)  # past control records and aborted transactions
                if next_offset >= seg.end:
                    break
        except kafka.KafkaQuiet as exc:
            raise SourceUnavailableError(f"{where}: {exc}, stopped at offset {next_offset}") from exc
        finally:
            client.close()
        return values, offsets

    def snapshot(self) -> SourceSnapshot:
        marks = self.watermarks()
        return SourceSnapshot(str(sorted((int(n), m.high) for n, m in marks.items())), {
            "topic": self.topic, "partitions": len(marks),
            **{f"end_offset_partition_{n}": m.high for n, m in sorted(marks.items(), key=lambda kv: int(kv[0]))}})
