"""Is a run's worker process alive? Shared by the launcher's health check (run
monitoring) and the sensor's watchdog (volley_dagster/dagster/runs.py), whichever launched the run."""

from __future__ import annotations

import time
from typing import Optional

from dagster import DagsterEventType, DagsterInstance, RunRecord

from volley_dagster.process import process_start


def run_worker_pid(instance: DagsterInstance, run_id: str) -> Optional[int]:
    """The pid the run worker reports in its first engine events ("Started process for
    run", "Executing steps in process")."""
    records = instance.get_records_for_run(run_id, of_type=DagsterEventType.ENGINE_EVENT, limit=50).records
    for record in records:
        event = record.event_log_entry.dagster_event
        metadata = (event.engine_event_data.metadata or {}) if event is not None and event.engine_event_data else {}
        pid = metadata["pid"].value if "pid" in metadata else None  # Dagster reports it as text
        if isinstance(pid, (str, int)) and str(pid).isdigit():
            return int(pid)
    return None


def worker_gone(instance: DagsterInstance, record: RunRecord) -> Optional[str]:
    """Why the run's worker is known dead (its pid names no process, or one started
    outside the run's lifetime: a reused pid), or None while it lives, has not said its
    pid yet, or its start time cannot be read (unknown is never dead)."""
    pid = run_worker_pid(instance, record.dagster_run.run_id)
    if pid is None:
        return None
    start = process_start(pid)
    latest = (record.start_time or time.time()) + 1
    if start.exists and (start.at is None or record.create_timestamp.timestamp() - 1 <= start.at <= latest):
        return None
    return f"the run's process {pid} is gone (killed, or the machine restarted)"
