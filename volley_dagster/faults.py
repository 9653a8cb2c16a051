"""Named crash points for recovery tests: real ``kill -9`` at a chosen place.

Set ``VOLLEY_KILL_AT=<point>`` (or ``<point>:<shard>``) in a process's
environment and it SIGKILLs itself (or its driver, from a Spark task) when it
reaches that point. Unset, a fault point costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "VOLLEY_KILL_AT"

POINTS = (
    "shard_after_snapshot",  # inside the Spark stage: one shard snapshotted, others may not be
    "after_snapshot",  # every shard snapshotted, no sink written
    "after_sinks",  # every sink committed, no manifest
    "during_retention",  # manifest written, old snapshots half deleted
)


def fault_point(name: str, *, pid: int | None = None, shard: int | None = None) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    point, _, which = spec.partition(":")
    if point != name or (which and shard is not None and int(which) != shard):
        return
    os.kill(pid or os.getpid(), signal.SIGKILL)
