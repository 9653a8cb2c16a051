"""One attempt of one epoch, in order (each step survives a crash at any point)::

    plan        the recorded range read and transformed, the operator resolved, the
                pipeline's identity checked, N-1's snapshots located and checked
    stage       each shard task restores N-1, folds the epoch in, flushes one
                WriteBatch and snapshots N (``spark/stage.py``)
    side        dead letters, late records, duplicates: one file each
    sinks       each sink commits unless it already holds the epoch (``sinks/committer.py``)
    commit      the manifest, written last and once: the commit point
    prune       retention of old snapshots, and of the attempts that lost
    compact     the committed snapshots handed to the driver's background compactor
                (``state/compactor.py``), which readies compacted copies for N+1

``status`` says how far the attempt got (as Quix Streams' ``PartitionTransaction``
does); one that raised keeps the step it failed in. An attempt reads what it starts
from once (``EpochStart``), and writes its outcome once (the manifest).
"""

from __future__ import annotations

import enum
import os
import time
from dataclasses import replace
from datetime import datetime, timezone

import pyarrow as pa
from pyspark.sql import SparkSession

from volley_dagster import faults
from volley_dagster.chain import StagesBefore
from volley_dagster.checkpoint.epoch_log import EpochLog, EpochStart
from volley_dagster.checkpoint.lease import PipelineLease
from volley_dagster.checkpoint.side_output_files import write_side_output
from volley_dagster.checkpoint.snapshots import SnapshotRef, locate
from volley_dagster.errors import (
    ConfigError,
    DimensionPinRejectedError,
    MalformedRecordError,
    StateLayoutError,
    VolleyError,
)
from volley_dagster.json_records import JsonObject
from volley_dagster.operators.base import PROCESSING_CLOCK, TIMERS_DUE_FROM, ShardStep, StatefulOperator
from volley_dagster.operators.ttl import next_due
from volley_dagster.pipeline import Pipeline
from volley_dagster.result import EpochResult
from volley_dagster.settings import RunSettings
from volley_dagster.sinks.base import SinkCommitResult
from volley_dagster.sinks.committer import SinkCommitter
from volley_dagster.sinks.staged_files import StagingTarget
from volley_dagster.sources.offsets import EpochRange
from volley_dagster.spark.jobs import counted_jobs
from volley_dagster.spark.plan import PlannedEpoch
from volley_dagster.spark.session import executors_share_this_disk
from volley_dagster.spark.stage import StageResult, plan_epoch, run_stage
from volley_dagster.spark.tasks import ShardMerge, attempt_id
from volley_dagster.state.compactor import CompactionJob, shared_compactor, worth_compacting

MAX_REASON_CHARS = 160  # a reason quotes the record's values: an error message carries a bounded part


class AttemptStatus(enum.Enum):
    """How far an attempt got: each value is the last step it finished."""

    STARTED = 0
    PLANNED = 1
    STAGED = 2
    SIDE_OUTPUTS_WRITTEN = 3
    SINKS_COMMITTED = 4
    COMMITTED = 5  # the manifest is written: the epoch is committed, by this attempt or another
    PRUNED = 6


