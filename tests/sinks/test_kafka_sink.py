"""The Kafka sink commits each epoch once when the brokers answer late, when the
previous attempt's transaction completes while the next attempt starts, and when an
attempt is killed between the produce and the commit; its epoch's mark is neither
hidden by another producer's open transaction, nor removed by retention, nor refused
by compaction (review 2026-12-07, K1-K5). Against librdkafka's mock cluster
(harness/kafka.py), a fresh one per test since some inject errors into it; every read
is under ``read_committed``. Where the mock does not behave as a broker (its last
stable offset, its storage of a transaction's offsets, compaction), the test says so
and gives the broker's answer."""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError, TopicPartition

from harness.kafka import KafkaCluster, start_kafka
from tests.sinks import kafka_attempt
from tests.sinks.commit_worker import epoch_output
from tests.sinks.helpers import PIPELINE, ROWS, ctx
from volley_dagster import FileLog, Pipeline, SinkCommitError, sum_
from volley_dagster.checkpoint.epoch_log import EpochLog
from volley_dagster.errors import ConfigError, SinkLineageError, is_retryable
from volley_dagster.io import kafka
from volley_dagster.result import EpochResult
from volley_dagster.sinks import kafka as kafka_sink
from volley_dagster.sinks.base import commit_tags
from volley_dagster.sinks.committer import SinkCommitter
from volley_dagster.sinks.kafka import BEFORE_COMMIT, BEFORE_PRODUCE, KafkaSink
from volley_dagster.sinks.lineage import SinkMark
from volley_dagster.sources.offsets import EpochRange, Offset

pytestmark = pytest.mark.server  # librdkafka's mock cluster, a broker per test


@pytest.fixture
def cluster() -> Iterator[KafkaCluster]:
    mock = start_kafka()
    try:
        yield mock
    finally:
        mock.stop()


def topic_name() -> str:
    return f"totals-{uuid.uuid4().hex[:8]}"


def commit(sink: KafkaSink, epoch: int) -> dict[str, Any]:
    return sink.commit(epoch_output(epoch, ROWS), ctx(epoch)).to_dict()


def assert_each_epoch_once(sink: KafkaSink, epochs: range) -> None:
    """One marker per epoch with the epoch's row count, and exactly its records."""
    assert sink.epoch_history(PIPELINE) == {e: [ROWS] for e in epochs}
    assert Counter(row["_epoch"] for row in sink.read(PIPELINE)) == {e: ROWS for e in epochs}


def test_a_commit_whose_reply_comes_too_late_is_read_back_as_committed(cluster):
    """The broker commits epoch 2 but its reply to EndTxn comes after the sink gave up:
    the outcome is unknown to the client, so the sink settles it with a new
    ``init_transactions`` and reads the marker back; it neither reports the epoch as
    not committed nor writes it again."""
    sink = KafkaSink(topic_name(), cluster.bootstrap_servers, timeout_s=3.0)
    assert commit(sink, 1)["skipped"] is False
    cluster.push_request_errors("EndTxn", [(KafkaError.NO_ERROR, 12_000)])
    t = time.monotonic()
    result = commit(sink, 2)
    assert time.monotonic() - t < 10.0  # resolved by the read-back, not by the late reply
    assert result == {"skipped": False, "rows": ROWS, "mode": "append", "topic": sink.topic, "read_back": True}
    assert sink.committed_epoch(PIPELINE) == 2
    assert commit(sink, 2)["skipped"] is True  # the engine's retry of epoch 2 finds it in
    assert commit(sink, 3)["skipped"] is False
    assert_each_epoch_once(sink, range(1, 4))


def test_a_commit_that_requires_an_abort_is_aborted_and_the_retry_writes_the_epoch_once(cluster):
    """Every produce of epoch 2 fails for good, so ``commit_transaction`` asks for an
    abort: the sink aborts, says the epoch was not committed, and the next attempt
    writes it once."""
    sink = KafkaSink(topic_name(), cluster.bootstrap_servers, timeout_s=10.0)
    commit(sink, 1)
    cluster.push_request_errors("Produce", [(KafkaError.MSG_SIZE_TOO_LARGE, 0)] * 100, broker_id=None)
    with pytest.raises(SinkCommitError, match="epoch 2 .*the transaction was aborted, the epoch will be tried again"):
        commit(sink, 2)
    cluster.clear_request_errors("Produce")
    assert sink.committed_epoch(PIPELINE) == 1
    assert commit(sink, 2)["skipped"] is False
    assert_each_epoch_once(sink, range(1, 3))


