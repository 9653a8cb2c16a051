"""A Kafka cluster on 127.0.0.1 for tests and the demo: librdkafka's built-in mock
cluster (the one ``test.mock.num.brokers`` starts, inside ``confluent-kafka``), kept
alive by a process of its own. It speaks the Kafka protocol over real sockets, so the
engine talks to it as to any broker, from any process.

Tests can make its brokers answer requests with errors or late, one request at a time
(``KafkaCluster.push_request_errors``: librdkafka's ``rd_kafka_mock_*`` error stacks,
called through ctypes in the cluster's process, on the same librdkafka that
confluent-kafka loads): a commit whose reply comes after the client gave up, a
coordinator still busy with the previous transaction. They can also list the types of
the requests it received (``track_requests``, ``requests``) and remove a partition's
oldest records as retention does (``delete_records``).

What the mock does not do (no Kafka broker installs from the registries here): it
auto-creates topics on first produce, with 4 partitions, and cannot create topics or
partitions through the admin API, nor compact a topic or check its records' keys. A
``read_committed`` consumer is handed every record, those of aborted and of still open
transactions included, and the last stable offset is always the end offset.
``init_transactions`` gives a new producer id instead of bumping the epoch of the old
one, so it neither aborts a transaction that a killed producer left open (a broker
does) nor fences the old producer. It answers ``TxnOffsetCommit`` (a transaction's
``send_offsets_to_transaction``) but stores nothing, while it stores a plain
``OffsetCommit``. Tests of those cases test the engine's own handling of the answers a
broker gives (``sources.kafka.plan_cut``, the offsets a group holds), or replay the
broker's answers with injected errors; the broker-side behaviour needs a real broker,
which changes only ``bootstrap_servers``.

    python -m harness.kafka [--brokers N]   # prints the bootstrap servers, then serves
                                            # commands on stdin until it closes
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Kafka protocol request types (ApiKey) that tests inject errors into.
API_KEYS = {"Produce": 0, "Fetch": 1, "ListOffsets": 2, "Metadata": 3, "OffsetCommit": 8, "OffsetFetch": 9,
            "FindCoordinator": 10, "InitProducerId": 22, "AddPartitionsToTxn": 24, "AddOffsetsToTxn": 25,
            "EndTxn": 26, "TxnOffsetCommit": 28}
API_NAMES = {key: name for name, key in API_KEYS.items()}


@dataclass
class KafkaCluster:
    bootstrap_servers: str
    proc: subprocess.Popen[str]

    def push_request_errors(self, api: str, errors: Sequence[tuple[int, int]], broker_id: int | None = 1) -> None:
        """The next ``len(errors)`` requests of type ``api`` (a key of ``API_KEYS``) to
        broker ``broker_id`` (None: to any broker) are answered with ``(error code,
        delay in ms)`` each, in order; code 0 answers normally, only late. A broker acts
        on a request it answers without error at once: only the reply waits. Errors for
        any broker cannot be delayed, and ``clear_request_errors`` drops them."""
        pairs = " ".join(f"{code}:{rtt_ms}" for code, rtt_ms in errors)
        self._command(f"errors {API_KEYS[api]} {-1 if broker_id is None else broker_id} {pairs}")

    def clear_request_errors(self, api: str) -> None:
        """Forget the errors pushed for ``api`` to any broker that are still unused."""
        self._command(f"clear {API_KEYS[api]}")

    def track_requests(self) -> None:
        """From now on, record the type of every request the brokers receive (``requests``);
        what was recorded before is forgotten."""
        self._command("track")

    def requests(self) -> list[str]:
        """The types of the requests received since ``track_requests``, in order (a name of
        ``API_KEYS``, else ``ApiKey<n>``)."""
        keys = self._command("requests")
        return [API_NAMES.get(int(key), f"ApiKey{key}") for key in keys.split(",") if key]

    def delete_records(self, topic: str, partition: int, before_offset: int) -> None:
        """Remove the records of ``topic`` [``partition``] before ``before_offset``, which
        becomes its first offset, as a broker's retention (``retention.ms``,
        ``retention.bytes``) removes old segments."""
        self._command(f"delete {topic} {partition} {before_offset}")

    def _command(self, line: str) -> str:
        """Send one command; what the cluster's process answered after its "ok"."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().strip()
        if answer != "ok" and not answer.startswith("ok "):
            raise RuntimeError(f"the Kafka mock cluster refused {line!r}: {answer!r}")
        return answer[3:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def start_kafka(brokers: int = 1, timeout: float = 30.0) -> KafkaCluster:
    proc = subprocess.Popen([sys.executable, "-m", "harness.kafka", "--brokers", str(brokers)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line.startswith("bootstrap "):
        proc.kill()
        raise RuntimeError(f"the Kafka mock cluster did not start: {line!r} (is confluent-kafka installed?)")
    return KafkaCluster(line.split(" ", 1)[1], proc)


def _librdkafka() -> ctypes.CDLL:
    """The librdkafka that confluent-kafka's extension loaded (its wheel bundles one
    under a hashed name), found among this process's mappings."""
    import confluent_kafka.cimpl  # noqa: F401  (loads librdkafka)

    with open(f"/proc/{os.getpid()}/maps") as maps:
        paths = {line.split()[-1] for line in maps if "/librdkafka" in line}
    if not paths:
        raise RuntimeError("confluent-kafka's librdkafka is not mapped into this process")
    lib = ctypes.CDLL(sorted(paths)[0])
    lib.rd_kafka_conf_new.restype = ctypes.c_void_p
    lib.rd_kafka_conf_set.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.rd_kafka_new.restype = ctypes.c_void_p
    lib.rd_kafka_new.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.rd_kafka_handle_mock_cluster.restype = ctypes.c_void_p
    lib.rd_kafka_handle_mock_cluster.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_mock_cluster_bootstraps.restype = ctypes.c_char_p
    lib.rd_kafka_mock_cluster_bootstraps.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_mock_clear_request_errors.argtypes = [ctypes.c_void_p, ctypes.c_int16]
    lib.rd_kafka_mock_start_request_tracking.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_mock_get_requests.restype = ctypes.POINTER(ctypes.c_void_p)
    lib.rd_kafka_mock_get_requests.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
    lib.rd_kafka_mock_request_api_key.restype = ctypes.c_int16
    lib.rd_kafka_mock_request_api_key.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_mock_request_destroy_array.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    lib.rd_kafka_mock_partition_delete_records.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int32,
                                                           ctypes.c_int64]
    return lib


def _mock_cluster(lib: ctypes.CDLL, brokers: int) -> Any:
    """A producer handle whose configuration starts the mock cluster; its cluster."""
    err = ctypes.create_string_buffer(512)
    conf = lib.rd_kafka_conf_new()
    for key, value in (("test.mock.num.brokers", str(brokers)), ("log_level", "3")):
        if lib.rd_kafka_conf_set(conf, key.encode(), value.encode(), err, len(err)) != 0:
            raise RuntimeError(f"{key}={value}: {err.value.decode()}")
    rk = lib.rd_kafka_new(0, conf, err, len(err))  # RD_KAFKA_PRODUCER; rk keeps the cluster alive
    if not rk:
        raise RuntimeError(err.value.decode())
    cluster = lib.rd_kafka_handle_mock_cluster(rk)
    if not cluster:
        raise RuntimeError("librdkafka started no mock cluster")
    return cluster


def _serve(lib: ctypes.CDLL, cluster: Any, line: str) -> str:
    words = line.split()
    if words[0] == "errors":
        api, broker, pairs = int(words[1]), int(words[2]), [w.split(":") for w in words[3:]]
        args: list[Any] = []
        for code, rtt_ms in pairs:
            args += [ctypes.c_int(int(code)), ctypes.c_int(int(rtt_ms))]
        if broker < 0:  # any broker: no delays
            if any(int(rtt_ms) for _, rtt_ms in pairs):
                return "errors for any broker cannot be delayed"
            codes = (ctypes.c_int * len(pairs))(*(int(code) for code, _ in pairs))
            lib.rd_kafka_mock_push_request_errors_array(ctypes.c_void_p(cluster), ctypes.c_int16(api),
                                                        ctypes.c_size_t(len(pairs)), codes)
            return "ok"
        err = lib.rd_kafka_mock_broker_push_request_error_rtts(
            ctypes.c_void_p(cluster), ctypes.c_int32(broker), ctypes.c_int16(api), ctypes.c_size_t(len(pairs)), *args)
        return "ok" if err == 0 else f"error {err}"
    if words[0] == "clear":
        lib.rd_kafka_mock_clear_request_errors(cluster, int(words[1]))
        return "ok"
    if words[0] == "track":
        lib.rd_kafka_mock_start_request_tracking(cluster)  # also forgets what it recorded before
        return "ok"
    if words[0] == "requests":
        count = ctypes.c_size_t(0)
        requests = lib.rd_kafka_mock_get_requests(cluster, ctypes.byref(count))
        keys = [str(lib.rd_kafka_mock_request_api_key(requests[i])) for i in range(count.value)]
        lib.rd_kafka_mock_request_destroy_array(requests, count)
        return "ok " + ",".join(keys)
    if words[0] == "delete":
        err = lib.rd_kafka_mock_partition_delete_records(cluster, words[1].encode(), int(words[2]), int(words[3]))
        return "ok" if err == 0 else f"error {err}"
    return f"unknown command {words[0]!r}"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--brokers", type=int, default=1)
    args = parser.parse_args()
    lib = _librdkafka()
    cluster = _mock_cluster(lib, args.brokers)
    print("bootstrap " + lib.rd_kafka_mock_cluster_bootstraps(cluster).decode(), flush=True)
    for line in sys.stdin:  # until the starter closes our stdin (or dies)
        if line.strip():
            print(_serve(lib, cluster, line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