class EpochAttempt:
    """``EpochAttempt(spark, pipeline, rng, start, log, settings, lease).run()``: one
    attempt of the epoch ``rng`` records, under ``lease``."""

    def __init__(self, spark: SparkSession, pipeline: Pipeline, rng: EpochRange, start: EpochStart, log: EpochLog,
                 settings: RunSettings, lease: PipelineLease, before: StagesBefore | None = None) -> None:
        """``before``: a chain's last stage (``chain.py``): what the stages before it did."""
        self.spark = spark
        self.before = before
        self.declared = pipeline  # its identity: ``with_shards`` names the first layout only
        layout = start.layout or pipeline.layout  # rescales record the layouts after the first
        self.pipeline = pipeline if layout == pipeline.layout else replace(pipeline, layout=layout)
        self.rng = rng
        self.start = start
        self.log = log
        self.settings = settings
        self.lease = lease
        self.status = AttemptStatus.STARTED
        self.failed = False
        self.durations: dict[str, float] = {}
        self.spark_jobs: int | None = None  # the plan's and the stage's Spark jobs (None: not counted)

    @property
    def epoch(self) -> int:
        return self.rng.epoch

    def run(self) -> EpochResult:
        """The epoch's result: this attempt's, or the one another attempt committed first."""
        t0 = time.perf_counter()
        try:
            with counted_jobs(self.spark, f"volley {self.pipeline.name} epoch {self.epoch}") as jobs:
                plan, merge = self.plan()
                self.status = AttemptStatus.PLANNED
                stage = self._stage(plan, merge)
                self.spark_jobs = jobs()
            self.status = AttemptStatus.STAGED
            t_sinks = time.perf_counter()
            paths = self._write_side_outputs(stage)
            self.status = AttemptStatus.SIDE_OUTPUTS_WRITTEN
            sinks = SinkCommitter(self.pipeline, self.log, self.lease.check).commit(stage.output, self.rng, stage.staged,
                                                                                   stage.rewritten)
            faults.fault_point("after_sinks", self.epoch)
            self.status = AttemptStatus.SINKS_COMMITTED
            t_commit = time.perf_counter()
            self.durations = {"read_transform": stage.read_transform_s, "pre_step": stage.pre_step_s,
                              "side_output": stage.side_output_s,
                              "state_stage": stage.state_stage_s,
                              **{f"{p}_shard_sum": sum(getattr(s, f"{p}_s") for s in stage.shards.values())
                                 for p in ("restore", "merge", "flush", "snapshot")},
                              "sinks": t_commit - t_sinks, "total": t_commit - t0}
            result = self._commit(self._result(stage, paths, sinks))
            self.status = AttemptStatus.COMMITTED
            self._prune()
            self.status = AttemptStatus.PRUNED
            self._compact_in_background(result)
            return result
        except BaseException:
            self.failed = True
            raise

    # -- the steps -------------------------------------------------------------------

    def plan(self) -> tuple[PlannedEpoch, ShardMerge]:
        """The first step: the driver's checks, the plan, and what each shard task gets
        (``run`` goes on from here; a test may stop after it)."""
        epoch, pipeline, rng, settings = self.epoch, self.pipeline, self.rng, self.settings
        _refuse_speculation(self.spark)
        pipeline.source_log.verify(rng)
        pins = self.start.pins
        try:
            plan = plan_epoch(self.spark, self.declared, rng, pins, self._checked_pins())
        except DimensionPinRejectedError as exc:  # every attempt fails on it alike: none produced output from it
            self.lease.check(f"epoch {epoch}: setting aside the pin of dimension table {exc.table!r}")
            self.log.drop_dimension_pin(epoch, exc.table, exc.version)
            raise
        self.log.check_identity(identity_of(self.declared, plan.state_operator, plan.key_kind))
        local = executors_share_this_disk(self.spark)  # a file a task writes is on this disk too
        merge = ShardMerge(
            step=self._step(plan),
            key_column=pipeline.key_column,
            output_keys=pipeline.output_keys(),
            operator=plan.state_operator,
            previous=self._previous_snapshots(),
            snapshot_root=str(self.log.snapshots_dir(epoch)),
            work_root=str(self.log.work_dir(epoch)),
            rocksdb=settings.rocksdb,
            scan_fraction=settings.scan_fraction,
            verify_checksums=settings.verify_checksums,
            driver_pid=os.getpid(),
            remote=settings.snapshot_store,
            cache_root=settings.snapshot_cache,
            resident=settings.resident_state,
            state_identity=f"{self.log.root.resolve()}|{pipeline.name}",
            fence=self.lease.fence,
            staging=staging_targets(pipeline, plan) if local else (),
            rows_folder=str(self.log.work_dir(epoch) / f"rows-{attempt_id()}") if local else "",
            checkpoint_root=str(self.log.root),
        )
        return plan, merge

    def _step(self, plan: PlannedEpoch) -> ShardStep:
        """What every shard task knows of the epoch: with its processing time, the cut's
        recorded wall clock, never before the previous epoch's (a clock stepped back)."""
        figures = self.start.previous.figures if self.start.previous is not None else {}
        before, now = figures.get(PROCESSING_CLOCK), self.rng.cut_at_us
        processing = now if before is None else before if now is None else max(now, before)
        return ShardStep(self.epoch, plan.key_kind, layout=self.pipeline.layout, processing_time=processing,
                         processing_time_before=before, due_from=figures.get(TIMERS_DUE_FROM))

    def _stage(self, plan: PlannedEpoch, merge: ShardMerge) -> StageResult:
        before = self.start.previous
        due = next_due([s.operator.figures for s in before.shards.values()]) if before is not None else None
        stage = run_stage(self.spark, self.pipeline, self.rng, plan, merge, self.start.watermarks,
                          self.rng.end_of_stream, due)
        if stage.side.dead_letters.num_rows and self.pipeline.bad_records == "fail":
            raise MalformedRecordError(_describe_bad(self.epoch, stage.side.dead_letters, self.pipeline.quote_bad_records))
        if sorted(stage.shards) != list(range(self.pipeline.layout.num_shards)):
            raise VolleyError(f"epoch {self.epoch}: shard results {sorted(stage.shards)} do not cover every shard")
        faults.fault_point("after_snapshot", self.epoch)
        return stage

    def _write_side_outputs(self, stage: StageResult) -> tuple[str | None, str | None, str | None]:
        """Dead letters, late records, duplicates: where each went (None: none)."""
        log, epoch = self.log, self.epoch
        return (write_side_output(log, stage.side.dead_letters, log.dead_letter_path(epoch)),
                write_side_output(log, stage.side.late, log.late_records_path(epoch)),
                write_side_output(log, stage.side.dropped, log.duplicates_path(epoch)))

    def _result(self, stage: StageResult, paths: tuple[str | None, str | None, str | None],
                sinks: dict[str, SinkCommitResult]) -> EpochResult:
        (dead_path, late_path, duplicates_path) = paths
        cut = self.before.source_range if self.before is not None else self.rng  # the epoch as cut from the source
        shards = {s: entry.relative_to(self.log.root) for s, entry in sorted(stage.shards.items())}
        return EpochResult(
            pipeline=self.pipeline.name,
            epoch=self.epoch,
            range=cut.summary(),
            records_in=cut.records,
            records_aggregated=sum(s.records for s in shards.values()),
            dead_letters=stage.side.dead_letters.num_rows,
            records_out=stage.output.num_rows,
            keys_touched=sum(s.keys_touched for s in shards.values()),
            new_keys=sum(s.new_keys for s in shards.values()),
            state_bytes=sum(s.snapshot.bytes_total for s in shards.values()),
            state_bytes_written=sum(s.bytes_new for s in shards.values()),
            shards=shards,
            sinks=sinks,
            durations=self.durations,
            watermark=stage.watermark,
            input_watermarks=stage.input_watermarks,
            late_records=stage.side.late.num_rows if stage.side.late is not None else 0,
            figures=self._figures(stage),
            end_of_stream=self.rng.end_of_stream,
            committed_at=datetime.now(timezone.utc).isoformat(),
            fencing_token=self.lease.fence.token,
            enrichments=stage.enrichments,
            output=stage.output,
            dead_letter_path=dead_path,
            late_records_path=late_path,
            duplicates_path=duplicates_path,
        )

    def _figures(self, stage: StageResult) -> dict[str, int]:
        """The operator's figures, the Spark jobs the attempt ran, and in a chain's last
        stage each stage's before it (``stage<k>_...``) and the jobs of all of them."""
        figures = {**(self.before.figures if self.before is not None else {}), **stage.figures}
        if self.spark_jobs is not None:
            figures["spark_jobs"] = self.spark_jobs
            if self.before is not None:
                figures["chain_spark_jobs"] = self.spark_jobs + sum(
                    n for name, n in self.before.figures.items() if name.endswith("_spark_jobs"))
        return figures

    def _commit(self, result: EpochResult) -> EpochResult:
        """The manifest, written once; another attempt's when it committed first."""
        self.lease.check(f"epoch {self.epoch}: writing its manifest")
        if not self.log.write_manifest(result, self.pipeline.layout):
            return self.log.committed_manifest(self.epoch)
        self.pipeline.source_log.committed(self.rng)
        return result

    def _prune(self) -> None:
        """Retention after the commit: old epochs, and the attempts that lost."""
        self.lease.check(f"pruning after epoch {self.epoch}")
        self.log.prune(self.epoch, self.settings.keep_epochs)
        store = self.settings.snapshot_store
        if store is not None:  # from the root's manifests at prune time, fenced before each delete
            store.retain_committed(self.log, self.epoch, self.settings.keep_epochs, before_delete=self.lease.check)

    def _compact_in_background(self, result: EpochResult) -> None:
        """Each committed shard snapshot with level-0 files to fold, to the compactor."""
        options = self.settings.rocksdb
        if not options.compact_in_background:
            return
        root, moot_once = self.log.root, str(self.log.epoch_dir(self.epoch + 1) / "manifest.json")
        shared_compactor().submit([
            CompactionJob(str(root), self.epoch, shard, str(root / entry.snapshot.path), entry.snapshot.files, options,
                          moot_once)
            for shard, entry in sorted(result.shards.items()) if worth_compacting(entry.snapshot.files)])

    # -- what the plan starts from ---------------------------------------------------

    def _checked_pins(self) -> frozenset[str]:
        """Tables whose pinned version the previous epoch read on the same key: the key's
        uniqueness was checked then."""
        read = self.start.previous.enrichments if self.start.previous is not None else {}
        return frozenset(step.name for step in self.pipeline.enrichments
                         if step.name in read and read[step.name].same_pin(self.start.pins[step.name], step.on))

    def _previous_snapshots(self) -> dict[int, SnapshotRef]:
        """N-1's snapshots, checked here so a missing or corrupt one fails before Spark starts work."""
        if self.epoch == 1:
            return {}
        shards, layout = self.start.shards, self.pipeline.layout
        if sorted(shards) != list(range(layout.num_shards)):
            raise StateLayoutError(
                f"epoch {self.epoch - 1}'s state has {len(shards)} shards, epoch {self.epoch} runs with "
                f"{layout.num_shards} ({self.log.describe_layouts()}): an epoch and a rescale were committed "
                "concurrently; restore the checkpoint root from a copy or remove the conflicting layouts/ record"
            )
        return locate(self.log.root, self.epoch - 1, shards, self.settings.snapshot_store,
                      verify=self.settings.verify_checksums, retained=self.log.retained_snapshots)