def test_the_previous_attempt_committing_while_the_next_one_initialises_is_not_written_twice(cluster, tmp_path):
    """Review R1: the previous attempt's commit of epoch 3 completes only while the next
    attempt's ``init_transactions`` waits for it (the coordinator answers
    CONCURRENT_TRANSACTIONS until then). An attempt that read the marker before that
    found epoch 2 and wrote epoch 3 again; this one reads it after, finds epoch 3 in
    and writes nothing. The mock hands out a transaction's records before its commit,
    so here the previous attempt's produce must come late too: it is held after its
    decision, and released, to produce and commit, while the new attempt's
    ``init_transactions`` is held by injected CONCURRENT_TRANSACTIONS answers."""
    topic = topic_name()
    sink = KafkaSink(topic, cluster.bootstrap_servers)
    for epoch in (1, 2):
        commit(sink, epoch)
    pause = tmp_path / "pause"
    pause.mkdir()
    held = pause / f"{BEFORE_PRODUCE}-3-None"
    (pause / f"{held.name}.armed").touch()
    previous = kafka_attempt.start({"bootstrap_servers": cluster.bootstrap_servers, "topic": topic,
                                    "pipeline": PIPELINE, "epoch": 3, "rows": ROWS},
                                   {"VOLLEY_PAUSE_DIR": str(pause), "VOLLEY_PAUSE_MAX_S": "120"})
    deadline = time.monotonic() + 60
    while not held.exists():  # initialised, read epoch 2, decided to write epoch 3
        assert previous.poll() is None and time.monotonic() < deadline, previous.communicate()[1][-3000:]
        time.sleep(0.05)

    cluster.push_request_errors("InitProducerId", [(KafkaError.CONCURRENT_TRANSACTIONS, 250)] * 12)
    outcome: dict[str, Any] = {}

    def next_attempt() -> None:
        try:
            outcome["result"] = commit(sink, 3)
        except Exception as exc:  # reported by the assertions below
            outcome["error"] = exc

    attempt = threading.Thread(target=next_attempt)
    attempt.start()
    time.sleep(2.0)  # the next attempt is under way: a read before its init would be done by now
    held.unlink()  # the previous attempt produces epoch 3 and commits it
    out, err = previous.communicate(timeout=60)
    assert previous.returncode == 0, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["skipped"] is False
    assert attempt.is_alive(), "the injected CONCURRENT_TRANSACTIONS ran out before the previous attempt committed"
    attempt.join(120)
    assert "error" not in outcome, outcome.get("error")
    assert outcome["result"]["skipped"] is True and outcome["result"]["held_epoch"] == 3
    assert commit(sink, 4)["skipped"] is False
    assert_each_epoch_once(sink, range(1, 5))


def test_an_attempt_killed_between_the_produce_and_the_commit_leaves_the_epoch_in_once(cluster, tmp_path):
    """kill -9 after epoch 3's records and marker went out in a transaction, before its
    commit; then the next attempt. A broker aborts the killed transaction in the next
    attempt's ``init_transactions``, and that attempt writes the epoch. The mock
    cluster aborts nothing and hands the open transaction's records to
    ``read_committed`` readers, so there the killed attempt's marker stands and the
    next attempt finds the epoch in. Either way the topic holds epoch 3 once, and
    epoch 4 follows."""
    topic = topic_name()
    sink = KafkaSink(topic, cluster.bootstrap_servers)
    for epoch in (1, 2):
        commit(sink, epoch)
    killed = kafka_attempt.start({"bootstrap_servers": cluster.bootstrap_servers, "topic": topic,
                                  "pipeline": PIPELINE, "epoch": 3, "rows": ROWS},
                                 {"VOLLEY_KILL_AT": BEFORE_COMMIT, "VOLLEY_KILL_EPOCH": "3"})
    _, err = killed.communicate(timeout=120)
    assert killed.returncode == -signal.SIGKILL, err[-3000:]
    result = commit(sink, 3)
    assert result["skipped"] is True or result["rows"] == ROWS
    assert commit(sink, 4)["skipped"] is False
    assert_each_epoch_once(sink, range(1, 5))



