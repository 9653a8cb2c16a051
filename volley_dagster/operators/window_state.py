"""A shard task's half of the window operator: merge (key, window) partials into
window state, fire what the watermark has passed, keep the pending index.

State layout (one namespace each, see ``state.keys``):

- ``WINDOW_NS``: one record per key holding all its open windows, a NumPy
  structured array (start, end, accumulators), so touching a key is one
  ``multi_get`` however many windows it has open;
- ``PENDING_NS``: ``pending_index/`` entries evicted from memory, keyed by
  (end, state key);
- ``META_NS``: the in-memory part of the index and its meta record.

Everything is columnar: a batch of windows is one array, grouped by sorting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from volley_dagster import columns
from volley_dagster.errors import StateLayoutError
from volley_dagster.operators.aggregate import STATE_FORMAT, ResolvedAggregate
from volley_dagster.operators.base import OperatorStats, ShardStep, StateNamespaces, partial_records
from volley_dagster.state import bulk_rows
from volley_dagster.state.keys import decode_keys, encode_keys, namespace_prefix
from volley_dagster.state.pending_index import PersistentPendingIndex
from volley_dagster.state.resident import MirrorKeys, ResidentWindows
from volley_dagster.state.transaction import ShardTransaction

WINDOW_NS, PENDING_NS, META_NS = 2, 3, 4
WINDOW_NAMESPACES = StateNamespaces((WINDOW_NS,), PENDING_NS, META_NS)
_TIMESTAMP = pa.timestamp("us", tz="UTC")
_MIN = np.iinfo(np.int64).min


def window_dtype(aggregate: ResolvedAggregate) -> np.dtype:
    fields = [(n, aggregate.dtype[n]) for n in aggregate.dtype.names or ()]
    return np.dtype([("start", np.int64), ("end", np.int64)] + fields)


def decode_windows(values: Sequence[bytes | None], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The windows stored under each key, as rows, and the index of the key of each row."""
    arr = pa.array(values, pa.binary())
    offsets = np.frombuffer(arr.buffers()[1], dtype=np.int32, count=len(arr) + 1) if len(arr) else np.zeros(1, np.int32)
    lengths = np.diff(offsets)
    if (lengths % dtype.itemsize).any():
        raise StateLayoutError(
            f"stored window records do not match the window layout ({dtype.itemsize} bytes per window): "
            "the checkpoint root belongs to a different window operator"
        )
    total = int(offsets[-1] - offsets[0])
    if total:
        rows = np.frombuffer(arr.buffers()[2], dtype=dtype, count=total // dtype.itemsize, offset=int(offsets[0])).copy()
        if (rows["_format"] != STATE_FORMAT).any():
            raise StateLayoutError(f"stored window state has an unknown format; this engine writes format {STATE_FORMAT}")
    else:
        rows = np.empty(0, dtype=dtype)
    return rows, np.repeat(np.arange(len(values)), lengths // dtype.itemsize)


def encode_windows(rows: np.ndarray, key_index: np.ndarray, num_keys: int) -> tuple[list[bytes], np.ndarray]:
    """One record per key from rows sorted by key index; and how many windows each holds."""
    counts = np.bincount(key_index, minlength=num_keys)
    offsets = np.concatenate([[0], np.cumsum(counts)]) * rows.dtype.itemsize
    binary = pa.binary() if offsets[-1] < 2**31 else pa.large_binary()
    offset_type = np.int32 if binary == pa.binary() else np.int64
    arr = pa.Array.from_buffers(
        binary, num_keys, [None, pa.py_buffer(offsets.astype(offset_type)), pa.py_buffer(np.ascontiguousarray(rows).tobytes())]
    )
    return arr.to_pylist(), counts


def group_windows(
    aggregate: ResolvedAggregate, rows: np.ndarray, key_index: np.ndarray, is_new: np.ndarray, sessions: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fold rows of the same (key, window) into one; for sessions, rows of a key whose
    intervals overlap or touch. Returns the windows, their key index, and whether each
    is new or changed its end (so it needs a pending-index entry)."""
    if not len(rows):
        return rows, key_index, np.zeros(0, dtype=bool)
    # sort the bounds only; the wide rows are gathered once, each group's first (most
    # groups are one row: Spark pre-aggregated each (key, window) of the epoch)
    order = np.lexsort((rows["start"], key_index))
    key_index, is_new = key_index[order], is_new[order]
    start, end = rows["start"][order], rows["end"][order]
    boundary = np.ones(len(order), dtype=bool)
    boundary[1:] = key_index[1:] != key_index[:-1]
    if sessions:
        import pandas as pd  # here: a worker that merges no sessions does not import pandas (0.3 s)

        reach = pd.Series(end).groupby(key_index).cummax().to_numpy()
        boundary[1:] |= start[1:] > reach[:-1]
    else:
        boundary[1:] |= start[1:] != start[:-1]
    leaders = np.flatnonzero(boundary)
    group = np.cumsum(boundary) - 1
    rank = np.arange(len(order)) - leaders[group]
    merged = bulk_rows.take(rows, order[leaders])
    for r in range(1, int(rank.max()) + 1):
        pick = rank == r
        target = group[pick]
        folded = bulk_rows.take(merged, target)
        aggregate.combine(folded, bulk_rows.take(rows, order[pick]))
        bulk_rows.put(merged, target, folded)
    merged["end"] = np.maximum.reduceat(end, leaders)
    stored_end = np.maximum.reduceat(np.where(is_new, _MIN, end), leaders)
    return merged, key_index[leaders], merged["end"] != stored_end


@dataclass
class ShardWindowMirror:
    """The shard's open windows in its resident mirror (``state/resident.py``), for the
    keys this epoch touches or fires; RocksDB answers whenever the mirror cannot."""

    resident: ResidentWindows
    keys: MirrorKeys  # the epoch's state keys, as the mirror orders them
    key_kind: str

    @classmethod
    def of(cls, txn: ShardTransaction, step: ShardStep, key_values: pa.Array) -> ShardWindowMirror | None:
        if not isinstance(txn.resident, ResidentWindows):
            return None
        return cls(txn.resident, MirrorKeys.of(key_values), step.key_kind)

    def windows(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The keys' stored windows and each one's key index, when the mirror can answer."""
        return self.resident.windows_of(self.keys)

    def adopt_scan(self, scanned: dict[bytes, bytes] | None, dtype: np.dtype) -> None:
        """Rebuild the mirror from a scan that read the whole shard (else drop it)."""
        if scanned is None:
            self.resident.discard()
            return
        rows, key_index = decode_windows(list(scanned.values()), dtype)
        self.resident.adopt(MirrorKeys.of(decode_keys(self.key_kind, list(scanned))[1])[key_index], rows)

    def replace(self, rows: np.ndarray, row_key: np.ndarray) -> None:
        """The keys' windows after the epoch (the fired ones gone)."""
        self.resident.replace(self.keys, rows, row_key)


def _epoch_keys(data: pa.Table) -> tuple[list[bytes], pa.Array, np.ndarray]:
    """The epoch's distinct keys (state keys, in first-seen order), their values, and each
    row's index among them: one hash pass over the key column (a key's key group is a
    function of the key), then only the distinct keys encoded."""
    if not data.num_rows:
        return [], pa.array([], data.schema.field(columns.KEY).type), np.empty(0, dtype=np.int64)
    encoded = pc.dictionary_encode(data.column(columns.KEY).combine_chunks())
    row_key = encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    first = np.empty(len(encoded.dictionary), dtype=np.int64)
    first[row_key[::-1]] = np.arange(len(row_key) - 1, -1, -1)  # the last write wins: each key's first row
    key_groups = data.column(columns.KEY_GROUP).to_numpy(zero_copy_only=False)[first]
    return encode_keys(WINDOW_NS, key_groups, encoded.dictionary), encoded.dictionary, row_key


def apply_windows(
    aggregate: ResolvedAggregate, sessions: bool, max_pending: int | None,
    txn: ShardTransaction, data: pa.Table, step: ShardStep,
) -> tuple[list[pa.Array], OperatorStats]:
    """Merge one shard's (key, window) partials into its open windows, fire those ending
    at or before ``step.fire_limit``; ``sessions``: windows of a key that touch merge;
    ``max_pending``: the in-memory pending-index bound."""
    dtype = window_dtype(aggregate)
    pending = PersistentPendingIndex(txn, namespace_prefix(META_NS), namespace_prefix(PENDING_NS), max_pending)
    limit, records = step.fire_limit, partial_records(data)
    fresh = _fresh_and_due(data, limit, sessions, pending.open_until())
    straight: list[pa.Array] = []
    if fresh is not None:
        firing = data.filter(pa.array(fresh))
        straight = _fired(aggregate, firing.column(columns.KEY).combine_chunks(), _loaded(aggregate, firing, step.epoch))
        data = data.filter(pa.array(~fresh))
    n = data.num_rows

    touched, touched_values, row_key = _epoch_keys(data)
    due = pending.pop_due(limit) if limit is not None and (n or pending.may_fire(limit)) else []
    only_due = sorted(set(due).difference(touched))
    keys = touched + only_due
    key_values = touched_values
    if only_due:  # keys this epoch fires without touching them: their values are only in their state keys
        key_values = pa.concat_arrays([touched_values, decode_keys(step.key_kind, only_due)[1].cast(touched_values.type)])

    mirror = ShardWindowMirror.of(txn, step, key_values)
    found = mirror.windows() if mirror is not None else None
    if found is not None:
        rows, key_index = found
        existed = np.bincount(key_index, minlength=len(keys)) > 0
    else:
        stored = txn.get_many(keys, namespace_prefix(WINDOW_NS))
        rows, key_index = decode_windows(stored, dtype)
        existed = np.fromiter((v is not None for v in stored), dtype=bool, count=len(stored))
        if mirror is not None:
            mirror.adopt_scan(txn.scanned_entries, dtype)
    new = _loaded(aggregate, data, step.epoch)
    windows, window_key, changed = group_windows(
        aggregate,
        bulk_rows.concat([rows, new]),
        np.concatenate([key_index, row_key]),
        np.concatenate([np.zeros(len(rows), dtype=bool), np.ones(n, dtype=bool)]),
        sessions=sessions,
    )
    fire = windows["end"] <= limit if limit is not None else np.zeros(len(windows), dtype=bool)

    open_windows, open_key = bulk_rows.select(windows, ~fire), window_key[~fire]
    encoded, counts = encode_windows(open_windows, open_key, len(keys))
    if mirror is not None:
        mirror.replace(open_windows, open_key)
    keep = counts > 0
    key_array = np.array(keys, dtype=object) if keys else np.empty(0, dtype=object)
    txn.set_many(key_array[keep].tolist(), np.array(encoded, dtype=object)[keep].tolist())
    txn.delete_many(key_array[~keep & existed].tolist())

    opened = changed & ~fire
    pending.add(key_array[window_key[opened]], windows["end"][opened], step.epoch)
    pending.touch(touched, step.epoch)
    pending.flush()

    fired, fired_key = bulk_rows.select(windows, fire), window_key[fire]
    outputs = _fired(aggregate, key_values.take(pa.array(fired_key, pa.int64())), fired)
    if straight:
        outputs = [pa.concat_arrays([a, b]) for a, b in zip(outputs, straight, strict=True)]
    figures = {
        "windows_fired": len(outputs[0]),
        "windows_opened": int(opened.sum()),
        "pending_loaded": pending.loaded,
        "pending_resident": pending.meta.resident,
        "pending_evicted": pending.meta.evicted,
        "pending_evicted_now": pending.evicted_now,
        "pending_evicted_fired": pending.evicted_fired,
    }
    return outputs, OperatorStats(len(touched), int((~existed[: len(touched)]).sum()), figures, records)


def _fresh_and_due(data: pa.Table, limit: int | None, sessions: bool, open_until: int | None) -> np.ndarray | None:
    """Which partial rows are windows that fire this epoch and that no stored window can
    be: ending after every open window of the shard (a fixed-size window ending later
    starts later) and at or before the fire limit. They fire straight from their partials,
    never read from state nor written to it, so an epoch that spans many windows (B's
    1-minute windows over 16 minutes of events, a backfill's day) merges only its last
    ones with state. Spark pre-aggregated each (key, window) of the epoch: each is one
    row. None: none (sessions, which merge when they touch, all take the state path; so
    do all windows of a shard whose latest open end is unknown)."""
    if sessions or limit is None or open_until is None or not data.num_rows:
        return None
    end = data.column(columns.WINDOW_END).to_numpy(zero_copy_only=False)
    fresh = (end > open_until) & (end <= limit)
    return fresh if fresh.any() else None


def _loaded(aggregate: ResolvedAggregate, data: pa.Table, epoch: int) -> np.ndarray:
    """The partial rows as window records: their bounds and their accumulators."""
    new = np.zeros(data.num_rows, dtype=window_dtype(aggregate))
    new["_format"] = STATE_FORMAT
    new["start"] = data.column(columns.WINDOW_START).to_numpy(zero_copy_only=False)
    new["end"] = data.column(columns.WINDOW_END).to_numpy(zero_copy_only=False)
    aggregate.load(new, data, epoch)
    return new


def _fired(aggregate: ResolvedAggregate, keys: pa.Array, windows: np.ndarray) -> list[pa.Array]:
    """The output columns of fired windows, their keys first."""
    bounds = [pa.array(windows[b], pa.int64()).cast(_TIMESTAMP) for b in ("start", "end")]
    return [keys, *bounds] + aggregate.outputs(windows)
