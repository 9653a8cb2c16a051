"""One Parquet file per epoch in a directory: the simplest exactly-once sink
(the file's existence is the commit), used by the demo and tests."""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from volley_dagster.checkpoint.atomic import create_bytes_exclusive
from volley_dagster.sinks.base import CommitContext, Sink, commit_tags

_FILE = re.compile(r"^epoch-(\d+)\.parquet$")


class ParquetSink(Sink):
    def __init__(self, path: str | Path, name: str = "parquet") -> None:
        self.path = Path(path).absolute()
        self.name = name

    def _dir(self, pipeline: str) -> Path:
        return self.path / pipeline

    def file_for(self, pipeline: str, epoch: int) -> Path:
        return self._dir(pipeline) / f"epoch-{epoch:010d}.parquet"

    def committed_epoch(self, pipeline: str) -> int | None:
        d = self._dir(pipeline)
        epochs = [int(m.group(1)) for p in d.glob("epoch-*.parquet") if (m := _FILE.match(p.name))] if d.is_dir() else []
        return max(epochs, default=None)

    def commit(self, output: pa.Table, ctx: CommitContext) -> dict[str, Any]:
        buf = io.BytesIO()
        meta = {k.encode(): v.encode() for k, v in commit_tags(ctx, output.num_rows).items()}
        pq.write_table(output.replace_schema_metadata(meta), buf)
        target = self.file_for(ctx.pipeline, ctx.epoch)
        created = create_bytes_exclusive(target, buf.getvalue())
        return {"path": str(target), "rows": output.num_rows, "skipped": not created}

    def epoch_history(self, pipeline: str) -> dict[int, list[int]]:
        d = self._dir(pipeline)
        history: dict[int, list[int]] = {}
        for path in sorted(d.glob("epoch-*.parquet")) if d.is_dir() else []:
            history.setdefault(int(_FILE.match(path.name).group(1)), []).append(pq.read_metadata(path).num_rows)
        return history

    def read(self, pipeline: str) -> pa.Table:
        """Every committed epoch's rows, with an ``epoch`` column, in epoch order."""
        tables = []
        for path in sorted(self._dir(pipeline).glob("epoch-*.parquet")):
            t = pq.read_table(path)
            epoch = int(_FILE.match(path.name).group(1))
            tables.append(t.append_column("epoch", pa.array([epoch] * t.num_rows, pa.int64())))
        return pa.concat_tables(tables) if tables else pa.table({})

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "path": str(self.path)}