# -- the epoch's mark (review 2026-12-07, K1-K5) ---------------------------------------

GROUP = f"volley.{PIPELINE}.kafka"  # the consumer group the sink records its marks in


def broker_stores_the_transactions_offsets(sink: KafkaSink, epoch: int, rows: int = ROWS) -> None:
    """What a broker holds once epoch ``epoch``'s transaction committed: its
    ``send_offsets_to_transaction`` offset in the sink's group (the sink epoch as the
    offset, the mark as the metadata). The mock answers ``TxnOffsetCommit`` and stores
    nothing, so the test stores it with a plain commit, which the mock keeps."""
    group = kafka.consumer(sink.bootstrap_servers, GROUP)
    try:
        metadata = json.dumps(commit_tags(ctx(epoch), rows))
        group.commit(offsets=[TopicPartition(sink.topic, 0, epoch, metadata)], asynchronous=False)
    finally:
        group.close()


def markers(sink: KafkaSink) -> list[Any]:
    """The marker records partition 0 holds, oldest first."""
    client = kafka.consumer(sink.bootstrap_servers, "test-reader")
    try:
        low, _ = kafka.watermarks(client, sink.topic, 0)
        client.assign([TopicPartition(sink.topic, 0, low)])
        found = []
        for batch in kafka.batches(client, 10.0):
            for msg in batch:
                if msg.error() is not None:  # the end of the partition
                    return found
                if "volley.marker" in dict(msg.headers() or []):
                    found.append(msg)
    finally:
        client.close()
    return found


def marker_offsets(sink: KafkaSink) -> dict[int, int]:
    """Per epoch, the offset of its marker on partition 0."""
    return {int(dict(msg.headers())["volley.epoch"]): msg.offset() for msg in markers(sink)}


def hold_back_the_last_stable_offset(monkeypatch: pytest.MonkeyPatch, sink: KafkaSink, before: int,
                                     until: Callable[[], bool] = lambda: False) -> None:
    """The end of partition 0 that a ``read_committed`` reader gets (ListOffsets' answer)
    is ``before`` while another transaction opened there is open, until ``until()``. The
    mock's last stable offset is always its end, so the test gives the broker's answer."""
    real = kafka.watermarks

    def answer(client: Any, topic: str, partition: int) -> tuple[int, int]:
        low, high = real(client, topic, partition)
        held = topic == sink.topic and partition == 0 and not until()
        return (low, min(high, before)) if held else (low, high)

    monkeypatch.setattr(kafka, "watermarks", answer)


def test_each_transaction_records_its_mark_in_the_sinks_own_consumer_group(cluster):
    """Review K1: the epoch's mark goes to a consumer group of the sink's own, in the
    epoch's transaction (``send_offsets_to_transaction``), before its commit; the
    mock answers but stores nothing, so the requests it received are what is checked."""
    sink = KafkaSink(topic_name(), cluster.bootstrap_servers)
    cluster.track_requests()
    commit(sink, 1)
    sent = cluster.requests()
    assert "AddOffsetsToTxn" in sent and "TxnOffsetCommit" in sent, sent
    assert sent.index("TxnOffsetCommit") < sent.index("EndTxn")


