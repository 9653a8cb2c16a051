"""An epoch's side outputs on the checkpoint root (dead letters, late records,
duplicates): one Parquet file each, written before the commit and kept as long as the
epoch's snapshots."""

from __future__ import annotations

import io
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from volley_dagster.checkpoint.epoch_log import EpochLog
from volley_dagster.errors import SnapshotError
from volley_dagster.io.atomic import write_bytes_atomic


def write_side_output(log: EpochLog, table: pa.Table | None, path: Path) -> str | None:
    """The file's path relative to the root, as the manifest records it (None: no rows, no file)."""
    if table is None or not table.num_rows:
        return None
    buf = io.BytesIO()
    pq.write_table(table, buf)
    write_bytes_atomic(path, buf.getvalue())
    return str(path.relative_to(log.root))


def read_side_output(log: EpochLog, epoch: int, what: str, path: str | None, keep_epochs: int) -> pa.Table | None:
    """A committed epoch's side output (None when it had none); one retention removed is
    named, with its count still in the manifest."""
    if not path:
        return None
    if not (log.root / path).exists() and epoch <= log.side_outputs_pruned_through():
        raise SnapshotError(
            f"epoch {epoch}'s {what} ({log.root / path}) were removed by retention with its snapshots "
            f"(keep_epochs={keep_epochs}); the manifest still gives their count. Keep more epochs, or copy "
            "side outputs elsewhere after each epoch, to read them later"
        )
    return pq.read_table(log.root / path)
