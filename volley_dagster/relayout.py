"""Changing the layout of a pipeline's state between epochs, under its lease: a rescale
(another shard count, ``checkpoint/rescale.py``) or a migration (another operator,
``checkpoint/migrate.py``). Both rewrite the last committed epoch's state; the epochs
after it run with the new layout."""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from volley_dagster.attempt import identity_of
from volley_dagster.checkpoint.migrate import MigrationResult
from volley_dagster.checkpoint.migrate import migrate as migrate_state
from volley_dagster.checkpoint.rescale import RescaleResult
from volley_dagster.checkpoint.rescale import rescale as rescale_state
from volley_dagster.errors import ConfigError, EpochOrderError
from volley_dagster.pipeline import Pipeline
from volley_dagster.sinks.committer import SinkCommitter
from volley_dagster.spark.plan import plan_epoch

if TYPE_CHECKING:
    from volley_dagster.runner import EpochRunner  # the runner calls these


def rescale(runner: EpochRunner, num_shards: int) -> RescaleResult:
    """Rewrite the last committed epoch's state into ``num_shards`` shards; the epochs
    after it run with them (needs no Spark), those cut but not committed too (a sensor
    keeps cutting while a rescale waits for the lease), unless a sink already holds
    one. The current shard count is a no-op. A chain (``chain.py``): every stage."""
    log, settings = runner.log, runner.settings
    with runner.lease() as lease:
        for stage in runner.stage_runners():
            rescale(stage, num_shards)
        SinkCommitter(runner.pipeline, log, lease.check).refuse_held_uncommitted(log.last_committed())
        return rescale_state(log, num_shards, lease, settings.rocksdb, settings.verify_checksums, uncommitted_ok=True,
                             store=settings.snapshot_store)


def migrate(runner: EpochRunner, pipeline: Pipeline, renames: Mapping[str, str] | None,
            initial: Mapping[str, float | None] | None, num_shards: int | None) -> MigrationResult:
    """Rewrite the last committed epoch's state into ``pipeline``'s layout (added,
    removed or renamed accumulators, a window's allowed lateness, and the shard count
    with it). ``renames`` maps old accumulator names to new ones; ``initial`` gives an
    added ``sum_`` 0 instead of null. Refused, naming the options, for changes state
    cannot follow. Epochs cut but not committed (a sensor cut them, and their runs
    failed on the changed pipeline) run with the new pipeline, unless a sink already
    holds one (an attempt crashed after committing it): then it is refused until that
    epoch is run with the recorded pipeline."""
    if runner.pipeline.upstream is not None or pipeline.upstream is not None:
        raise ConfigError(f"pipeline {runner.pipeline.name!r}: a chain of stateful operators cannot be migrated yet; "
                          "rescale it, or start the changed chain on a new checkpoint root")
    pipeline.validate()
    log, settings = runner.log, runner.settings
    if pipeline.name != runner.pipeline.name:
        raise ConfigError(f"migrate: pipeline {pipeline.name!r} is not {runner.pipeline.name!r}, whose state "
                          f"{log.root} holds")
    with runner.lease() as lease:
        committed = log.last_committed()
        if committed == 0:
            raise EpochOrderError(f"nothing to migrate in {log.root}: no epoch is committed; run the new pipeline")
        SinkCommitter(runner.pipeline, log, lease.check).refuse_held_uncommitted(committed)
        # planned, not run: resolves the new operator against the source's columns
        plan = plan_epoch(runner.spark, pipeline, log.offsets(committed))
        return migrate_state(log, identity_of(pipeline, plan.state_operator, plan.key_kind), lease, renames, initial,
                             num_shards, settings.rocksdb, settings.verify_checksums, uncommitted_ok=True,
                             store=settings.snapshot_store)
