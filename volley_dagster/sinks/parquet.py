"""One Parquet file per epoch in a directory: the simplest exactly-once sink
(the file's existence is the commit), used by the demo and tests. Each file's
metadata carries its lineage mark (``sinks/lineage.py``); a replacing commit's
file names the last epoch it replaces, and those files are deleted after it."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from volley_dagster.io.atomic import create_bytes_exclusive
from volley_dagster.json_records import JsonObject
from volley_dagster.sinks.base import CommitContext, Sink, SinkCommitResult, SinkLocation, SinkPosition, commit_tags
from volley_dagster.sinks.lineage import ForeignLineage, SinkCommit, SinkMark, check_choice

_FILE = re.compile(r"^epoch-(\d+)\.parquet$")
_REPLACES = "volley.replaces_through"


class ParquetSink(Sink):
    def __init__(self, path: str | Path, name: str = "parquet", on_foreign_lineage: ForeignLineage = "fail") -> None:
        self.path = Path(path).absolute()
        self.name = name
        self.on_foreign_lineage = check_choice(name, on_foreign_lineage)

    def _dir(self, pipeline: str) -> Path:
        return self.path / pipeline

    def file_for(self, pipeline: str, epoch: int) -> Path:
        return self._dir(pipeline) / self.file_name(epoch)

    @staticmethod
    def file_name(epoch: int) -> str:
        return f"epoch-{epoch:010d}.parquet"

    @staticmethod
    def epoch_of(name: str) -> int | None:
        """The epoch whose file ``name`` is (None: not one of this sink's files)."""
        match = _FILE.match(name)
        return int(match.group(1)) if match else None

    def _files(self, pipeline: str) -> list[tuple[int, Path, dict[str, str]]]:
        """The live files, in epoch order: none at or below a replacing file's horizon
        (left over if its clean-up was interrupted)."""
        d = self._dir(pipeline)
        found = []
        for path in sorted(d.glob("epoch-*.parquet")) if d.is_dir() else []:
            if m := _FILE.match(path.name):
                meta = pq.read_schema(path).metadata or {}
                found.append((int(m.group(1)), path, {k.decode(): v.decode() for k, v in meta.items()}))
        horizon = max((int(meta[_REPLACES]) for _, _, meta in found if _REPLACES in meta), default=0)
        return [f for f in found if f[0] > horizon]

    def committed_mark(self, pipeline: str) -> SinkMark | None:
        return _latest_mark(self._files(pipeline))

    def commit(self, output: pa.Table, ctx: CommitContext) -> SinkCommitResult:
        target = self.file_for(ctx.pipeline, ctx.sink_epoch)
        files = self._files(ctx.pipeline)  # one read of the footers decides and names what a replace removes
        held = _latest_mark(files)
        if not ctx.should_commit(self.name, held):
            return SinkCommitResult(skipped=True, held_epoch=held.epoch if held else None, position=SinkPosition(path=str(target)))
        tags = commit_tags(ctx, output.num_rows)
        replaced = files if ctx.replace else []
        if replaced:
            tags[_REPLACES] = str(replaced[-1][0])
        buf = io.BytesIO()
        pq.write_table(output.replace_schema_metadata({k.encode(): v.encode() for k, v in tags.items()}), buf)
        created = create_bytes_exclusive(target, buf.getvalue())  # False: another writer of this epoch was first
        for _, path, _ in replaced:  # committed above: what remains is clean-up
            path.unlink(missing_ok=True)
        return SinkCommitResult(skipped=not created, rows=output.num_rows, replaced=ctx.replace,
                                position=SinkPosition(path=str(target)), counts={"files_replaced": len(replaced)})

    def commits(self, pipeline: str) -> list[SinkCommit]:
        return [SinkCommit(SinkMark.from_tags(meta, epoch=epoch), int(meta.get("volley.rows", -1)))
                for epoch, _, meta in self._files(pipeline)]

    def read(self, pipeline: str) -> pa.Table:
        """Every committed epoch's rows, with an ``epoch`` column (the sink's number), in epoch order."""
        tables = []
        for epoch, path, _ in self._files(pipeline):
            t = pq.read_table(path).replace_schema_metadata(None)
            tables.append(t.append_column("epoch", pa.array([epoch] * t.num_rows, pa.int64())))
        return pa.concat_tables(tables) if tables else pa.table({})

    def location(self) -> SinkLocation:
        return SinkLocation("parquet", uri=str(self.path))

    def describe(self) -> JsonObject:
        return {**super().describe(), "path": str(self.path)}


def _latest_mark(files: list[tuple[int, Path, dict[str, str]]]) -> SinkMark | None:
    if not files:
        return None
    epoch, _, meta = files[-1]
    return SinkMark.from_tags(meta, epoch=epoch)