def test_an_open_transaction_of_another_producer_hides_no_epoch(cluster, monkeypatch):
    """Review K1: another producer's transaction, opened on partition 0 before epoch 2's
    marker, holds the last stable offset below it. The retry of epoch 2 (its run died
    before the manifest) skips it instead of writing it again, and epoch 3 follows,
    since the group's record is not bounded by the last stable offset. The mock cannot
    hold its last stable offset back nor store a transaction's offsets: both broker
    answers are given (``hold_back_the_last_stable_offset``,
    ``broker_stores_the_transactions_offsets``)."""
    sink = KafkaSink(topic_name(), cluster.bootstrap_servers)
    commit(sink, 1)
    commit(sink, 2)
    broker_stores_the_transactions_offsets(sink, 2)
    hold_back_the_last_stable_offset(monkeypatch, sink, before=marker_offsets(sink)[2])
    assert sink.committed_epoch(PIPELINE) == 2
    assert commit(sink, 2)["skipped"] is True
    assert commit(sink, 3)["skipped"] is False
    monkeypatch.undo()
    assert_each_epoch_once(sink, range(1, 4))


def test_a_read_while_the_groups_offsets_are_pending_waits_for_them(cluster, monkeypatch):
    """Review K1, K2: while a transaction's offsets are pending, a broker answers a
    ``read_committed`` read of the group with UNSTABLE_OFFSET_COMMIT; the read waits
    for the stable record and never takes the older marker of the topic instead. If
    the record stays unstable past ``timeout_s``, the read fails (to be retried), it
    does not answer None. The answers are injected into the mock's OffsetFetch."""
    sink = KafkaSink(topic_name(), cluster.bootstrap_servers, timeout_s=3.0)
    commit(sink, 1)
    commit(sink, 2)
    broker_stores_the_transactions_offsets(sink, 2)
    hold_back_the_last_stable_offset(monkeypatch, sink, before=marker_offsets(sink)[2])
    cluster.push_request_errors("OffsetFetch", [(KafkaError.UNSTABLE_OFFSET_COMMIT, 0)] * 3)
    assert sink.committed_epoch(PIPELINE) == 2
    cluster.push_request_errors("OffsetFetch", [(KafkaError.UNSTABLE_OFFSET_COMMIT, 0)] * 200)  # past timeout_s
    with pytest.raises(SinkCommitError, match=f"consumer group {GROUP!r} gave no stable record"):
        sink.committed_mark(PIPELINE)


def test_the_marks_outlive_the_topics_retention(cluster):
    """Review K4: retention removed every record of partition 0, epoch 2's marker
    included; the retry of epoch 2 finds it in the group's record and skips it. The
    mock removes the records as retention does (``delete_records``); the group's
    record is the broker's answer (the mock stores no transaction's offsets)."""
    sink = KafkaSink(topic_name(), cluster.bootstrap_servers)
    commit(sink, 1)
    commit(sink, 2)
    broker_stores_the_transactions_offsets(sink, 2)
    cluster.delete_records(sink.topic, 0, max(marker_offsets(sink).values()) + 2)
    assert marker_offsets(sink) == {}
    before = Counter(row["_epoch"] for row in sink.read(PIPELINE))
    assert commit(sink, 2)["skipped"] is True
    assert commit(sink, 3)["skipped"] is False
    after = Counter(row["_epoch"] for row in sink.read(PIPELINE))
    assert after == before + Counter({3: ROWS})


def test_the_marker_has_a_key_so_that_compaction_keeps_the_latest(cluster):
    """Review K5: a topic with ``cleanup.policy=compact`` refuses records without a key,
    so the marker has one, the same for every epoch of the pipeline (compaction keeps
    its latest). The mock neither compacts nor checks keys: the key is read back."""
    sink = KafkaSink(topic_name(), cluster.bootstrap_servers)
    commit(sink, 1)
    commit(sink, 2)
    assert [msg.key() for msg in markers(sink)] == [f"volley.marker/{PIPELINE}".encode()] * 2


def test_a_record_the_broker_refuses_as_invalid_stops_the_epoch_by_name(cluster):
    """Review K5: a broker answers INVALID_RECORD for a record without a key on a
    compacted topic (a pipeline's output without key columns); retrying cannot help, so
    the epoch fails with a permanent error that names the topic, the epoch and what to
    do. The mock checks no keys: its Produce answers are injected."""
    sink = KafkaSink(topic_name(), cluster.bootstrap_servers, timeout_s=10.0)
    commit(sink, 1)
    cluster.push_request_errors("Produce", [(KafkaError.INVALID_RECORD, 0)] * 100, broker_id=None)
    try:
        with pytest.raises(ConfigError, match=rf"epoch 2 .*{sink.topic}.*INVALID_RECORD.*cleanup.policy=compact") as exc:
            commit(sink, 2)
    finally:
        cluster.clear_request_errors("Produce")
    assert not is_retryable(exc.value)
    assert sink.committed_epoch(PIPELINE) == 1


