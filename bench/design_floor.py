"""DPW, A's design floor: what the design makes every epoch of a running aggregate do,
whatever its logic, on top of DP's handover.

In each shard task: restore the shard's RocksDB from the last epoch's hardlink snapshot,
write the epoch's rows as state records (A's state keys, fixed-width values) with one
``WriteBatch``, take a hardlink snapshot with its digests, rewrite the shard's own
files of a Delta table with the rows (``sinks/shard_files.py``), and leave the rows in a
file for the driver (``write_rows``); on the driver, read them and commit the files
through A's own ``DeltaSink``. Nothing is read from the state and nothing
combined, so A does all of this and more: A / DP cannot go below DPW / DP, nor A's rate
reach more than peer / DPW times its peer's, whatever A's own code costs. The engine's
own classes do the work (``ShardStore``, ``encode_keys``, ``rewrite_shard``,
``DeltaSink``, ``write_rows``), so the floor moves with them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from volley_dagster import columns
from volley_dagster.sinks import DeltaSink
from volley_dagster.sinks.base import CommitContext
from volley_dagster.sinks.shard_files import ShardRewrite, collected, rewrite_shard
from volley_dagster.sinks.staged_files import StagingTarget
from volley_dagster.spark.tasks import attempt_id, read_rows, write_rows
from volley_dagster.state.keys import ShardLayout, encode_keys
from volley_dagster.state.store import ShardStore

_NAMESPACE = 1  # A's operator's, as far as the bytes go: two bytes before the key group


@dataclass(frozen=True)
class StateWrites:
    """Per shard (``per_shard``): restore, one ``WriteBatch`` of the rows, snapshot, the
    shard's files of ``table`` rewritten (beside the snapshot: what it did); the rows
    (``returned``) as they came, in a file beside the snapshot (``write_rows``, as A's
    tasks on a local Spark hand theirs over) or, with no table, back through Spark."""

    root: str
    epoch: int
    returned: tuple[str, ...]
    layout: ShardLayout
    table: StagingTarget | None = None

    def __call__(self, table: pa.Table) -> pa.Table:
        shard = table.column(columns.SHARD)[0].as_py()
        given = table.filter(pc.is_valid(table.column(columns.KEY)))  # without the shard's marker row
        rows = given.sort_by([(columns.KEY_GROUP, "ascending"), (columns.KEY, "ascending")])
        keys = encode_keys(_NAMESPACE, rows.column(columns.KEY_GROUP).to_numpy(zero_copy_only=False),
                           rows.column(columns.KEY).combine_chunks())
        values = _records(rows.select([c for c in self.returned if c != columns.KEY]))
        here = Path(self.root) / f"shard-{shard:04d}"
        listed = here / f"{self.epoch - 1}.json"  # the last epoch's snapshot digests, written beside it
        previous, previous_files = (here / str(self.epoch - 1), json.loads(listed.read_text())) if listed.exists() \
            else (None, None)
        store = ShardStore.restore(previous, previous_files, here / "work")
        try:
            txn = store.transaction()
            txn.set_many(keys, values)
            txn.flush()
            snap = store.snapshot(here / str(self.epoch), previous, previous_files)
        finally:
            store.close()
        (here / f"{self.epoch}.json").write_text(json.dumps(snap.files))
        returned = given.select(list(self.returned))
        if self.table is not None:
            rewrite = rewrite_shard(returned, self.table, self.layout, shard, self.epoch + 1, attempt_id())
            (here / f"{self.epoch}.rewrite.json").write_text(json.dumps(rewrite.to_dict()))
            write_rows(returned, here, f"{self.epoch}.rows")
            return returned.slice(0, 0)
        return returned


def _records(values: pa.Table) -> list[bytes]:
    """One fixed-width record a row, as A encodes its state (a NumPy record view)."""
    record = np.empty(values.num_rows, dtype=[(name, values.column(name).type.to_pandas_dtype())
                                              for name in values.column_names])
    for name in values.column_names:
        record[name] = values.column(name).to_numpy(zero_copy_only=False)
    return record.view(f"V{record.dtype.itemsize}").tolist()


def delta_table(uri: Path, layout: ShardLayout) -> tuple[DeltaSink, StagingTarget | None]:
    """A's Delta sink for the floor's table, and where its shard tasks rewrite its files."""
    sink = DeltaSink(uri, mode="upsert")
    return sink, sink.rewrite_target(layout, columns.KEY, None)


def commit_to_delta(rows: pa.Table, sink: DeltaSink, target: StagingTarget | None, root: Path, epoch: int,
                    layout: ShardLayout) -> None:
    """A's Delta sink's commit of the epoch (epochs count from 1): the shard tasks' files
    (``StateWrites``) with its txn, as A commits them; ``rows``: what came back through
    Spark (none, with a table: the tasks' rows are read from their files, as A's are)."""
    rewritten = None
    if target is not None and target.rewrite is not None:
        rewrites = [ShardRewrite.from_dict(json.loads((root / f"shard-{s:04d}" / f"{epoch}.rewrite.json").read_text()))
                    for s in range(layout.num_shards)]
        rewritten = collected(target.rewrite, rewrites, layout.num_shards)
        if rewritten is None:
            raise RuntimeError(f"DPW epoch {epoch}: a shard task did not rewrite its files: {rewrites}")
        rows = pa.concat_tables([read_rows(rows.schema, root / f"shard-{s:04d}", (f"{epoch}.rows.arrow",))
                                 for s in range(layout.num_shards)])
    sink.commit(rows, CommitContext(pipeline="bench_dpw", epoch=epoch + 1, key_columns=(columns.KEY,),
                                    rewritten=rewritten))
