"""One epoch's Spark work, composed once, in order: the plan (``spark/plan.py``) ->
valid rows (``spark/side_outputs.py``) -> [the plan's pre-step: a deduplication's probe
job, ``spark/dedup.py``, which observes the epoch's latest event time and its bad records
as it reads; what it drops is left out. Before an operator with no event time the probe
runs in the state stage's job instead (``probes_in_stage``), which observes them, and
the side-output job looks after it] -> the operator's ``assign`` -> the side-output
job (bad records, late rows, the epoch's latest event time; after a pre-step, only for
bad records or late rows) -> the operator's ``shard_input`` -> the epoch's one exchange
to the shards (``spark/partitioning.py``) -> the operator's ``partials`` in the JVM ->
one Python call per shard, ``per_shard`` (state merge, firing, snapshot:
``spark/tasks.py``) -> the operator's ``sink_output``, and the side outputs resolved
together.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark import StorageLevel
from pyspark.sql import SparkSession

from volley_dagster import columns
from volley_dagster.checkpoint.manifest import ShardEntry, ShardSnapshot
from volley_dagster.dimensions.base import EnrichmentRead
from volley_dagster.errors import VolleyError
from volley_dagster.operators.base import (
    PROCESSING_CLOCK,
    TIMERS_DUE_FROM,
    OperatorStats,
    PreStepRun,
    ShardStep,
    StageClock,
    latest_event,
    summed,
)
from volley_dagster.operators.dedup import DEDUP_FIGURES
from volley_dagster.operators.ttl import NEXT_DUE
from volley_dagster.pipeline import Pipeline
from volley_dagster.sinks.shard_files import RewrittenFiles, collected
from volley_dagster.sinks.staged_files import StagedFile, StagingTarget
from volley_dagster.sources.offsets import EpochRange
from volley_dagster.spark.dedup import DuplicateProbe, probe_in_stage
from volley_dagster.spark.partitioning import per_shard, route_to_shards
from volley_dagster.spark.plan import PlannedEpoch, plan_epoch
from volley_dagster.spark.side_outputs import EpochSideOutputs, SideOutputs
from volley_dagster.spark.task_errors import engine_errors, records_located
from volley_dagster.spark.tasks import (
    ShardMerge,
    TaskFiles,
    attempt_id,
    read_rows,
    snapshot_name,
    snapshot_upload,
    split_task_output,
    task_files,
)
from volley_dagster.state.store import SnapshotInfo, carry_forward
from volley_dagster.watermarks import Watermarks

__all__ = ["PlannedEpoch", "StageResult", "plan_epoch", "run_stage"]
_NO_WATERMARK = Watermarks()
_log = logging.getLogger(__name__)

@dataclass
class StageResult:
    output: pa.Table
    side: SideOutputs
    shards: dict[int, ShardEntry]
    read_transform_s: float
    state_stage_s: float
    watermark: int | None = None  # windows, event-time TTL: after this epoch, microseconds
    input_watermarks: dict[str, int] = field(default_factory=dict)  # a join: each side's (``Watermarks``)
    enrichments: dict[str, EnrichmentRead] = field(default_factory=dict)  # per enrichment: version, unmatched records
    figures: dict[str, int] = field(default_factory=dict)  # the operator's (``epoch_figures``)
    pre_step_s: float = 0.0  # of ``read_transform_s``: the plan's pre-step job (a deduplication's probe)
    side_output_s: float = 0.0  # of ``read_transform_s``: the side-output job (0: none ran)
    staged: dict[str, tuple[StagedFile, ...]] = field(default_factory=dict)  # per sink: ``output`` as the tasks wrote it
    rewritten: dict[str, RewrittenFiles] = field(default_factory=dict)  # per upsert sink: its files as the tasks rewrote them


@contextmanager
def _inputs_unchanged(pipeline: Pipeline, rng: EpochRange, plan: PlannedEpoch) -> Iterator[None]:
    """Spark's own Parquet scans cannot check, as the Python reader does, that a file
    is the one the epoch was cut from, or the one a dimension table's pin names; so the
    driver checks after the read (and when the read failed, whether a changed file is why)."""
    def verify() -> None:
        if not plan.may_have_bad_records:  # the Python reader checks each segment itself
            pipeline.source_log.verify(rng)
        for run in plan.enrichments:
            run.enrichment.table.verify(run.pin)

    try:
        yield
    except Exception:
        verify()
        raise
    verify()


def run_stage(
    spark: SparkSession,
    pipeline: Pipeline,
    rng: EpochRange,
    plan: PlannedEpoch,
    merge: ShardMerge,
    watermarks: Watermarks = _NO_WATERMARK,
    end_of_stream: bool = False,
    expiry_next: int | None = None,
) -> StageResult:
    """``watermarks``: what the epoch starts from (event time); ``expiry_next``: the
    earliest TTL deadline the previous epoch left (an epoch with ``ttl_epochs``, an
    event time on event time; None: unknown). Each
    step takes the frame the previous one returned; the stage never asks which
    operator it has."""
    layout, operator, clock = pipeline.layout, plan.operator, plan.event_time
    watermark = watermarks.value
    nothing_due = not operator.runs_without_records or (expiry_next is not None and expiry_next > merge.step.epoch)
    if clock is not None and clock.handed and clock.advance(watermark, None) != watermark:
        nothing_due = False  # a chain's stage before moved the watermark: what it closes is due
    # the stream's end runs every operator's shard tasks: a join's waiting rows leave then
    if not rng.segments and nothing_due and not end_of_stream and len(merge.previous) == layout.num_shards:
        carried = _carry_forward_stage(spark, pipeline, rng, plan, merge, expiry_next)
        return replace(carried, watermark=watermark, input_watermarks=watermarks.inputs)
    bound = clock.event_time_bound(watermark, rng.cut_at_us) if clock is not None else None
    side = EpochSideOutputs(plan, pipeline, rng, watermark, bound)
    # A Python-decoded read is cached for the side-output job and the state stage to
    # share; a native Parquet scan is cheaper to run twice (each job reads only the
    # columns it needs) than to cache whole.
    cached = plan.may_have_bad_records
    if cached:
        plan.raw.persist(StorageLevel.MEMORY_AND_DISK)
    pre: PreStepRun | None = None
    pre_step_s = 0.0
    try:
        t0 = time.perf_counter()
        ends, kept = watermarks, None
        probed_here = plan.probes_in_stage
        if plan.single_job:  # null keys ride along: they fold into one partial row, counted per shard
            assigned = operator.assign(plan.keyed)
            epoch_clock, step = StageClock(end_of_stream=end_of_stream), merge.step
        elif probed_here:  # the job finds the bad records and W[N] as it reads, for after it
            assert plan.dedup is not None
            probe = DuplicateProbe.of(plan.dedup, watermark, merge)
            assigned = operator.assign(probe_in_stage(side.observed_rows(), plan.dedup, layout, probe,
                                                     operator.input_columns()))
            epoch_clock = StageClock(watermark, None, end_of_stream)
            # the shard tasks forget by W[N-1] advanced by the probes' tallies (``ProbeTally``)
            step = replace(merge.step, watermark_before=watermark, watermark=watermark)
        else:
            rows = side.valid_rows()
            if plan.pre_step is not None:  # what it drops never reaches the operator, late records or state
                t_pre = time.perf_counter()
                pre = plan.pre_step.run(side.observed_rows(), layout, watermark, merge)
                rows, kept = pre.remaining(rows), pre.routed()
                pre_step_s = time.perf_counter() - t_pre
            assigned = operator.assign(rows)
            side.find(operator.late(assigned, watermark), operator.late_bound(watermark), expiry_next)
            if side.bad_records and pipeline.bad_records == "fail":
                return StageResult(pa.table({}), side.resolve(), {}, time.perf_counter() - t0, 0.0)
            if clock is not None:
                ends = clock.advance_all(watermarks, side.maxima)
            epoch_clock = StageClock(watermark, ends.value, end_of_stream)
            step = replace(merge.step, watermark_before=watermark, watermark=ends.value)
        routed, step = operator.shard_input(assigned, epoch_clock, step)
        partials = operator.partials(route_to_shards(routed, layout, kept, kept_inline=probed_here))
        merge = replace(merge, step=step)
        t1 = time.perf_counter()
        out_schema = ", ".join(_output_ddl(pipeline, plan) + [f"`{columns.STATS}` string"])
        with records_located(rng), engine_errors(), _inputs_unchanged(pipeline, rng, plan):
            out = per_shard(partials, merge, out_schema).toArrow()
        t2 = time.perf_counter()
        stats, rows = split_task_output(out)
        stats, files = task_files(stats)
        if files.staged:
            rows = read_staged(rows.schema, merge.staging, files.staged)
        elif files.rows:
            rows = read_rows(rows.schema, Path(merge.rows_folder), files.rows)
        shards = shard_entries(stats, rng.epoch)
        output, dropped = operator.sink_output(rows, rng)
        figures = operator.epoch_figures([entry.operator for entry in shards.values()])
        if probed_here:
            ends = _after_probing_here(side, shards, watermarks, plan, expiry_next, rng.epoch)
            figures.update(summed([entry.operator for entry in shards.values()], DEDUP_FIGURES))
        if side.maxima_from_shards:  # they ran at W[N-1], acting as at any W[N] the footers allowed
            assert clock is not None
            side.learn_maxima(latest_event([entry.operator for entry in shards.values()]))
            ends = clock.advance_all(watermarks, side.maxima)
        if pre is not None:  # it dropped its records before the shard tasks
            figures.update(pre.figures)
            dropped = pre.dropped(rng)
        outputs = side.resolve(sum(s.null_key_records for s in shards.values()), dropped)
    finally:
        if merge.rows_folder:  # read, or of a failed attempt: a crash's leftovers go with the epoch's work/
            shutil.rmtree(merge.rows_folder, ignore_errors=True)
        if cached:
            plan.raw.unpersist()
        if pre is not None:
            pre.release()
    # by the keys each shard task sorted its own rows by (``ShardMerge._output``): a merge of sorted runs
    output = output.sort_by([(c, "ascending") for c in merge.output_keys])
    return StageResult(output, outputs, shards, t1 - t0, t2 - t1, ends.value, ends.inputs,
                       plan.enrichment_reads(ran=True), figures, pre_step_s, side.job_s, files.staged,
                       _rewritten(merge, files))


def _after_probing_here(side: EpochSideOutputs, shards: dict[int, ShardEntry], watermarks: Watermarks,
                        plan: PlannedEpoch, expiry_next: int | None, epoch: int) -> Watermarks:
    """The bad records and W[N] of an epoch whose probe ran in its state stage's job:
    the job observed them as it read (else the side-output job finds them now); the shard
    tasks forgot by the latest event time the probes told them, which must be the same."""
    assert plan.event_time is not None
    side.find(None, None, expiry_next)
    told = latest_event([entry.operator for entry in shards.values()])
    if told != side.maxima.get(""):
        raise VolleyError(f"epoch {epoch}: the shard tasks forgot the deduplication's keys by the latest event time "
                          f"{told}, the epoch's is {side.maxima.get('')}; nothing was committed. This is a fault of "
                          "the engine (spark/dedup.py ProbeTally): report it with the epoch's log")
    return plan.event_time.advance_all(watermarks, side.maxima)


def _rewritten(merge: ShardMerge, files: TaskFiles) -> dict[str, RewrittenFiles]:
    """Per upsert sink, its files as every shard task rewrote them (a sink one task
    refused for MERGEs the epoch's rows)."""
    assert merge.step.layout is not None
    out: dict[str, RewrittenFiles] = {}
    for target in merge.staging:
        if target.rewrite is not None:
            rewrites = files.rewrites.get(target.sink, [])
            rewritten = collected(target.rewrite, rewrites, merge.step.layout.num_shards)
            if rewritten is not None:
                out[target.sink] = rewritten
            else:  # its MERGE writes files of no shard's: the table is MERGEd into from now on
                reasons = "; ".join(r.refused for r in rewrites if r.refused) or "a shard task reported no rewrite"
                _log.warning("epoch %d: sink %r MERGEs the epoch's rows instead of the shard tasks' files: %s",
                             merge.step.epoch, target.sink, reasons)
    return out


def read_staged(schema: pa.Schema, targets: tuple[StagingTarget, ...],
                staged: dict[str, tuple[StagedFile, ...]]) -> pa.Table:
    """The epoch's output from the files the shard tasks wrote it to (every sink's
    files hold the same rows: the first sink's are read), typed as the tasks' rows come back."""
    target = targets[0]
    parts = [pq.read_table(Path(target.folder) / f.path).cast(schema) for f in staged[target.sink]]
    return pa.concat_tables(parts) if parts else schema.empty_table()


def shard_entries(stats: list[str], epoch: int) -> dict[int, ShardEntry]:
    """Each shard task's manifest entry, from its stats row. Two rows for one shard mean
    its rows were split over two tasks, each folding in part of them: refused."""
    entries = [ShardEntry.from_dict(json.loads(v)) for v in stats]
    shards = {entry.shard: entry for entry in entries}
    if len(shards) != len(entries):
        ran = sorted(entry.shard for entry in entries)
        raise VolleyError(f"epoch {epoch}: shard tasks ran for shards {ran}: a shard ran more than once, each task "
                          "with part of its rows; nothing was committed (spark/partitioning.py routes one shard "
                          "to one partition)")
    return shards


def _output_ddl(pipeline: Pipeline, plan: PlannedEpoch) -> list[str]:
    key_type = plan.keyed.schema[columns.KEY].dataType.simpleString()
    return plan.operator.output_schema(f"`{pipeline.key_column}` {key_type}")


def _carried_figures(step: ShardStep, expiry_next: int | None) -> dict[str, int]:
    """What an epoch carried forward still says for the next to decide by: the earliest
    deadline, the processing time (its own, never before the last), the timers waiting."""
    figures = {NEXT_DUE: expiry_next, PROCESSING_CLOCK: step.processing_time, TIMERS_DUE_FROM: step.due_from}
    return {name: value for name, value in figures.items() if value is not None}


def _carry_forward_stage(spark: SparkSession, pipeline: Pipeline, rng: EpochRange, plan: PlannedEpoch,
                         merge: ShardMerge, expiry_next: int | None) -> StageResult:
    """An epoch with no records (running aggregate; with ``ttl_epochs``, none due):
    state is unchanged, so each shard's
    snapshot is the previous one, hardlinked, and on S3 a manifest naming the previous
    one's objects; no Spark job runs. Where the previous snapshot is only on S3 (the
    executors keep theirs on their own disks), only the S3 manifest is written. The
    output is empty, typed as a processed epoch's would be, so each sink still records
    the epoch. ``expiry_next`` is carried too, for the next epoch to decide by."""
    t0 = time.perf_counter()
    shards: dict[int, ShardEntry] = {}
    for shard, prev in sorted(merge.previous.items()):
        t = time.perf_counter()
        attempt = attempt_id()
        where = f"epoch {merge.step.epoch} shard {shard}"
        merge.check_fence(f"{where}: carrying its snapshot forward")
        target = Path(merge.snapshot_root) / snapshot_name(shard, attempt)
        remote_copy = merge.remote is not None and prev.remote_epoch is not None
        if Path(prev.path).exists() or not remote_copy:
            snap = carry_forward(Path(prev.path), prev.files, target)
        else:
            snap = SnapshotInfo(target, dict(prev.files), sum(m["size"] for m in prev.files.values()), 0)
        upload = None
        if merge.remote is not None:
            upload = snapshot_upload(
                merge.remote.carry_forward(prev.remote_epoch, shard, merge.step.epoch,
                                           from_attempt=prev.remote_attempt, attempt=attempt)
                if prev.remote_epoch is not None
                else merge.remote.upload(merge.step.epoch, shard, snap.path, attempt=attempt)
            )
        shards[shard] = ShardEntry(shard, ShardSnapshot.of(snap, attempt, stored_remotely=upload is not None),
                                   read_mode="carried_forward", bytes_new=snap.bytes_new, operator=OperatorStats(
                                       figures=_carried_figures(merge.step, expiry_next)),
                                   snapshot_s=time.perf_counter() - t, upload=upload)
    empty = spark.createDataFrame([], ", ".join(_output_ddl(pipeline, plan))).toArrow()
    output, _ = plan.operator.sink_output(empty, rng)  # typed as a processed epoch's output would be
    figures = plan.operator.epoch_figures([entry.operator for entry in shards.values()])
    figures.update((name, 0) for name in (DEDUP_FIGURES if plan.dedup is not None else ()))
    return StageResult(output, SideOutputs.empty(), shards, 0.0, time.perf_counter() - t0,
                       enrichments=plan.enrichment_reads(ran=False), figures=figures)