def identity_of(pipeline: Pipeline, operator: StatefulOperator, key_kind: str) -> JsonObject:
    """What a checkpoint root records of the pipeline that writes it (``pipeline.json``)."""
    return {
        "pipeline": pipeline.name,
        "key_column": pipeline.key_column,
        "key_kind": key_kind,
        "layout": pipeline.layout.to_dict(),
        "aggregate": operator.layout(),
    }


def _describe_bad(epoch: int, dead: pa.Table, quote: bool) -> str:
    """``quote=False``: a reason's kind only (the text before its first colon)."""
    rows = dead.slice(0, 3).to_pylist()
    reasons = [_bounded(r["reason"]) if quote else r["reason"].split(":", 1)[0] + " (details withheld)" for r in rows]
    first = "; ".join(f"{r['file']} record {r['offset']}: {reason}" for r, reason in zip(rows, reasons, strict=True))
    more = f" (and {dead.num_rows - len(rows)} more)" if dead.num_rows > len(rows) else ""
    return (
        f"epoch {epoch}: {dead.num_rows} malformed record(s): {first}{more}. Nothing was committed; "
        "fix the source or use .on_bad_records('dead_letter') to route them to the dead-letter output"
    )


def _bounded(text: str) -> str:
    return text if len(text) <= MAX_REASON_CHARS else f"{text[:MAX_REASON_CHARS]}... ({len(text)} characters)"


