"""A Kafka cluster on 127.0.0.1 for tests and the demo: librdkafka's built-in mock
cluster (``test.mock.num.brokers``, inside ``confluent-kafka``), kept alive by a
process of its own. It speaks the Kafka protocol over real sockets, so the engine
talks to it as to any broker, from any process.

What the mock does not do (no Kafka broker installs from the registries here): it
auto-creates topics on first produce, with 4 partitions, and cannot create topics or
partitions through the admin API nor delete records (retention); and a
``read_committed`` consumer is handed the records of aborted transactions. Tests of
those cases test the engine's own handling of the offsets a broker reports
(``sources.kafka.plan_cut``); the broker-side filtering needs a real broker, which
changes only ``bootstrap_servers``.

    python -m harness.kafka [--brokers N]   # prints the bootstrap servers, runs until stdin closes
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass


@dataclass
class KafkaCluster:
    bootstrap_servers: str
    proc: subprocess.Popen[str]

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


def main() -> int:
    from confluent_kafka import Producer

    parser = argparse.ArgumentParser()
    parser.add_argument("--brokers", type=int, default=1)
    args = parser.parse_args()
    keeper = Producer({"test.mock.num.brokers": args.brokers, "log_level": 3})
    brokers = keeper.list_topics(timeout=10).brokers.values()
    print("bootstrap " + ",".join(f"{b.host}:{b.port}" for b in brokers), flush=True)
    sys.stdin.read()  # until the starter closes our stdin (or dies)
    return 0


if __name__ == "__main__":
    sys.exit(main())
