"""An in-process sink that keeps every epoch's output table: for tests and notebooks."""

from __future__ import annotations

import pyarrow as pa

from volley_dagster.sinks.base import CommitContext, Sink, SinkCommitResult, SinkLocation
from volley_dagster.sinks.lineage import ForeignLineage, SinkCommit, SinkMark, check_choice


class MemorySink(Sink):
    def __init__(self, name: str = "memory", on_foreign_lineage: ForeignLineage = "fail") -> None:
        self.name = name
        self.on_foreign_lineage = check_choice(name, on_foreign_lineage)
        self.epochs: dict[str, dict[int, pa.Table]] = {}  # by the sink's epoch number
        self.marks: dict[str, dict[int, SinkMark]] = {}

    def committed_mark(self, pipeline: str) -> SinkMark | None:
        marks = self.marks.get(pipeline, {})
        return marks[max(marks)] if marks else None

    def commit(self, output: pa.Table, ctx: CommitContext) -> SinkCommitResult:
        held = self.committed_mark(ctx.pipeline)
        if not ctx.should_commit(self.name, held):
            return SinkCommitResult(skipped=True, held_epoch=held.epoch if held else None)
        if ctx.replace:
            self.epochs.pop(ctx.pipeline, None)
            self.marks.pop(ctx.pipeline, None)
        self.epochs.setdefault(ctx.pipeline, {})[ctx.sink_epoch] = output
        self.marks.setdefault(ctx.pipeline, {})[ctx.sink_epoch] = ctx.mark
        return SinkCommitResult(skipped=False, rows=output.num_rows, replaced=ctx.replace)

    def location(self) -> SinkLocation:
        return SinkLocation("memory")

    def commits(self, pipeline: str) -> list[SinkCommit]:
        return [SinkCommit(self.marks[pipeline][epoch], table.num_rows)
                for epoch, table in sorted(self.epochs.get(pipeline, {}).items())]