def staging_targets(pipeline: Pipeline, plan: PlannedEpoch) -> tuple[StagingTarget, ...]:
    """Where the shard tasks of a local Spark (whose executors share this disk) write the
    epoch's rows themselves, when their rows are what the sinks take: into every sink's
    folder when each has one (``Sink.staging_folder``), and the driver reads them back
    from there; else, when each task's rows hold each of its keys once, into the upsert
    tables whose files are laid out by shard (``Sink.rewrite_target``), and the rows
    come to the driver too (``ShardMerge.rows_folder``); else nowhere."""
    operator = plan.operator
    folders = [(sink.name, sink.staging_folder()) for sink in pipeline.sinks]
    appends = bool(folders) and all(folder is not None for _, folder in folders)
    if not operator.rows_are_sink_rows or not (appends or operator.one_row_per_key):
        return ()
    if appends:
        return tuple(StagingTarget(name, folder) for name, folder in folders if folder is not None)
    targets = (sink.rewrite_target(pipeline.layout, pipeline.key_column, pipeline.expiry_column())
               for sink in pipeline.sinks)
    return tuple(target for target in targets if target is not None)


def _refuse_speculation(spark: SparkSession) -> None:
    """A speculative copy of a shard task would be a second attempt on purpose; attempts
    cannot overwrite each other, but nothing is gained, so the setting is refused."""
    try:
        speculation = spark.conf.get("spark.speculation", "false")
    except Exception:  # Spark Connect may not expose every static setting
        return
    if str(speculation).lower() == "true":
        raise ConfigError(
            "spark.speculation=true is not supported: a shard task restores, writes and snapshots RocksDB state, "
            "so a speculative copy only doubles that work; set spark.speculation=false for volley pipelines"
        )
