"""The Kafka sink commits each epoch once when the brokers answer late, when the
previous attempt's transaction completes while the next attempt starts, and when an
attempt is killed between the produce and the commit. Against librdkafka's mock
cluster (harness/kafka.py), a fresh one per test since some inject errors into it;
every read is under ``read_committed``."""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from confluent_kafka import KafkaError

from harness.kafka import KafkaCluster, start_kafka
from tests.sinks import kafka_attempt
from tests.sinks.commit_worker import epoch_output
from tests.sinks.helpers import PIPELINE, ROWS, ctx
from volley_dagster import SinkCommitError
from volley_dagster.sinks.kafka import BEFORE_COMMIT, BEFORE_PRODUCE, KafkaSink

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

