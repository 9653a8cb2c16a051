"""An in-process sink that keeps every epoch's output table: for tests and notebooks."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from volley_dagster.sinks.base import CommitContext, Sink


class MemorySink(Sink):
    def __init__(self, name: str = "memory") -> None:
        self.name = name
        self.epochs: dict[str, dict[int, pa.Table]] = {}

    def committed_epoch(self, pipeline: str) -> int | None:
        return max(self.epochs.get(pipeline, {}), default=None)

    def commit(self, output: pa.Table, ctx: CommitContext) -> dict[str, Any]:
        self.epochs.setdefault(ctx.pipeline, {})[ctx.epoch] = output
        return {"rows": output.num_rows}

    def epoch_history(self, pipeline: str) -> dict[int, list[int]]:
        return {epoch: [table.num_rows] for epoch, table in self.epochs.get(pipeline, {}).items()}
