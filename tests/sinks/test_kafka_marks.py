"""How the Kafka sink records an epoch's mark in its consumer group and reads it back
(review 2026-12-07, K1, K4), on the answers a broker gives; no broker needed."""

from __future__ import annotations

import json

import pytest

from volley_dagster.errors import SinkLineageError
from volley_dagster.sinks import MemorySink
from volley_dagster.sinks.committer import DecidesAfterSettling
from volley_dagster.sinks.kafka import KafkaSink, group_commit, group_offset, marker_group, marker_key
from volley_dagster.sinks.lineage import SinkCommit, SinkMark

PIPELINE = "payments"
TOPIC = "merchant-totals"
GROUP = marker_group(PIPELINE, "kafka")
MARK = SinkMark(7, "ours", 5, "d1g3st")
TAGS = {"volley.pipeline": PIPELINE, **MARK.tags(), "volley.rows": "200"}
NO_OFFSET = -1001  # OffsetFetch's answer for a group without an offset of the partition (librdkafka's OFFSET_INVALID)


def test_the_group_and_the_marker_key_are_the_pipelines_own() -> None:
    assert GROUP == "volley.payments.kafka" and marker_group(PIPELINE, "totals") == "volley.payments.totals"
    assert marker_key(PIPELINE) == b"volley.marker/payments" != marker_key("refunds")


def test_a_commit_round_trips_through_the_groups_offset_and_metadata() -> None:
    """The offset is the sink epoch and the metadata the marker's value, well under a
    broker's ``offset.metadata.max.bytes`` (4096 by default)."""
    offset, metadata = group_offset(TAGS)
    assert offset == 7 and json.loads(metadata) == TAGS and len(metadata.encode()) < 1024
    assert group_commit(PIPELINE, TOPIC, GROUP, offset, metadata) == SinkCommit(MARK, 200)


def test_a_group_without_an_offset_holds_no_commit() -> None:
    """Never committed, expired after ``offsets.retention.minutes``, or removed with the topic."""
    assert group_commit(PIPELINE, TOPIC, GROUP, NO_OFFSET, None) is None
    assert group_commit(PIPELINE, TOPIC, GROUP, NO_OFFSET, "") is None


def test_a_mark_recorded_by_hand_has_no_row_count() -> None:
    offset, metadata = group_offset({"volley.pipeline": PIPELINE, **MARK.tags()})
    assert group_commit(PIPELINE, TOPIC, GROUP, offset, metadata) == SinkCommit(MARK, -1)


@pytest.mark.parametrize(("offset", "metadata"), [
    (7, ""),  # kafka-consumer-groups --reset-offsets on the sink's group
    (7, "not json"),
    (8, json.dumps(TAGS)),  # the offset moved, the metadata did not
    (7, json.dumps({**TAGS, "volley.pipeline": "refunds"})),
    (7, json.dumps([1, 2])),
])
def test_an_offset_that_is_not_a_mark_of_the_pipeline_is_refused_by_name(offset: int, metadata: str) -> None:
    with pytest.raises(SinkLineageError, match=rf"topic '{TOPIC}': consumer group '{GROUP}' holds offset {offset} "
                                               rf".*not a mark of pipeline '{PIPELINE}'.*Nothing was written"):
        group_commit(PIPELINE, TOPIC, GROUP, offset, metadata)


def test_only_the_kafka_sink_decides_after_settling_its_own_transaction() -> None:
    """Review K2: the committer leaves the decision to a sink of this kind (after its
    ``init_transactions``), and decides itself for the others."""
    assert isinstance(KafkaSink("t", "127.0.0.1:9"), DecidesAfterSettling)
    assert not isinstance(MemorySink(), DecidesAfterSettling)