def test_the_sink_check_reads_back_only_to_the_epochs_it_checks(cluster, monkeypatch):
    """Review K3: ``history_from`` (what the sink check reads after every run) reads
    partition 0 back from its end and stops below the first epoch asked for, instead
    of reading the whole partition: at most twice the offsets it needs, plus the first
    window (made small here, so that a few small epochs span many windows). A spy
    counts the records the sink reads."""
    monkeypatch.setattr(kafka_sink, "SCAN_BACK", 100)
    sink = KafkaSink(topic_name(), cluster.bootstrap_servers)
    for epoch in range(1, 21):
        commit(sink, epoch)
    offsets = marker_offsets(sink)
    end = offsets[20] + 2  # the marker, then the transaction's commit marker
    read: list[int] = []
    scan = KafkaSink._scan

    def counted(self: KafkaSink, *args: Any) -> Iterator[Any]:
        for msg in scan(self, *args):
            read.append(msg.offset())
            yield msg

    monkeypatch.setattr(KafkaSink, "_scan", counted)
    history = sink.history_from(PIPELINE, 19)
    assert [c.mark.epoch for c in history.commits] == [19, 20] and history.complete
    needed = end - offsets[18]  # back to the first marker below epoch 19
    assert len(read) <= 2 * needed + 100 and len(read) < end / 2, f"read {len(read)} of {end} offsets"
    history = sink.history_from(PIPELINE, 1)
    assert [c.mark.epoch for c in history.commits] == list(range(1, 21)) and history.complete
    assert [c.rows for c in history.commits] == [ROWS] * 20


def test_history_after_retention_begins_at_the_oldest_marker_left(cluster):
    """Review K3: once retention removed the oldest epochs' markers, ``history_from``
    says where the history it holds begins (``complete`` is false)."""
    sink = KafkaSink(topic_name(), cluster.bootstrap_servers)
    for epoch in range(1, 5):
        commit(sink, epoch)
    cluster.delete_records(sink.topic, 0, marker_offsets(sink)[2] + 1)
    history = sink.history_from(PIPELINE, 1)
    assert [c.mark.epoch for c in history.commits] == [3, 4] and not history.complete
    assert sink.history_from(PIPELINE, 4).complete


# -- through the committer, with the epoch log -----------------------------------------


def committer_for(tmp_path: Path, sink: KafkaSink) -> tuple[SinkCommitter, EpochLog]:
    pipeline = (Pipeline(PIPELINE).source(FileLog(tmp_path / "events")).key_by("merchant_id")
                .aggregate(total=sum_("total")).sink(sink))
    log = EpochLog(tmp_path / "root")
    log.check_identity({"pipeline": PIPELINE, "layout": {"num_shards": 1}})
    return SinkCommitter(pipeline, log, lambda what: None), log


def run_epoch(committer: SinkCommitter, epoch: int, manifest: bool = True) -> dict[str, Any]:
    """The sinks' commit of ``epoch`` and, unless the run dies before it, its manifest."""
    rng = EpochRange(epoch, {"p": Offset(epoch - 1)}, {"p": Offset(epoch)})
    results = committer.commit(epoch_output(epoch, ROWS), rng)
    if manifest:
        assert committer.log.write_manifest(EpochResult(PIPELINE, epoch, {}, ROWS, ROWS, 0, ROWS, ROWS, 0, 0, 0, {},
                                                        results, {}))
    return {name: result.to_dict() for name, result in results.items()}


