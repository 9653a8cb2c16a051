"""One attempt of a Kafka sink commit in a process of its own, so that a test can kill
it between the produce and the commit (``VOLLEY_KILL_AT=kafka_before_commit``), or hold
it after its decision, before the produce (``VOLLEY_PAUSE_DIR``, point
``kafka_before_produce``), as a crashed or stalled run would be.

    python -m tests.sinks.kafka_attempt '<json spec>'

Spec: ``bootstrap_servers``, ``topic``, ``pipeline``, ``epoch``, ``rows``. Prints the
commit's result as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.sinks.commit_worker import epoch_output
from volley_dagster.sinks.base import CommitContext
from volley_dagster.sinks.kafka import KafkaSink

KEY = ("merchant_id",)


def main(spec: dict[str, Any]) -> dict[str, Any]:
    sink = KafkaSink(spec["topic"], spec["bootstrap_servers"])
    result = sink.commit(epoch_output(spec["epoch"], spec["rows"]), CommitContext(spec["pipeline"], spec["epoch"], KEY))
    return result.to_dict()


def start(spec: dict[str, Any], env: dict[str, str]) -> subprocess.Popen[str]:
    """The attempt as a child process, with ``env`` added to this one's environment."""
    root = Path(__file__).resolve().parents[2]
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    return subprocess.Popen([sys.executable, "-m", "tests.sinks.kafka_attempt", json.dumps(spec)], cwd=root,
                            env={**os.environ, "PYTHONPATH": path, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1])), default=str))
