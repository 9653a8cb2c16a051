"""A separate process that commits epochs to a sink, in step with its peers, so
tests can race real writers on the same epoch of the same table.

    python -m tests.sinks.commit_worker '<json spec>'

Spec: ``sink`` ("delta" | "iceberg"), ``kwargs`` for the sink, ``pipeline``,
``epochs``, ``rows``, ``sync`` (a directory), ``worker`` (this worker's id) and
``peers`` (how many workers meet before each epoch). Before every epoch each
worker drops a ready file and waits for all peers' files, then commits at once.
Prints one JSON list of the commit results.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from volley_dagster.sinks.base import CommitContext, Sink

KEYS = 500


def epoch_output(epoch: int, rows: int, keys: int = KEYS, seed: int = 11) -> pa.Table:
    """One epoch's output: ``rows`` distinct keys (drawn from ``keys``) with values
    that depend on the epoch, in key order (a stable, deterministic re-run)."""
    rng = np.random.default_rng(seed * 1_000_003 + epoch)
    key = np.sort(rng.choice(keys, size=min(rows, keys), replace=False)).astype(np.int64)
    n = len(key)
    return pa.table({
        "merchant_id": pa.array(key),
        "name": pa.array([f"m{k}" for k in key.tolist()], pa.string()),
        "total": pa.array(rng.normal(100.0, 20.0, n)),
        "events": pa.array(rng.integers(1, 50, n), pa.int64()),
        "last_seen": pa.array((1_700_000_000_000_000 + epoch * 1_000_000 + np.arange(n)).astype("datetime64[us]"),
                              pa.timestamp("us", tz="UTC")),
        "epoch": pa.array(np.full(n, epoch, dtype=np.int64)),
    })


def make_sink(kind: str, kwargs: dict[str, Any]) -> Sink:
    kwargs = dict(kwargs)
    if kind == "delta":
        from volley_dagster.sinks.delta import DeltaSink

        return DeltaSink(**kwargs)
    from volley_dagster.sinks.iceberg import IcebergSink

    return IcebergSink(**kwargs)


def _barrier(sync: Path, epoch: int, worker: int, peers: int, timeout: float = 60.0) -> None:
    (sync / f"ready-{epoch}-{worker}").touch()
    deadline = time.monotonic() + timeout
    while len(list(sync.glob(f"ready-{epoch}-*"))) < peers:
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker {worker}: peers did not reach epoch {epoch}")
        time.sleep(0.0005)


def main(spec: dict[str, Any]) -> list[dict[str, Any]]:
    sink = make_sink(spec["sink"], spec["kwargs"])
    outputs = {e: epoch_output(e, spec["rows"]) for e in spec["epochs"]}
    keys = tuple(spec.get("key_columns", ["merchant_id"]))
    results = []
    for epoch in spec["epochs"]:
        _barrier(Path(spec["sync"]), epoch, spec["worker"], spec["peers"])
        result = sink.commit(outputs[epoch], CommitContext(spec["pipeline"], epoch, keys))
        results.append({"epoch": epoch, "worker": spec["worker"], **result.to_dict()})
    return results


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1])), default=str))


def race(sink: str, kwargs: dict[str, Any], pipeline: str, epochs: list[int], rows: int, sync: Path,
         peers: int = 2, timeout: float = 120.0) -> list[dict[str, Any]]:
    """Run ``peers`` worker processes committing the same ``epochs`` to the same
    sink in lock step; every worker's results, in epoch order."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[2]
    sync.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    base = {"sink": sink, "kwargs": kwargs, "pipeline": pipeline, "epochs": epochs, "rows": rows,
            "sync": str(sync), "peers": peers}
    procs = [
        subprocess.Popen([sys.executable, "-m", "tests.sinks.commit_worker", json.dumps({**base, "worker": w})],
                         cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for w in range(peers)
    ]
    results: list[dict[str, Any]] = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"commit worker failed ({proc.returncode}):\n{err[-4000:]}")
        results.extend(json.loads(out.strip().splitlines()[-1]))
    return sorted(results, key=lambda r: (r["epoch"], r["worker"]))