def test_the_committer_lets_the_kafka_sink_decide_after_init_transactions(cluster, tmp_path, monkeypatch):
    """Review K2: Kafka answered epoch 3's EndTxn, but its COMMIT marker has not reached
    partition 0 yet (its leader is moving): until then a reader's last stable offset
    is below epoch 3's marker. A new ``init_transactions`` of the same transactional id
    waits for that transaction to complete, so epoch 4 decides only after it, instead
    of reading epoch 2 first and refusing for good ("epochs 3..3 are missing"). The
    mock's last stable offset is always its end: the broker's answer is given, held
    back until the mock receives the next InitProducerId."""
    sink = KafkaSink(topic_name(), cluster.bootstrap_servers)
    committer, _ = committer_for(tmp_path, sink)
    for epoch in (1, 2, 3):
        run_epoch(committer, epoch)
    cluster.track_requests()
    hold_back_the_last_stable_offset(monkeypatch, sink, before=marker_offsets(sink)[3],
                                     until=lambda: "InitProducerId" in cluster.requests())
    assert run_epoch(committer, 4)["kafka"]["skipped"] is False
    monkeypatch.undo()
    assert sink.epoch_history(PIPELINE, committer.log.lineage()) == {e: [ROWS] for e in range(1, 5)}


def test_a_retry_whose_marks_are_all_gone_is_refused_by_name(cluster, tmp_path):
    """Review K4: epoch 3 committed to Kafka, and its run died before the manifest.
    Later retention removed partition 0's records and the group's offsets expired
    (``offsets.retention.minutes``; the mock stores none). The epoch log says the sink
    held epoch 2, so the retry refuses by name instead of writing epoch 3 again; once
    a person records what the topic holds, as the error says, the retry skips it."""
    sink = KafkaSink(topic_name(), cluster.bootstrap_servers)
    committer, log = committer_for(tmp_path, sink)
    run_epoch(committer, 1)
    run_epoch(committer, 2)
    run_epoch(committer, 3, manifest=False)
    cluster.delete_records(sink.topic, 0, max(marker_offsets(sink).values()) + 2)
    before = Counter(row["_epoch"] for row in sink.read(PIPELINE))
    with pytest.raises(SinkLineageError) as refused:
        run_epoch(committer, 3)
    message = str(refused.value)
    for named in (f"epoch 3 of pipeline {PIPELINE!r}", sink.topic, GROUP, "held epoch 2", "record_mark"):
        assert named in message, message
    assert Counter(row["_epoch"] for row in sink.read(PIPELINE)) == before
    lineage = log.lineage()
    rng = EpochRange(3, {"p": Offset(2)}, {"p": Offset(3)})
    sink.record_mark(PIPELINE, SinkMark(3, lineage.id, 3, rng.digest()))  # its records are in the topic
    assert run_epoch(committer, 3)["kafka"]["skipped"] is True
    assert run_epoch(committer, 4)["kafka"]["skipped"] is False
    assert Counter(row["_epoch"] for row in sink.read(PIPELINE)) == before + Counter({4: ROWS})


def test_a_choice_to_continue_another_lineages_epochs_is_recorded_before_the_sink_decides(cluster, tmp_path):
    """The committer still reads a Kafka sink's mark before the commit when the sink may
    meet another lineage's epochs (``on_foreign_lineage="continue"``), to record that
    choice; the sink then decides on its own read, and the epoch log's record of the
    sink epochs it held (epoch 2 follows sink epoch 3) is in the sink's numbers."""
    topic = topic_name()
    theirs, _ = committer_for(tmp_path / "theirs", KafkaSink(topic, cluster.bootstrap_servers))
    for epoch in (1, 2):
        run_epoch(theirs, epoch)
    sink = KafkaSink(topic, cluster.bootstrap_servers, on_foreign_lineage="continue")
    ours, log = committer_for(tmp_path / "ours", sink)
    first = run_epoch(ours, 1)["kafka"]
    assert first["skipped"] is False and first["sink_epoch"] == 3
    assert log.sink_binding("kafka") is not None
    assert run_epoch(ours, 2)["kafka"]["sink_epoch"] == 4
    assert sink.epoch_history(PIPELINE) == {e: [ROWS] for e in range(1, 5)}
    assert sink.epoch_history(PIPELINE, log.lineage()) == {1: [ROWS], 2: [ROWS]}
