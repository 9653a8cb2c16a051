"""Named crash points for recovery tests: real ``kill -9`` at a chosen place.

Set ``VOLLEY_KILL_AT=<point>`` in a process's environment and it SIGKILLs
itself (or its driver, from a Spark task) when it reaches that point;
``VOLLEY_KILL_EPOCH`` and ``VOLLEY_KILL_SHARD`` narrow it to one epoch or
shard. Unset, a fault point costs one dictionary lookup.

Pause points (``fault_pause``) hold a task still instead, so a test can kill
something else while it waits, e.g. the cluster worker running it: the test
creates ``$VOLLEY_PAUSE_DIR/<point>-<epoch>-<shard>.armed``; the first task
attempt to reach that point claims it (a rename, so a retry of the task does
not pause again), publishes ``<point>-<epoch>-<shard>`` holding its pid, and
sleeps while that file exists (at most ``VOLLEY_PAUSE_MAX_S``, default 60 s).
The pause directory must be on storage the executors reach.
"""

from __future__ import annotations

import os
import signal
import time

ENV = "VOLLEY_KILL_AT"
EPOCH_ENV = "VOLLEY_KILL_EPOCH"
SHARD_ENV = "VOLLEY_KILL_SHARD"
PAUSE_DIR_ENV = "VOLLEY_PAUSE_DIR"
PAUSE_MAX_ENV = "VOLLEY_PAUSE_MAX_S"

POINTS = (
    "segment_read",  # inside the Spark stage: a read task kills the driver
    "shard_after_snapshot",  # inside the Spark stage: one shard snapshotted, others may not be
    "after_snapshot",  # every shard snapshotted, no sink written
    "after_sink_<name>",  # that sink committed; the others commit concurrently (pause them to hold them back)
    "after_sinks",  # every sink committed, no manifest
    "during_retention",  # manifest written, old snapshots half deleted
    "during_compaction",  # an archive of old epochs written, their folders not yet removed
    "rescale_after_shard",  # a rescale wrote some new shards, no layout record
    "rescale_before_commit",  # every new shard written, no layout record
    "rescale_after_commit",  # the layout record written, nothing after it
    "kafka_before_commit",  # a Kafka sink's epoch produced in its transaction, not committed
)
# Pause points (fault_pause): "shard_after_snapshot", "kafka_before_produce" (a Kafka sink
# decided to write the epoch, nothing produced yet), "before_sink_<name>" (that sink
# decided to commit the epoch, nothing written yet).


def fault_point(name: str, epoch: int, *, pid: int | None = None, shard: int | None = None) -> None:
    if os.environ.get(ENV) != name:
        return
    for env, value in ((EPOCH_ENV, epoch), (SHARD_ENV, shard)):
        wanted = os.environ.get(env)
        if wanted and value is not None and int(wanted) != value:
            return
    os.kill(pid or os.getpid(), signal.SIGKILL)


def fault_pause(name: str, epoch: int, shard: int | None = None) -> None:
    """Sleep here if a test armed this point (see the module docstring); once per arming."""
    pause_dir = os.environ.get(PAUSE_DIR_ENV)
    if not pause_dir:
        return
    marker = os.path.join(pause_dir, f"{name}-{epoch}-{shard}")
    claimed = f"{marker}.{os.getpid()}.claimed"
    try:
        os.rename(f"{marker}.armed", claimed)  # atomic: exactly one attempt claims it
    except FileNotFoundError:
        return
    with open(claimed, "w") as fh:
        fh.write(f"{os.getpid()}\n")
    os.replace(claimed, marker)  # appears whole, with the pid
    deadline = time.monotonic() + float(os.environ.get(PAUSE_MAX_ENV, "60"))
    while os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
