"""Named crash points for recovery tests: real ``kill -9`` at a chosen place.

Set ``VOLLEY_KILL_AT=<point>`` in a process's environment and it SIGKILLs
itself (or its driver, from a Spark task) when it reaches that point;
``VOLLEY_KILL_EPOCH`` and ``VOLLEY_KILL_SHARD`` narrow it to one epoch or
shard. Unset, a fault point costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "VOLLEY_KILL_AT"
EPOCH_ENV = "VOLLEY_KILL_EPOCH"
SHARD_ENV = "VOLLEY_KILL_SHARD"

POINTS = (
    "segment_read",  # inside the Spark stage: a read task kills the driver
    "shard_after_snapshot",  # inside the Spark stage: one shard snapshotted, others may not be
    "after_snapshot",  # every shard snapshotted, no sink written
    "after_sink_<name>",  # that sink committed, the ones after it not yet
    "after_sinks",  # every sink committed, no manifest
    "during_retention",  # manifest written, old snapshots half deleted
)


def fault_point(name: str, epoch: int, *, pid: int | None = None, shard: int | None = None) -> None:
    if os.environ.get(ENV) != name:
        return
    for env, value in ((EPOCH_ENV, epoch), (SHARD_ENV, shard)):
        wanted = os.environ.get(env)
        if wanted and value is not None and int(wanted) != value:
            return
    os.kill(pid or os.getpid(), signal.SIGKILL)
