"""Committing one epoch's output to every sink of a pipeline, and the lineage rules that
decide, per sink, whether to commit, skip or refuse (Quix Streams' ``SinkManager`` has
this one job alike). Each sink only writes; this module owns the loop, the fencing
check before each write, and the fault point after each.

The sinks commit concurrently, one thread each: each decides and commits on its own
mark, so no sink's commit depends on another's, and where the sinks wait on their
storage (S3, a catalog) the epoch waits for the slowest rather than for their sum
(``./dev bench sinks --together``). The fault point ``after_sink_<name>`` fires in its sink's thread as
soon as that sink has committed, whatever the others have done by then. When a sink
fails, the others still finish (each holds the epoch or not, as its own mark says),
then the first failure in the pipeline's order is raised; a retry skips whichever
sinks already hold the epoch.

A sink whose mark can be read soundly only once it has settled its own earlier
transaction (a Kafka sink: after ``init_transactions``, until which a transaction of
its last attempt may still be completing) takes the decision itself, inside its
commit (``DecidesAfterSettling``); the committer reads its mark beforehand only to
record a choice about another lineage's epochs."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Callable, Mapping, Protocol, runtime_checkable

import pyarrow as pa

from volley_dagster import faults
from volley_dagster.checkpoint.epoch_log import EpochLog
from volley_dagster.errors import EpochOrderError
from volley_dagster.pipeline import Pipeline
from volley_dagster.sinks.base import CommitContext, Sink, SinkCommitResult
from volley_dagster.sinks.lineage import SinkBinding, SinkMark
from volley_dagster.sinks.shard_files import RewrittenFiles
from volley_dagster.sinks.staged_files import StagedFile
from volley_dagster.sources.offsets import EpochRange


@runtime_checkable
class DecidesAfterSettling(Protocol):
    """A sink that decides in its commit whether to write, skip or refuse (``ctx.should_commit``
    on the mark it reads once its earlier transactions are settled). ``recorded``: the
    sink epoch the previous epoch's manifest records it holding, so that it can refuse
    when its own marks of those epochs are gone rather than write the epoch again."""

    def commit_deciding(self, output: pa.Table, ctx: CommitContext, recorded: int | None) -> SinkCommitResult: ...


class SinkCommitter:
    """The sinks of ``pipeline``, whose epochs ``log`` records; ``check_fence(what)``
    stops before a write when the runner lost its lease."""

    def __init__(self, pipeline: Pipeline, log: EpochLog, check_fence: Callable[[str], None]) -> None:
        self.pipeline = pipeline
        self.log = log
        self.check_fence = check_fence

    def commit(self, output: pa.Table, rng: EpochRange,
               staged: Mapping[str, tuple[StagedFile, ...]] | None = None,
               rewritten: Mapping[str, RewrittenFiles] | None = None) -> dict[str, SinkCommitResult]:
        """Every sink, concurrently: skip what it holds of this lineage, refuse (or, by
        the sink's choice, replace or follow) another lineage's epochs, commit the rest.
        ``staged``: per sink, the files the shard tasks wrote ``output`` to in its staging
        folder; ``rewritten``: per upsert sink, its files as the shard tasks rewrote them."""
        sinks, epoch = self.pipeline.sinks, rng.epoch
        base = CommitContext(self.pipeline.name, epoch, self.pipeline.output_keys(), self.log.lineage(), rng.digest(),
                             retired_columns=self.log.retired_columns(), expiry_column=self.pipeline.expiry_column())
        contexts = {sink.name: replace(base, staged=(staged or {}).get(sink.name, ()),
                                       rewritten=(rewritten or {}).get(sink.name)) for sink in sinks}
        if len(sinks) < 2:
            return {sink.name: self._commit_one(sink, output, contexts[sink.name]) for sink in sinks}
        with ThreadPoolExecutor(len(sinks), thread_name_prefix=f"volley-sinks-{epoch}") as pool:
            futures = [(sink.name, pool.submit(self._commit_one, sink, output, contexts[sink.name])) for sink in sinks]
        failed = [error for _, future in futures if (error := future.exception()) is not None]
        if failed:
            raise failed[0]  # in the pipeline's order; the other sinks have finished
        return {name: future.result() for name, future in futures}

    def _commit_one(self, sink: Sink, output: pa.Table, base: CommitContext) -> SinkCommitResult:
        """One sink's decision and commit; ``base``: the epoch's context, before this sink's binding."""
        epoch, lineage = base.epoch, base.lineage
        t = time.perf_counter()
        binding = self.log.sink_binding(sink.name)
        chooses = binding is None and sink.on_foreign_lineage != "fail"
        decides = isinstance(sink, DecidesAfterSettling)
        held = sink.committed_mark(self.pipeline.name) if chooses or not decides else None  # see the module's docstring
        if chooses and held is not None and not lineage.owns(held):
            self.check_fence(f"epoch {epoch}: recording sink {sink.name!r}'s choice {sink.on_foreign_lineage!r}")
            binding = self.log.record_sink_binding(SinkBinding(sink.name, sink.on_foreign_lineage, held, epoch))
        ctx = replace(base, binding=binding)
        if isinstance(sink, DecidesAfterSettling):  # decides once it settled its own last transaction
            faults.fault_pause(f"before_sink_{sink.name}", epoch)
            self.check_fence(f"epoch {epoch}: committing sink {sink.name!r}")
            commit = sink.commit_deciding(output, ctx, self._recorded(sink.name, epoch))
        else:
            commit = self._decide_and_commit(sink, output, ctx, held)
        faults.fault_point(f"after_sink_{sink.name}", epoch)
        return replace(commit, seconds=time.perf_counter() - t, lineage=lineage.id, sink_epoch=ctx.sink_epoch)

    def _decide_and_commit(self, sink: Sink, output: pa.Table, ctx: CommitContext,
                           held: SinkMark | None) -> SinkCommitResult:
        if held is not None and ctx.lineage.owns(held) and held.epoch > ctx.sink_epoch:
            held = sink.commit_of(self.pipeline.name, ctx.sink_epoch) or ctx.mark  # the range it holds for this epoch
        if not ctx.should_commit(sink.name, held):
            return SinkCommitResult(skipped=True, held_epoch=held.epoch if held else None)
        faults.fault_pause(f"before_sink_{sink.name}", ctx.epoch)  # tests: hold this sink while another commits
        self.check_fence(f"epoch {ctx.epoch}: committing sink {sink.name!r}")
        return sink.commit(output, ctx)  # a lost race reports a skip

    def _recorded(self, sink: str, epoch: int) -> int | None:
        """The sink epoch that epoch ``epoch - 1``'s manifest records ``sink`` holding (a
        manifest is written only once every sink holds its epoch); None: no such epoch,
        or the sink was not in the pipeline then."""
        previous = self.log.manifest(epoch - 1) if epoch > 1 else None
        result = previous.sinks.get(sink) if previous is not None else None
        if result is None:
            return None
        return result.sink_epoch if result.sink_epoch is not None else epoch - 1

    def refuse_held_uncommitted(self, committed: int) -> None:
        """An epoch after ``committed`` that a sink already holds was half committed in
        the recorded layout: it must finish in it before the layout changes."""
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
