"""How a pipeline is deployed: what an orchestrator needs beyond the pipeline
itself (when to cut epochs). The Dagster code location reads these."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from volley_dagster.pipeline import Pipeline
from volley_dagster.recovery import Backoff
from volley_dagster.sinks.lineage import ForeignLineage

# the derived freshness bound: three cadences (a cut, a failed run, its retry), and two
# minutes for a run to start, process and commit
CADENCES_OF_SLACK = 3
RUN_ALLOWANCE_S = 120.0


@dataclass(frozen=True)
class TableSettings:
    """Where sinks put their tables; built from the orchestrator's resources."""

    warehouse: str
    iceberg_catalog: dict[str, str] | None = None
    delta_storage_options: dict[str, str] | None = None
    on_foreign_lineage: ForeignLineage = "fail"  # tables holding another checkpoint lineage's epochs


@dataclass(frozen=True)
class AssetSettings:
    """How the pipeline's assets sit in a team's Dagster project: every key under
    ``key_prefix`` (``[*key_prefix, <pipeline>, "state"]``), with the team's owners
    (``"team:payments"`` or an email), tags and code version on every asset."""

    key_prefix: tuple[str, ...] = ()
    owners: tuple[str, ...] = ()
    tags: dict[str, str] = field(default_factory=dict)
    code_version: str | None = None


@dataclass(frozen=True)
class Deployment:
    """``build`` makes the pipeline for a table location. The sensor cuts an epoch
    once ``min_records`` are waiting, or any are and the oldest waited ``max_wait_s``;
    ``cron`` adds a schedule (off unless ``schedule_running``). The sensor runs as soon
    as the code location loads (``sensor_running``), so a pipeline runs when files land,
    as a deployed streaming job does; False leaves it to a person to start in the UI,
    Dagster's default for sensors. The freshness check
    fails once a record has waited more than ``freshness_bound_s`` to be committed;
    unset, the bound follows the cadence (``freshness_bound``).
    The sensor's daemon loops every 5 s: an interval under 5 s means every loop.
    ``state_preview_by`` names an output column: each epoch's state materialization
    then previews the top keys by it (one Spark job over the state: off by default).
    ``backoff``: how long the sensor and schedule wait before requesting an epoch
    whose runs failed transiently again (``volley_dagster/recovery.py``).
    History kept in the Dagster instance, so that a tick and the UI cost the same at
    any age of the pipeline: the last ``partitions_kept`` committed epochs stay
    partitions (older ones are removed; the epoch log and the tables keep their
    history), and the pipeline's ended runs created before the newest removed epoch
    committed are deleted with them."""

    name: str
    build: Callable[[TableSettings], Pipeline]
    min_records: int = 1
    max_wait_s: float | None = None
    cron: str | None = None
    sensor_running: bool = True
    schedule_running: bool = False
    sensor_interval_s: int = 30
    freshness_bound_s: float | None = None
    state_preview_by: str | None = None  # the state asset shows its top keys by this output column
    backoff: Backoff = Backoff()
    assets: AssetSettings = AssetSettings()
    partitions_kept: int = 1_000  # committed epochs kept as dynamic partitions: the UI's partition page costs the same at any age

    def freshness_bound(self, cron_period_s: float | None = None) -> float:
        """``freshness_bound_s``, or, unset, what the cadence promises: a record waits
        at most one cadence to be cut (the sensor's interval plus ``max_wait_s``; the
        schedule's period, ``cron_period_s``, when the schedule runs; the shorter when
        both do), and the bound allows ``CADENCES_OF_SLACK`` of them plus
        ``RUN_ALLOWANCE_S`` for the run."""
        if self.freshness_bound_s is not None:
            return self.freshness_bound_s
        cadences = []
        if self.sensor_running or not (self.cron and self.schedule_running):
            cadences.append(self.sensor_interval_s + (self.max_wait_s or 0.0))
        if self.cron and self.schedule_running and cron_period_s is not None:
            cadences.append(cron_period_s)
        return CADENCES_OF_SLACK * min(cadences) + RUN_ALLOWANCE_S
