"""DPW, A's design floor: what the design makes every epoch of a running aggregate do,
whatever its logic, on top of DP's handover.

In each shard task: restore the shard's RocksDB from the last epoch's hardlink snapshot,
write the epoch's rows as state records (A's state keys, fixed-width values) with one
``WriteBatch``, take a hardlink snapshot with its digests; on the driver, MERGE the rows
into a Delta table through A's own ``DeltaSink``. Nothing is
read from the state and nothing combined, so A does all of this and more: A / DP cannot
go below DPW / DP, nor A's rate reach more than peer / DPW times its peer's, whatever
A's own code costs. The engine's own classes do the work (``ShardStore``,
``encode_keys``, ``DeltaSink``), so the floor moves with them.
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
from volley_dagster.state.keys import encode_keys
from volley_dagster.state.store import ShardStore

_NAMESPACE = 1  # A's operator's, as far as the bytes go: two bytes before the key group


@dataclass(frozen=True)
class StateWrites:
    """Per shard (``per_shard``): restore, one ``WriteBatch`` of the rows, snapshot;
    returns the rows (``returned``) as they came."""

    root: str
    epoch: int
    returned: tuple[str, ...]

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
        return given.select(list(self.returned))


def _records(values: pa.Table) -> list[bytes]:
    """One fixed-width record a row, as A encodes its state (a NumPy record view)."""
    record = np.empty(values.num_rows, dtype=[(name, values.column(name).type.to_pandas_dtype())
                                              for name in values.column_names])
    for name in values.column_names:
        record[name] = values.column(name).to_numpy(zero_copy_only=False)
    return record.view(f"V{record.dtype.itemsize}").tolist()


def merge_into_delta(rows: pa.Table, uri: Path, epoch: int) -> None:
    """A's Delta sink's commit of the rows (epochs count from 1), through the engine's own
    ``DeltaSink``: the first creates the table, each later one MERGEs on the key with its txn."""
    DeltaSink(uri, mode="upsert").commit(rows, CommitContext(pipeline="bench_dpw", epoch=epoch + 1,
                                                             key_columns=(columns.KEY,)))
