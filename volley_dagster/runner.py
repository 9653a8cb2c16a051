"""Cut, run and commit epochs of one pipeline: the epoch log, the lease, and which
epoch runs next. One attempt of one epoch is ``attempt.py``'s ``EpochAttempt``.

Running, rescaling and pruning happen under the pipeline's lease
(``checkpoint/lease.py``): one runner at a time, and each write that makes work
visible checks the lease's fencing token first.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator, Mapping

import pyarrow as pa
from pyspark.sql import SparkSession

from volley_dagster import relayout
from volley_dagster.attempt import EpochAttempt
from volley_dagster.chain import StageChain
from volley_dagster.checkpoint.epoch_log import EpochLog
from volley_dagster.checkpoint.lease import PipelineLease
from volley_dagster.checkpoint.migrate import MigrationResult
from volley_dagster.checkpoint.rescale import RescaleResult
from volley_dagster.checkpoint.side_output_files import read_side_output
from volley_dagster.checkpoint.state_reader import read_state
from volley_dagster.dimensions.base import TablePin
from volley_dagster.errors import EpochOrderError, StorageFullError, is_disk_full
from volley_dagster.pipeline import Pipeline
from volley_dagster.result import EpochResult
from volley_dagster.settings import RunSettings, with_runner_keywords
from volley_dagster.sources.offsets import Backlog, EpochRange
from volley_dagster.spark.session import get_or_create_spark
from volley_dagster.spark.state_table import StateTables
from volley_dagster.state.compactor import shared_compactor
from volley_dagster.state.keys import ShardLayout


class EpochRunner:
    """``EpochRunner(pipeline, checkpoint_root="state/").run_next()``."""

    def __init__(self, pipeline: Pipeline, checkpoint_root: str | Path, settings: RunSettings | None = None, *,
                 spark: SparkSession | None = None, **deprecated: object) -> None:
        """Runs ``pipeline`` with its state and epoch log under ``checkpoint_root``, as
        ``settings`` say (``settings.py``), on ``spark`` (default:
        ``get_or_create_spark()`` on first use). ``deprecated``: ``RunSettings``'s fields
        as keywords, as before it existed (a ``DeprecationWarning``)."""
        self.pipeline = pipeline.settled()
        self.log = EpochLog(checkpoint_root)
        self.log.root.mkdir(mode=0o700, parents=True, exist_ok=True)  # a new root is its owner's alone
        self._spark = spark
        self.settings = with_runner_keywords(settings, deprecated)
        self._lease: PipelineLease | None = None
        self._chain: StageChain | None = None

    @property
    def spark(self) -> SparkSession:
        if self._spark is None:
            self._spark = get_or_create_spark()
        return self._spark

    # -- the lease -------------------------------------------------------------------

    @contextlib.contextmanager
    def lease(self, owner: str = "", notify: Callable[[str], None] | None = None) -> Iterator[PipelineLease]:
        """Hold the pipeline's lease across several calls (a Dagster run holds it for its
        epochs). Every run, rescale and prune takes it anyway, so a bare ``run_next()``
        is fenced too; nested calls reuse the held lease. ``notify`` hears a wait for
        another holder, and a lapsed lease taken again."""
        if self._lease is not None:
            yield self._lease
            return
        lease = PipelineLease(self.log.root, owner or f"pid {os.getpid()}", wait_s=self.settings.lease_wait_s,
                              ttl_s=self.settings.lease_ttl_s, pipeline=self.pipeline.name, notify=notify)
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
        rng = self.pipeline.source_log.cut(last + 1, previous.end if previous else {}, self.settings.max_records_per_epoch,
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
            with self.lease() as lease:
                return lease.retaking_on_lapse(lambda: self._run_leased(epoch))
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
        assert self._lease is not None
        start = self.log.start_of(epoch, self._dimension_pins(epoch))
        pipeline, before = self.pipeline, None
        if pipeline.upstream is not None:  # a chain: its stages before the last run first (``chain.py``)
            pipeline, rng, before = self._stages().run_before_last(rng)
        return EpochAttempt(self.spark, pipeline, rng, start, self.log, self.settings, self._lease, before).run()

    def _stages(self) -> StageChain:
        self._chain = self._chain or StageChain(self)
        return self._chain

    def stage_runners(self) -> list[EpochRunner]:
        """A chain's runners of its stages before the last, first to last (each stage's
        own state, watermark and results: ``stage_runners()[0].read_state()``)."""
        return self._stages().runners if self.pipeline.upstream is not None else []

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

    def wait_for_compactions(self, timeout_s: float = 60.0) -> None:
        """Wait until the background compactor has finished what this process handed it
        (``state/compactor.py``): it writes under the checkpoint root's ``compacted/``
        for a moment after each commit, so wait before deleting or copying a root."""
        shared_compactor().close(timeout_s)

    def committed_epoch(self) -> int:
        return self.log.last_committed()

    def result(self, epoch: int) -> EpochResult:
        return self.log.committed_manifest(epoch)

    def late_records(self, epoch: int) -> pa.Table | None:
        """A committed epoch's late-records output (None when it had none)."""
        return read_side_output(self.log, epoch, "late records", self.result(epoch).late_records_path, self.settings.keep_epochs)

    def duplicate_records(self, epoch: int) -> pa.Table | None:
        """A committed epoch's duplicates side output (None when it had none, or it was off)."""
        return read_side_output(self.log, epoch, "duplicates", self.result(epoch).duplicates_path, self.settings.keep_epochs)

    # -- layout (rescaling) ------------------------------------------------------------

    def rescale(self, num_shards: int) -> RescaleResult:
        """Rewrite the last committed epoch's state into ``num_shards`` shards (``relayout.py``)."""
        return relayout.rescale(self, num_shards)

    def migrate(self, pipeline: Pipeline, *, renames: Mapping[str, str] | None = None,
                initial: Mapping[str, float | None] | None = None, num_shards: int | None = None) -> MigrationResult:
        """Rewrite the last committed epoch's state into ``pipeline``'s layout and run
        ``pipeline`` from the next epoch on (``relayout.py``)."""
        pipeline = pipeline.settled()
        result = relayout.migrate(self, pipeline, renames, initial, num_shards)
        self.pipeline = pipeline
        return result

    def layout(self) -> ShardLayout:
        """The layout the next epoch runs with: ``with_shards`` until a rescale."""
        return self.log.current_layout() or self.pipeline.layout

    # -- reading state ---------------------------------------------------------------

    def state_tables(self) -> StateTables:
        """The state at any retained epoch, and the change feed between two, as Spark
        DataFrames read by Spark tasks (``spark/state_table.py``)."""
        return StateTables(self.spark, self.log.root, self.settings.reading)

    def read_state(self, epoch: int | None = None) -> pa.Table:
        """The full keyed state as of a committed, retained epoch, read on the driver
        from its snapshots (without modifying them): each key's aggregate, or for windows
        every open window (key, window_start, window_end, aggregates). For state too big
        for the driver, ``state_tables().at(epoch)`` reads it in Spark tasks. A pipeline
        that only deduplicates: the keys it remembers; a join: the rows waiting on each side."""
        epoch = self.log.last_committed() if epoch is None else epoch
        return read_state(self.log, epoch, self.settings.reading, self.pipeline.state_keys())
