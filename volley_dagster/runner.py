"""Cut, run and commit epochs of one pipeline.

The order of one epoch (each step survives a crash at any point)::

    cut:     record the offset range (once; retries reuse it)
    stage:   Spark reads the range, transforms, pre-aggregates, and each shard task
             restores N-1, merges, flushes one WriteBatch, snapshots N
    sinks:   each sink commits unless it already holds the epoch (it decides)
    commit:  the manifest is written last; then retention prunes old snapshots

Running, rescaling and pruning happen under the pipeline's lease
(``checkpoint/lease.py``): one runner at a time, and each write that makes work
visible checks the lease's fencing token first.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import SparkSession

from volley_dagster import faults
from volley_dagster.checkpoint.epoch_log import EpochLog
from volley_dagster.checkpoint.lease import DEFAULT_TTL_S, DEFAULT_WAIT_S, Fence, PipelineLease
from volley_dagster.checkpoint.manifest import ShardSnapshot
from volley_dagster.checkpoint.migrate import MigrationResult
from volley_dagster.checkpoint.migrate import migrate as migrate_state
from volley_dagster.checkpoint.rescale import RescaleResult
from volley_dagster.checkpoint.rescale import rescale as rescale_state
from volley_dagster.checkpoint.s3_snapshots import S3SnapshotStore
from volley_dagster.checkpoint.state_reader import KEY_GROUP, SHARD, ReadSettings, recorded_reader, shards_to_read
from volley_dagster.dimensions.base import TablePin
from volley_dagster.errors import (
    ConfigError,
    DimensionPinRejectedError,
    EpochOrderError,
    MalformedRecordError,
    SnapshotError,
    StateLayoutError,
    StorageFullError,
    VolleyError,
    is_disk_full,
)
from volley_dagster.io.atomic import write_bytes_atomic
from volley_dagster.operators.base import ShardStep, StatefulOperator
from volley_dagster.operators.ttl import next_due
from volley_dagster.pipeline import Pipeline
from volley_dagster.result import EpochResult
from volley_dagster.sinks.base import CommitContext, SinkCommitResult
from volley_dagster.sinks.lineage import SinkBinding
from volley_dagster.sources.offsets import Backlog, EpochRange
from volley_dagster.spark.session import get_or_create_spark
from volley_dagster.spark.stage import plan_epoch, run_stage
from volley_dagster.spark.state_table import StateTables
from volley_dagster.spark.tasks import PreviousSnapshot, ShardMerge
from volley_dagster.state.keys import ShardLayout
from volley_dagster.state.options import RocksDBOptions
from volley_dagster.state.resident import ResidentStateCache
from volley_dagster.state.store import verify_snapshot
from volley_dagster.state.transaction import DEFAULT_SCAN_FRACTION


class EpochRunner:
    """``EpochRunner(pipeline, checkpoint_root="state/").run_next()``."""

    def __init__(
        self,
        pipeline: Pipeline,
        checkpoint_root: str | Path,
        *,
        spark: SparkSession | None = None,
        max_records_per_epoch: int | None = 1_000_000,
        keep_epochs: int = 3,
        rocksdb: RocksDBOptions | None = None,
        scan_fraction: float = DEFAULT_SCAN_FRACTION,
        verify_checksums: bool = False,
        snapshot_store: S3SnapshotStore | None = None,
        snapshot_cache: str | Path | None = None,
        resident_state: ResidentStateCache | bool = True,
        lease_wait_s: float = DEFAULT_WAIT_S,
        lease_ttl_s: float = DEFAULT_TTL_S,
    ) -> None:
        """Runs ``pipeline`` with its state and epoch log under ``checkpoint_root``.

        - ``spark``: the session to use (default: ``get_or_create_spark()`` on first use).
        - ``max_records_per_epoch``: how much one cut takes at most (None: everything waiting).
        - ``keep_epochs``: committed epochs whose snapshots retention keeps (at least 1).
        - ``rocksdb``: RocksDB options of the shard stores (``state/options.py``).
        - ``scan_fraction``: above this share of a shard's keys touched, read the shard
          with one scan instead of ``multi_get``.
        - ``verify_checksums``: hash every file of N-1's snapshots before restoring them
          (default: sizes only; the asset check hashes the files each run made new).
        - ``snapshot_store``: also keep every shard snapshot on S3, incrementally (only
          new SSTs upload); a task whose machine lacks N-1's snapshot restores it from
          there into ``snapshot_cache`` (default: this user's folder under the system
          temp dir; it must be this user's alone).
        - ``resident_state``: keep running-aggregate shards' state in the machines' memory
          between epochs (``state/resident.py``); True takes the settings from the
          environment, False reads state from RocksDB every epoch.
        - ``lease_wait_s``: how long a run waits for another runner of the pipeline to
          finish before ``PipelineBusyError``; ``lease_ttl_s``: how long a holder on
          another machine counts as alive after its last heartbeat."""
        pipeline.validate()
        if keep_epochs < 1:
            raise ConfigError(f"keep_epochs must be at least 1 (the last committed epoch), got {keep_epochs}")
        if max_records_per_epoch is not None and max_records_per_epoch < 1:
            raise ConfigError(f"max_records_per_epoch must be positive or None, got {max_records_per_epoch}")
        self.pipeline = pipeline
        self.log = EpochLog(checkpoint_root)
        self.log.root.mkdir(mode=0o700, parents=True, exist_ok=True)  # a new root is its owner's alone
        self._spark = spark
        self.max_records_per_epoch = max_records_per_epoch
        self.keep_epochs = keep_epochs
        self.rocksdb = rocksdb or RocksDBOptions()
        self.scan_fraction = scan_fraction
        self.verify_checksums = verify_checksums
        self.snapshot_store = snapshot_store
        self.snapshot_cache = str(snapshot_cache or Path(tempfile.gettempdir()) / f"volley-snapshot-cache-{os.getuid()}")
        self.resident_state = ResidentStateCache.from_env() if resident_state is True else resident_state or None
        self.lease_wait_s = lease_wait_s
        self.lease_ttl_s = lease_ttl_s
        self._lease: PipelineLease | None = None

    @property
    def spark(self) -> SparkSession:
        if self._spark is None:
            self._spark = get_or_create_spark()
        return self._spark

    # -- the lease -------------------------------------------------------------------

    @contextlib.contextmanager
    def lease(self, owner: str = "", on_wait: Callable[[str], None] | None = None) -> Iterator[PipelineLease]:
        """Hold the pipeline's lease across several calls (a Dagster run holds it for its
        epochs). Every run, rescale and prune takes it anyway, so a bare ``run_next()``
        is fenced too; nested calls reuse the held lease."""
        if self._lease is not None:
            yield self._lease
            return
        lease = PipelineLease(self.log.root, owner or f"pid {os.getpid()}", wait_s=self.lease_wait_s,
                              ttl_s=self.lease_ttl_s, pipeline=self.pipeline.name, on_wait=on_wait)
        try:
            lease.acquire()
        except OSError as exc:
            if not is_disk_full(exc):
                raise
            raise StorageFullError(
                f"pipeline {self.pipeline.name!r}: no space left on the disk under {self.log.root} to take its lease "
                f"({exc}); nothing was run: free space and run again"
            ) from exc
        with lease:
            self._lease = lease
            try:
                yield lease
            finally:
                self._lease = None

    def _fence(self) -> Fence:
        assert self._lease is not None, "epochs run, and retention prunes, under the lease"
        return self._lease.fence

    def _check_fence(self, what: str) -> None:
        assert self._lease is not None, "epochs run, and retention prunes, under the lease"
        self._lease.check(what)

    # -- cutting -------------------------------------------------------------------

    def cut_next(self, allow_empty: bool = False, end_of_stream: bool = False) -> EpochRange | None:
        """Record the next epoch's range: from the end of the last cut epoch to what is
        available now, bounded by ``max_records_per_epoch``. None when nothing is new.
        ``end_of_stream`` marks it the final epoch: every open window fires."""
        last = self.log.last_cut()
        previous = self.log.offsets(last) if last else None
        if previous is not None and previous.end_of_stream:
            raise EpochOrderError(
                f"pipeline {self.pipeline.name!r} ended its stream at epoch {last}; "
                "nothing can be cut after it (use a new checkpoint root to start over)"
            )
        rng = self.pipeline.source_log.cut(last + 1, previous.end if previous else {}, self.max_records_per_epoch,
                                           final=end_of_stream)
        if rng.records == 0 and not (allow_empty or end_of_stream):
            return None
        rng.check_positions()
        cut_at_us = time.time_ns() // 1000
        recorded = self.log.record_offsets(replace(rng, end_of_stream=end_of_stream, cut_at_us=cut_at_us))
        self._dimension_pins(recorded.epoch)
        return recorded

    def _dimension_pins(self, epoch: int) -> dict[str, TablePin]:
        """The version of each dimension table the epoch reads: recorded when it was
        cut, else now, before its first attempt reads anything (the recorded one wins)."""
        pins = {}
        for step in self.pipeline.enrichments:
            pinned = self.log.dimension_pin(epoch, step.name)
            pins[step.name] = pinned or self.log.record_dimension_pin(epoch, step.table.pin())
        return pins

    def _checked_pins(self, before: EpochResult | None, pins: dict[str, TablePin]) -> frozenset[str]:
        """Tables whose pinned version the previous epoch (``before``) read on the same
        key: the key's uniqueness was checked then."""
        read = before.enrichments if before is not None else {}
        return frozenset(step.name for step in self.pipeline.enrichments
                         if {k: read.get(step.name, {}).get(k) for k in ("version", "kind", "on")}
                         == {"version": pins[step.name].version, "kind": pins[step.name].kind, "on": list(step.on)})

    def records_waiting(self) -> int:
        """Records in the source after the last cut epoch's range: what the next cut takes."""
        return self.backlog().records

    def backlog(self) -> Backlog:
        """What waits in the source after the last cut epoch's range (records, files, the
        oldest file's age): what a sensor cuts, and what the source asset reports."""
        last = self.log.last_cut()
        return self.pipeline.source_log.backlog(self.log.offsets(last).end if last else {})

    def flush(self) -> list[EpochResult]:
        """End the stream: run what is cut, then cut and run the remaining records as a
        final epoch that fires every pending window (an explicit end-of-stream)."""
        results = []
        with self.lease():
            while self.log.last_cut() > self.log.last_committed():
                results.append(self.run(self.log.last_committed() + 1))
            if not (results and results[-1].end_of_stream):
                final = self.cut_next(end_of_stream=True)
                assert final is not None  # an end-of-stream cut records even an empty range
                results.append(self.run(final.epoch))
        return results

    # -- running -------------------------------------------------------------------

    def run(self, epoch: int) -> EpochResult:
        """Process a cut epoch, or return its recorded result if it committed already."""
        committed = self.log.manifest(epoch)
        if committed is not None:
            return committed
        try:
            with self.lease():
                return self._run_leased(epoch)
        except OSError as exc:
            if not is_disk_full(exc):
                raise
            raise StorageFullError(
                f"epoch {epoch}: no space left on the disk under {self.log.root} ({exc}); nothing was committed: "
                "free space and run the epoch again"
            ) from exc

    def _run_leased(self, epoch: int) -> EpochResult:
        committed = self.log.manifest(epoch)  # the runner that held the lease before may have committed it
        if committed is not None:
            return committed
        rng = self.log.offsets(epoch)
        if epoch > 1 and not self.log.is_committed(epoch - 1):
            raise EpochOrderError(
                f"epoch {epoch} of pipeline {self.pipeline.name!r} needs epoch {epoch - 1} committed first "
                f"(the last committed epoch is {self.log.last_committed()})"
            )
        return self._process(rng)

    def run_next(self) -> EpochResult | None:
        """Finish the oldest cut-but-uncommitted epoch, else cut and run a new one."""
        committed = self.log.last_committed()
        if self.log.last_cut() > committed:
            return self.run(committed + 1)
        rng = self.cut_next()
        return None if rng is None else self.run(rng.epoch)

    def run_available(self, max_epochs: int | None = None) -> list[EpochResult]:
        results: list[EpochResult] = []
        with self.lease():
            while max_epochs is None or len(results) < max_epochs:
                result = self.run_next()
                if result is None:
                    break
                results.append(result)
        return results

    def committed_epoch(self) -> int:
        return self.log.last_committed()

    def result(self, epoch: int) -> EpochResult:
        return self.log.committed_manifest(epoch)

    def _process(self, rng: EpochRange) -> EpochResult:
        epoch, pipeline, log = rng.epoch, self.pipeline, self.log
        t0 = time.perf_counter()
        _refuse_speculation(self.spark)
        pipeline.source_log.verify(rng)
        before = log.committed_manifest(epoch - 1) if epoch > 1 else None
        pins = self._dimension_pins(epoch)
        try:
            plan = plan_epoch(self.spark, pipeline, rng, pins, self._checked_pins(before, pins))
        except DimensionPinRejectedError as exc:  # every attempt fails on it alike: none produced output from it
            self._check_fence(f"epoch {epoch}: setting aside the pin of dimension table {exc.table!r}")
            log.drop_dimension_pin(epoch, exc.table, exc.version)
            raise
        log.check_identity(identity_of(pipeline, plan.state_operator, plan.key_kind))
        pipeline = self._in_layout(epoch)
        previous = self._previous_snapshots(epoch, pipeline.layout)
        merge = ShardMerge(
            step=ShardStep(epoch, plan.key_kind, layout=pipeline.layout),
            key_column=pipeline.key_column,
            operator=plan.state_operator,
            previous=previous,
            snapshot_root=str(log.snapshots_dir(epoch)),
            work_root=str(log.work_dir(epoch)),
            rocksdb=self.rocksdb,
            scan_fraction=self.scan_fraction,
            verify_checksums=self.verify_checksums,
            driver_pid=os.getpid(),
            remote=self.snapshot_store,
            cache_root=self.snapshot_cache,
            resident=self.resident_state,
            state_identity=f"{log.root.resolve()}|{pipeline.name}",
            fence=self._fence(),
        )
        watermark = before.watermark if before is not None else None
        due = next_due([s.operator.figures for s in before.shards.values()]) if before is not None else None
        stage = run_stage(self.spark, pipeline, rng, plan, merge, watermark, rng.end_of_stream, due)
        if stage.dead_letters.num_rows and pipeline.bad_records == "fail":
            raise MalformedRecordError(_describe_bad(epoch, stage.dead_letters, pipeline.quote_bad_records))
        if sorted(stage.shards) != list(range(pipeline.layout.num_shards)):
            raise VolleyError(f"epoch {epoch}: shard results {sorted(stage.shards)} do not cover every shard")
        faults.fault_point("after_snapshot", epoch)

        t_sinks = time.perf_counter()
        dead_path = self._write_side_output(stage.dead_letters, log.dead_letter_path(epoch))
        late_path = self._write_side_output(stage.late, log.late_records_path(epoch))
        duplicates_path = self._write_side_output(stage.duplicate_records, log.duplicates_path(epoch))
        sink_results = self._commit_sinks(stage.output, rng)
        faults.fault_point("after_sinks", epoch)
        t_commit = time.perf_counter()

        shards = {s: entry.relative_to(log.root) for s, entry in sorted(stage.shards.items())}
        result = EpochResult(
            pipeline=pipeline.name,
            epoch=epoch,
            range=rng.summary(),
            records_in=rng.records,
            records_aggregated=sum(s.records for s in shards.values()),
            dead_letters=stage.dead_letters.num_rows,
            records_out=stage.output.num_rows,
            keys_touched=sum(s.keys_touched for s in shards.values()),
            new_keys=sum(s.new_keys for s in shards.values()),
            keys_expired=sum(s.operator.figures.get("keys_expired", 0) for s in shards.values()),
            state_bytes=sum(s.snapshot.bytes_total for s in shards.values()),
            state_bytes_written=sum(s.bytes_new for s in shards.values()),
            shards=shards,
            sinks=sink_results,
            durations={
                "read_transform": stage.read_transform_s,
                "state_stage": stage.state_stage_s,
                **{f"{p}_shard_sum": sum(getattr(s, f"{p}_s") for s in shards.values())
                   for p in ("restore", "merge", "flush", "snapshot")},
                "sinks": t_commit - t_sinks,
                "total": t_commit - t0,
            },
            dead_letter_path=dead_path,
            watermark=stage.watermark,
            late_records=stage.late.num_rows if stage.late is not None else 0,
            late_records_path=late_path,
            duplicates=stage.duplicates,
            dedup_late=stage.dedup_late,
            duplicates_path=duplicates_path,
            end_of_stream=rng.end_of_stream,
            committed_at=datetime.now(timezone.utc).isoformat(),
            fencing_token=self._fence().token,
            enrichments=stage.enrichments,
            output=stage.output,
        )
        if log.layout_for(epoch) != pipeline.layout:  # a rescale committed while this epoch ran
            raise StateLayoutError(
                f"epoch {epoch} ran with {pipeline.layout.num_shards} shards, but a rescale committed meanwhile "
                f"({log.describe_layouts()}); nothing was committed: run the epoch again"
            )
        self._check_fence(f"epoch {epoch}: writing its manifest")
        if not log.write_manifest(result):
            return log.committed_manifest(epoch)
        pipeline.source_log.committed(rng)
        self._prune(epoch)
        return result

    def _prune(self, committed: int) -> None:
        """Retention after a commit: old epochs, and the attempts that lost."""
        self._check_fence(f"pruning after epoch {committed}")
        self.log.prune(committed, self.keep_epochs)
        if self.snapshot_store is not None:  # from the root's manifests at prune time, fenced before each delete
            self.snapshot_store.retain_committed(self.log, committed, self.keep_epochs, before_delete=self._check_fence)

    def _write_side_output(self, table: pa.Table | None, path: Path) -> str | None:
        """Dead letters, late records, duplicates: one Parquet file per epoch, before the commit."""
        if table is None or not table.num_rows:
            return None
        buf = io.BytesIO()
        pq.write_table(table, buf)
        write_bytes_atomic(path, buf.getvalue())
        return str(path.relative_to(self.log.root))

    def late_records(self, epoch: int) -> pa.Table | None:
        """A committed epoch's late-records output (None when it had none)."""
        return self._side_output(epoch, "late records", self.result(epoch).late_records_path)

    def duplicate_records(self, epoch: int) -> pa.Table | None:
        """A committed epoch's duplicates side output (None when it had none, or it was off)."""
        return self._side_output(epoch, "duplicates", self.result(epoch).duplicates_path)

    def _side_output(self, epoch: int, what: str, path: str | None) -> pa.Table | None:
        if not path:
            return None
        if not (self.log.root / path).exists() and epoch <= self.log.side_outputs_pruned_through():
            raise SnapshotError(
                f"epoch {epoch}'s {what} ({self.log.root / path}) were removed by retention with its snapshots "
                f"(keep_epochs={self.keep_epochs}); the manifest still gives their count. Keep more epochs, or copy "
                "side outputs elsewhere after each epoch, to read them later"
            )
        return pq.read_table(self.log.root / path)

    def _commit_sinks(self, output: pa.Table, rng: EpochRange) -> dict[str, dict[str, Any]]:
        """Each sink in turn: skip what it holds of this lineage, refuse (or, by the
        sink's choice, replace or follow) another lineage's epochs, commit the rest."""
        epoch, lineage, digest = rng.epoch, self.log.lineage(), rng.digest()
        retired = self.log.retired_columns()
        results: dict[str, dict[str, Any]] = {}
        for sink in self.pipeline.sinks:
            t = time.perf_counter()
            held = sink.committed_mark(self.pipeline.name)
            binding = self.log.sink_binding(sink.name)
            if binding is None and held is not None and not lineage.owns(held) and sink.on_foreign_lineage != "fail":
                self._check_fence(f"epoch {epoch}: recording sink {sink.name!r}'s choice {sink.on_foreign_lineage!r}")
                binding = self.log.record_sink_binding(SinkBinding(sink.name, sink.on_foreign_lineage, held, epoch))
            ctx = CommitContext(self.pipeline.name, epoch, self.pipeline.output_keys(), lineage, digest, binding,
                                retired_columns=retired, expiry_column=self.pipeline.expiry_column())
            if held is not None and lineage.owns(held) and held.epoch > ctx.sink_epoch:
                held = sink.commit_of(self.pipeline.name, ctx.sink_epoch) or ctx.mark  # the range it holds for this epoch
            if not ctx.should_commit(sink.name, held):
                commit = SinkCommitResult(skipped=True, held_epoch=held.epoch if held else None)
            else:
                self._check_fence(f"epoch {epoch}: committing sink {sink.name!r}")
                commit = sink.commit(output, ctx)  # a lost race reports a skip
            results[sink.name] = commit.to_dict()
            results[sink.name].update(seconds=time.perf_counter() - t, lineage=lineage.id, sink_epoch=ctx.sink_epoch)
            faults.fault_point(f"after_sink_{sink.name}", epoch)
        return results

    # -- layout (rescaling) ------------------------------------------------------------

    def rescale(self, num_shards: int) -> RescaleResult:
        """Rewrite the last committed epoch's state into ``num_shards`` shards; the epochs
        after it run with them (``checkpoint/rescale.py``; needs no Spark), those cut but
        not committed too (a sensor keeps cutting while a rescale waits for the lease),
        unless a sink already holds one. The current shard count is a no-op."""
        with self.lease() as lease:
            self._refuse_held_uncommitted(self.log.last_committed())
            return rescale_state(self.log, num_shards, lease, self.rocksdb, self.verify_checksums, uncommitted_ok=True)

    def migrate(self, pipeline: Pipeline, *, renames: Mapping[str, str] | None = None,
                initial: Mapping[str, float | None] | None = None, num_shards: int | None = None) -> MigrationResult:
        """Rewrite the last committed epoch's state into ``pipeline``'s layout (added,
        removed or renamed accumulators, a window's allowed lateness, and the shard
        count with it; ``checkpoint/migrate.py``) and run ``pipeline`` from the next
        epoch on. ``renames`` maps old accumulator names to new ones; ``initial`` gives
        an added ``sum_`` 0 instead of null. Refused, naming the options, for changes
        state cannot follow. Epochs cut but not committed (a sensor cut them, and their
        runs failed on the changed pipeline) run with the new pipeline, unless a sink
        already holds one (an attempt crashed after committing it): then it is refused
        until that epoch is run with the recorded pipeline."""
        pipeline.validate()
        if pipeline.name != self.pipeline.name:
            raise ConfigError(f"migrate: pipeline {pipeline.name!r} is not {self.pipeline.name!r}, whose state "
                              f"{self.log.root} holds")
        with self.lease() as lease:
            committed = self.log.last_committed()
            if committed == 0:
                raise EpochOrderError(f"nothing to migrate in {self.log.root}: no epoch is committed; run the new pipeline")
            self._refuse_held_uncommitted(committed)
            # planned, not run: resolves the new operator against the source's columns
            plan = plan_epoch(self.spark, pipeline, self.log.offsets(committed))
            result = migrate_state(self.log, identity_of(pipeline, plan.state_operator, plan.key_kind), lease, renames,
                                   initial, num_shards, self.rocksdb, self.verify_checksums, uncommitted_ok=True)
        self.pipeline = pipeline
        return result

    def _refuse_held_uncommitted(self, committed: int) -> None:
        """An epoch after ``committed`` that a sink already holds was half committed in
        the recorded layout: it must finish in it."""
        if self.log.last_cut() == committed:
            return
        lineage = self.log.lineage()
        held = {sink.name: mark.epoch for sink in self.pipeline.sinks
                if (mark := sink.committed_mark(self.pipeline.name)) is not None and lineage.owns(mark)
                and mark.epoch > committed}
        if held:
            raise EpochOrderError(
                f"cannot change the state layout of {self.log.root}: epoch {committed + 1} is cut but not committed, "
                f"and sinks {held} already hold it (an attempt crashed after committing them). Run it with the "
                "recorded pipeline first, then change the layout"
            )

    def layout(self) -> ShardLayout:
        """The layout the next epoch runs with: ``with_shards`` until a rescale."""
        return self.log.current_layout() or self.pipeline.layout

    def _in_layout(self, epoch: int) -> Pipeline:
        """The pipeline with the layout the epoch log holds for ``epoch`` (``with_shards``
        is the initial layout only; rescales record the later ones)."""
        layout = self.log.layout_for(epoch) or self.pipeline.layout
        return self.pipeline if layout == self.pipeline.layout else replace(self.pipeline, layout=layout)

    def _previous_snapshots(self, epoch: int, layout: ShardLayout) -> dict[int, PreviousSnapshot]:
        if epoch == 1:
            return {}
        shards = self.log.state_shards(epoch - 1)
        if sorted(shards) != list(range(layout.num_shards)):
            raise StateLayoutError(
                f"epoch {epoch - 1}'s state has {len(shards)} shards, epoch {epoch} runs with {layout.num_shards} "
                f"({self.log.describe_layouts()}): an epoch and a rescale were committed concurrently; "
                "restore the checkpoint root from a copy or remove the conflicting layouts/ record"
            )
        previous = {}
        for shard, snap in shards.items():
            path = self.log.root / snap.path
            remote = epoch - 1 if self._stored_remotely(snap) else None
            if remote is None or path.exists():  # else the task restores it from the store
                verify_snapshot(path, snap.files, full=self.verify_checksums)  # fail before Spark starts work
            previous[shard] = PreviousSnapshot(str(path), snap.files, remote, snap.attempt)
        return previous

    # -- reading state ---------------------------------------------------------------

    def state_tables(self) -> StateTables:
        """The state at any retained epoch, and the change feed between two, as Spark
        DataFrames read by Spark tasks (``spark/state_table.py``)."""
        return StateTables(self.spark, self.log.root, self._read_settings())

    def _read_settings(self) -> ReadSettings:
        return ReadSettings(self.snapshot_store, self.snapshot_cache, self.rocksdb, self.verify_checksums)

    def read_state(self, epoch: int | None = None) -> pa.Table:
        """The full keyed state as of a committed, retained epoch, read on the driver
        from its snapshots (without modifying them): each key's aggregate, or for windows
        every open window (key, window_start, window_end, aggregates). For state too big
        for the driver, ``state_tables().at(epoch)`` reads it in Spark tasks. A pipeline
        that only deduplicates: the keys it remembers."""
        epoch = self.log.last_committed() if epoch is None else epoch
        reader = recorded_reader(self.log, epoch, self._read_settings())
        tables = [t for shard in shards_to_read(self.log, epoch, self.snapshot_store) for t in reader.read(shard, "state")]
        table = pa.concat_tables(tables) if tables else reader.schema("state").empty_table()
        table = table.drop_columns([KEY_GROUP, SHARD])
        # a pipeline that only deduplicates holds its remembered keys, one column
        keys = table.column_names[:1] if self.pipeline.only_deduplicates else self.pipeline.output_keys()
        return table.sort_by([(c, "ascending") for c in keys])

    def _stored_remotely(self, snap: ShardSnapshot) -> bool:
        """Whether this runner's snapshot store holds the snapshot (an epoch's own
        snapshots are uploaded; a rescale's rewrite is not)."""
        return self.snapshot_store is not None and snap.stored_remotely


MAX_REASON_CHARS = 160  # a reason quotes the record's values: an error message carries a bounded part


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


def _bounded(text: str) -> str:
    return text if len(text) <= MAX_REASON_CHARS else f"{text[:MAX_REASON_CHARS]}... ({len(text)} characters)"


def identity_of(pipeline: Pipeline, operator: StatefulOperator, key_kind: str) -> dict[str, Any]:
    """What a checkpoint root records of the pipeline that writes it (``pipeline.json``)."""
    return {
        "pipeline": pipeline.name,
        "key_column": pipeline.key_column,
        "key_kind": key_kind,
        "layout": pipeline.layout.to_dict(),
        "aggregate": operator.layout(),
    }
