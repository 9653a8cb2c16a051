"""The shard side of the interval join (``operators/join.py`` has the rules): the rows
each side keeps waiting for a match, in four namespaces of the shard that owns the
key's key group, all keyed ``ns | key group | ...`` so a rescale moves them like any
keyed state:

```
 9  index      kg | key -> the key's waiting rows: (side, matched, epoch, position, event time) records
10  rows       kg | key | side | epoch | position -> the row's columns (``join_rows.RowCodec``)
11  by bound   kg | bound | side | epoch | position | key -> ""   leaves once the watermark reaches bound
12  counts     kg -> rows waiting on the left, on the right (``max_state_rows``, figures)
```

One epoch, in bulk: read the index of every key the epoch touches or whose rows fall
due (one range scan per key group of namespace 11, from past the previous watermark
to the new one, so it costs what leaves), join the epoch's rows with each other and
with the waiting ones (range searches over rows sorted by key and time, in NumPy),
mark the matched, let leave every row whose bound the watermark has reached (an
unmatched one of an outer side is emitted with nulls first), and write it all in the
shard's one ``WriteBatch``. A row's columns are read back only when it is emitted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from volley_dagster import columns
from volley_dagster.errors import ConfigError, SnapshotError, StateLimitError
from volley_dagster.operators.base import OperatorStats, ShardStep, partial_records
from volley_dagster.operators.join_rows import RowCodec
from volley_dagster.state.keys import decode_keys, encode_keys, namespace_prefix, packed_records
from volley_dagster.state.pending_index import ordered_us
from volley_dagster.state.transaction import ShardTransaction

INDEX_NS, ROWS_NS, BY_BOUND_NS, COUNTS_NS = 9, 10, 11, 12
JOIN_NAMESPACES_KEYED = (INDEX_NS, ROWS_NS, BY_BOUND_NS, COUNTS_NS)
LEFT, RIGHT = 0, 1
# a row is the epoch that read it and its position in that epoch's range (``columns.POS``);
# the second and later rows one record gives a key (a transform's explode) are told
# apart by their rank among them, packed into a negative position (``row_numbers``)
ENTRY = np.dtype([("side", "u1"), ("matched", "u1"), ("epoch", "<u4"), ("row", "<i8"), ("time", "<i8")])
_ROW_SUFFIX = np.dtype([("side", "u1"), ("epoch", ">u4"), ("row", ">i8")])
_BOUND_PREFIX = np.dtype([("ns", ">u2"), ("kg", ">u2"), ("bound", ">u8"), ("side", "u1"), ("epoch", ">u4"),
                          ("row", ">i8")])
_MAX, _MIN = np.iinfo(np.int64).max, np.iinfo(np.int64).min
_RANK_SHIFT, _RANK_BITS = 28, 12  # in a packed position: rank in bits 28-39, below the segment's bits (columns.POS)
_SEGMENT_MASK, _OFFSET_MASK = -1 << columns.POS_OFFSET_BITS, (1 << _RANK_SHIFT) - 1
FIGURES = ("join_pairs", "join_unmatched", "join_left_rows", "join_right_rows", "join_rows_evicted")


@dataclass(frozen=True)
class JoinBounds:
    """A left row at ``tl`` matches a right row at ``tr`` when ``lower <= tr - tl <= upper``."""

    lower_us: int
    upper_us: int
    outer: tuple[bool, bool]  # (left, right): an unmatched row of that side is emitted with nulls

    def leaves_at(self, sides: np.ndarray, times: np.ndarray) -> np.ndarray:
        """When a row can match nothing more, so leaves state: no row still to come (event
        time after the watermark) can match a left row after ``tl + upper``, or a right
        row after ``tr - lower``."""
        return np.where(sides == LEFT, _shifted(times, self.upper_us), _shifted(times, -self.lower_us))


def _shifted(times: np.ndarray, delta: int) -> np.ndarray:
    """``times + delta``, saturated at int64's ends (an event time near them never wraps)."""
    times = np.asarray(times, dtype=np.int64)
    return np.minimum(times, _MAX - delta) + delta if delta >= 0 else np.maximum(times, _MIN - delta) + delta


@dataclass(frozen=True)
class JoinShard:
    """What a shard task needs of the resolved join."""

    bounds: JoinBounds
    codecs: tuple[RowCodec, RowCodec]  # left, right
    max_state_rows: int | None
    side_names: tuple[str, str]


@dataclass
class _Waiting:
    """The rows of the epoch's keys, waiting and new, as arrays over one index."""

    ki: np.ndarray  # the key's index into the epoch's keys
    side: np.ndarray
    epoch: np.ndarray  # the epoch that read it
    row: np.ndarray  # its position in that epoch's range
    time: np.ndarray
    matched: np.ndarray
    new: np.ndarray  # came this epoch (not in state yet)


def apply_join(join: JoinShard, txn: ShardTransaction, data: pa.Table,
               step: ShardStep) -> tuple[list[pa.Array], OperatorStats]:
    """Fold one shard's rows of the epoch (``KEY``, ``KEY_GROUP``, ``POS``, ``JOIN_SIDE``,
    ``JOIN_TIME``, ``JOIN_ROW``) into its waiting rows; returns the output columns (key,
    left row id, right row id, left columns, right columns) and the shard's figures."""
    keys_new = data.column(columns.KEY).combine_chunks()
    due_kg, due_keys = _due(txn, step, step.key_kind)
    kg_new = data.column(columns.KEY_GROUP).to_numpy(zero_copy_only=False).astype(np.int64)
    all_keys = pa.concat_arrays([keys_new.cast(due_keys.type), due_keys]) if len(due_keys) else keys_new
    encoded = all_keys.dictionary_encode()
    ki_all = encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    keys = encoded.dictionary
    key_groups = np.zeros(len(keys), dtype=np.int64)
    key_groups[ki_all] = np.concatenate([kg_new, due_kg])
    index_keys = encode_keys(INDEX_NS, key_groups, keys)  # ns | kg | key: the other namespaces' keys derive from it
    stored = txn.get_many(index_keys, namespace_prefix(INDEX_NS))

    old = _decode_index(stored)
    n_old = len(old)
    sides_new = data.column(columns.JOIN_SIDE).to_numpy(zero_copy_only=False).astype(np.uint8)
    w = _Waiting(
        ki=np.concatenate([old["ki"], ki_all[:len(keys_new)]]),
        side=np.concatenate([old["side"], sides_new]),
        epoch=np.concatenate([old["epoch"], np.full(len(keys_new), step.epoch, dtype=np.int64)]),
        row=np.concatenate([old["row"], row_numbers(data, ki_all[:len(keys_new)], step.epoch, join.side_names)]),
        time=np.concatenate([old["time"], data.column(columns.JOIN_TIME).to_numpy(zero_copy_only=False).astype(np.int64)]),
        matched=np.concatenate([old["matched"].astype(bool), np.zeros(len(keys_new), dtype=bool)]),
        new=np.concatenate([np.zeros(n_old, dtype=bool), np.ones(len(keys_new), dtype=bool)]),
    )
    left_i, right_i = _pairs(join.bounds, w)
    w.matched[left_i] = True
    w.matched[right_i] = True
    leaves = np.zeros(len(w.ki), dtype=bool) if step.watermark is None else \
        join.bounds.leaves_at(w.side, w.time) <= step.watermark
    outer = np.array(join.bounds.outer)[w.side] if len(w.side) else np.zeros(0, dtype=bool)
    alone = np.flatnonzero(leaves & ~w.matched & outer)
    alone_left, alone_right = alone[w.side[alone] == LEFT], alone[w.side[alone] == RIGHT]

    encoded_keys = pa.array(index_keys, pa.binary())
    row_keys = _row_keys(encoded_keys, w)
    texts = _texts(txn, w, n_old, row_keys, data, np.concatenate([left_i, right_i, alone]))  # before they leave
    _write(txn, join, w, leaves, key_groups, encoded_keys, index_keys, row_keys, data)
    held = _count(txn, step, key_groups, w, leaves, join)
    n_pairs = len(left_i)
    left_out = np.concatenate([left_i, alone_left, np.full(len(alone_right), -1)]).astype(np.int64)
    right_out = np.concatenate([right_i, np.full(len(alone_left), -1), alone_right]).astype(np.int64)
    key_of = np.where(left_out >= 0, w.ki[np.maximum(left_out, 0)], w.ki[np.maximum(right_out, 0)]) \
        if len(left_out) else np.zeros(0, dtype=np.int64)
    outputs = [keys.take(pa.array(key_of)), row_ids(w.epoch, w.row, left_out), row_ids(w.epoch, w.row, right_out),
               *join.codecs[LEFT].decode(_take_texts(texts, left_out)).columns,
               *join.codecs[RIGHT].decode(_take_texts(texts, right_out)).columns]
    figures = {"join_pairs": n_pairs, "join_unmatched": len(alone),
               "join_left_rows": int(held[0]), "join_right_rows": int(held[1]),
               "join_rows_evicted": int((leaves & ~w.new).sum())}
    return outputs, OperatorStats(len(keys), int(np.count_nonzero(np.array([v is None for v in stored]))),
                                  figures, partial_records(data))


def row_numbers(data: pa.Table, ki: np.ndarray, epoch: int, side_names: tuple[str, str]) -> np.ndarray:
    """Each new row's number in state: its record's position (``columns.POS``), or, for
    the second and later rows a record gives one key and side (a transform that explodes
    records), the position packed with the row's rank among them, negated so it is never
    a position. The rank orders those rows by event time, then columns: the same on every
    re-run of the recorded range, so a retry gives each row the same id. Only rows on time
    reach a shard, so the rank counts those."""
    positions = data.column(columns.POS).to_numpy(zero_copy_only=False).astype(np.int64)
    sides = data.column(columns.JOIN_SIDE).to_numpy(zero_copy_only=False).astype(np.int64)
    if len(positions) < 2:
        return positions
    order = pc.sort_indices(pa.table({"k": ki, "s": sides, "p": positions, "t": data.column(columns.JOIN_TIME),
                                      "c": data.column(columns.JOIN_ROW)}),
                            sort_keys=[(c, "ascending") for c in ("k", "s", "p", "t", "c")]).to_numpy()
    same = (ki[order][1:] == ki[order][:-1]) & (sides[order][1:] == sides[order][:-1]) \
        & (positions[order][1:] == positions[order][:-1])
    if not same.any():
        return positions
    starts = np.flatnonzero(np.concatenate([[True], ~same]))
    ranks = np.empty(len(order), dtype=np.int64)
    ranks[order] = np.arange(len(order)) - np.repeat(starts, np.diff(np.append(starts, len(order))))
    exploded = ranks > 0
    offsets = positions & ~_SEGMENT_MASK
    too_far = exploded & ((offsets > _OFFSET_MASK) | (ranks >= 1 << _RANK_BITS))
    if too_far.any():
        at = int(np.flatnonzero(too_far)[0])
        raise ConfigError(
            f"epoch {epoch}: the join's {side_names[int(sides[at])]!r} side got "
            f"{int(np.count_nonzero(positions == positions[at]))} rows from one record (position {int(positions[at])}) "
            f"with one key; it tells apart at most {1 << _RANK_BITS} rows of one record and key, in epochs that read "
            f"fewer than {1 << _RANK_SHIFT:,} records of one file: lower max_records_per_epoch, or emit fewer rows "
            "per record in the transform; nothing was committed")
    packed = -((positions & _SEGMENT_MASK) | (ranks << _RANK_SHIFT) | offsets)
    return np.where(exploded, packed, positions)


def _due(txn: ShardTransaction, step: ShardStep, kind: str) -> tuple[np.ndarray, pa.Array]:
    """The keys (key groups, keys) of the waiting rows whose bound is in (W[N-1], W[N]]:
    one range scan per key group of namespace 11, past the previous watermark (every
    earlier bound has left), so it costs what leaves."""
    limit, before, layout = step.watermark, step.watermark_before, step.layout
    empty = (np.zeros(0, dtype=np.int64), pa.array([], pa.int64() if kind == "int" else pa.string()))
    if limit is None or layout is None or step.shard is None or (before is not None and before >= limit):
        return empty
    upper_at = ordered_us(np.array([min(limit, _MAX - 1) + 1])).tobytes()
    lower_at = b"" if before is None else ordered_us(np.array([min(before, _MAX - 1) + 1])).tobytes()
    due: list[bytes] = []
    start, end = layout.key_group_range(step.shard)
    for kg in range(start, end):
        group = namespace_prefix(BY_BOUND_NS) + int(kg).to_bytes(2, "big")
        due.extend(k for k, _ in txn.scan_flushed(group + lower_at, group + upper_at))
    if not due:
        return empty
    entries = pa.array(due, pa.binary())  # ns | kg | bound | side | row | key -> ns 9 | kg | key
    index_keys = pc.binary_join_element_wise(pa.scalar(namespace_prefix(INDEX_NS)), pc.binary_slice(entries, 2, 4),
                                             pc.binary_slice(entries, _BOUND_PREFIX.itemsize, 1 << 30), pa.scalar(b""))
    return decode_keys(kind, index_keys.to_pylist())


def _decode_index(stored: list[bytes | None]) -> np.ndarray:
    """The waiting rows of each key, with its index (``ki``)."""
    counts = np.fromiter((0 if v is None else len(v) // ENTRY.itemsize for v in stored), dtype=np.int64,
                         count=len(stored))
    entries = np.frombuffer(b"".join(v for v in stored if v is not None), dtype=ENTRY)
    out = np.zeros(len(entries), dtype=[("ki", "<i8"), ("side", "u1"), ("matched", "u1"), ("epoch", "<i8"),
                                        ("row", "<i8"), ("time", "<i8")])
    out["ki"] = np.repeat(np.arange(len(stored)), counts)
    for name in ("side", "matched", "epoch", "row", "time"):
        out[name] = entries[name]
    return out


def _pairs(bounds: JoinBounds, w: _Waiting) -> tuple[np.ndarray, np.ndarray]:
    """Every (left, right) pair of one key within the bounds with at least one new row
    (pairs of two waiting rows were emitted when the later came): each new left row
    against every right row, and each new right row against the waiting left rows, by
    range searches over rows sorted by key and time, so a hot key costs its rows and the
    pairs it emits, never its waiting rows squared."""
    left, right = np.flatnonzero(w.side == LEFT), np.flatnonzero(w.side == RIGHT)
    empty = np.zeros(0, dtype=np.int64)
    if not len(left) or not len(right) or not w.new.any():
        return empty, empty
    new_left, old_left, new_right = left[w.new[left]], left[~w.new[left]], right[w.new[right]]
    l1, r1 = _within(w, new_left, right, bounds.lower_us, bounds.upper_us)  # tl + lower <= tr <= tl + upper
    r2, l2 = _within(w, new_right, old_left, -bounds.upper_us, -bounds.lower_us)  # tr - upper <= tl <= tr - lower
    return np.concatenate([l1, l2]), np.concatenate([r1, r2])


def _within(w: _Waiting, queries: np.ndarray, candidates: np.ndarray, low: int,
            high: int) -> tuple[np.ndarray, np.ndarray]:
    """Each of ``queries`` (row indexes) with every one of ``candidates`` of its key whose
    time is in ``[t + low, t + high]``, as (query, candidate) pairs: the candidates sorted
    by (key, time) once, each query's run found by two binary searches. Times are ranked
    first so that (key, rank) packs into one sortable integer."""
    empty = np.zeros(0, dtype=np.int64)
    if not len(queries) or not len(candidates):
        return empty, empty
    ordered = candidates[np.lexsort((w.time[candidates], w.ki[candidates]))]
    q_time = w.time[queries]
    values, rank = np.unique(np.concatenate([w.time[ordered], _shifted(q_time, low), _shifted(q_time, high)]),
                             return_inverse=True)
    n_c, n_q, span = len(ordered), len(queries), len(values) + 1
    packed = w.ki[ordered] * span + rank[:n_c]
    start = np.searchsorted(packed, w.ki[queries] * span + rank[n_c:n_c + n_q], "left")
    counts = np.maximum(np.searchsorted(packed, w.ki[queries] * span + rank[n_c + n_q:], "right") - start, 0)
    total = int(counts.sum())
    within_run = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(queries, counts), ordered[np.repeat(start, counts) + within_run]


def _row_keys(encoded_keys: pa.Array, w: _Waiting) -> pa.Array:
    """Namespace 10's key of every row: ns | kg | key | side | epoch | position (from the
    index keys ``encoded_keys``, ns 9 | kg | key)."""
    suffix = np.empty(len(w.ki), dtype=_ROW_SUFFIX)
    suffix["side"], suffix["epoch"], suffix["row"] = w.side, w.epoch, w.row
    group_and_key = pc.binary_slice(encoded_keys, 2, 1 << 30).take(pa.array(w.ki))
    return pc.binary_join_element_wise(pa.scalar(namespace_prefix(ROWS_NS)), group_and_key, packed_records(suffix),
                                       pa.scalar(b""))


def _bound_keys(key_groups: np.ndarray, encoded_keys: pa.Array, w: _Waiting, rows: np.ndarray,
                bounds: JoinBounds) -> list[bytes]:
    """Namespace 11's key of ``rows``: ns | kg | bound | side | epoch | position | key."""
    prefix = np.empty(len(rows), dtype=_BOUND_PREFIX)
    prefix["ns"], prefix["kg"] = BY_BOUND_NS, key_groups[w.ki[rows]]
    prefix["bound"] = ordered_us(bounds.leaves_at(w.side[rows], w.time[rows]))
    prefix["side"], prefix["epoch"], prefix["row"] = w.side[rows], w.epoch[rows], w.row[rows]
    key_bytes = pc.binary_slice(encoded_keys, 4, 1 << 30).take(pa.array(w.ki[rows]))
    return pc.binary_join_element_wise(packed_records(prefix), key_bytes, pa.scalar(b"")).to_pylist()


def _write(txn: ShardTransaction, join: JoinShard, w: _Waiting, leaves: np.ndarray, key_groups: np.ndarray,
           encoded_keys: pa.Array, index_keys: list[bytes], row_keys: pa.Array, data: pa.Table) -> None:
    """Every change of the epoch into the transaction (one ``WriteBatch`` at flush):
    each key's index rewritten (the matched flags, the rows that came and left), the
    new rows that stay stored, the rows that leave deleted."""
    stays = ~leaves
    order = np.lexsort((w.row, w.epoch, w.side, w.ki))
    order = order[stays[order]]
    entries = np.empty(len(order), dtype=ENTRY)
    entries["side"], entries["matched"] = w.side[order], w.matched[order]
    entries["epoch"], entries["row"], entries["time"] = w.epoch[order], w.row[order], w.time[order]
    counts = np.bincount(w.ki[order], minlength=len(index_keys))
    ends = np.cumsum(counts) * ENTRY.itemsize
    blob = entries.tobytes()
    kept = counts > 0
    starts = ends - counts * ENTRY.itemsize
    txn.set_many([index_keys[i] for i in np.flatnonzero(kept)],
                 [blob[s:e] for s, e in zip(starts[kept].tolist(), ends[kept].tolist(), strict=True)])
    txn.delete_many([index_keys[i] for i in np.flatnonzero(~kept)])
    n_old = int((~w.new).sum())
    stored_new = np.flatnonzero(w.new & stays)
    if len(stored_new):
        texts = data.column(columns.JOIN_ROW).combine_chunks().take(pa.array(stored_new - n_old)).cast(pa.binary())
        txn.set_many(row_keys.take(pa.array(stored_new)).to_pylist(), texts.to_pylist())
        txn.set_many(_bound_keys(key_groups, encoded_keys, w, stored_new, join.bounds), [b""] * len(stored_new))
    gone = np.flatnonzero(~w.new & leaves)
    if len(gone):
        txn.delete_many(row_keys.take(pa.array(gone)).to_pylist())
        txn.delete_many(_bound_keys(key_groups, encoded_keys, w, gone, join.bounds))


def _count(txn: ShardTransaction, step: ShardStep, key_groups: np.ndarray, w: _Waiting, leaves: np.ndarray,
           join: JoinShard) -> np.ndarray:
    """The rows each side holds in the shard after the epoch (kept per key group, so a
    rescale moves the counts with the rows); refuses to grow past ``max_state_rows``."""
    layout = step.layout
    if layout is None or step.shard is None:
        return np.zeros(2, dtype=np.int64)
    start, end = layout.key_group_range(step.shard)
    groups = np.arange(start, end)
    count_keys = [namespace_prefix(COUNTS_NS) + int(kg).to_bytes(2, "big") for kg in groups]
    stored = txn.get_many(count_keys, namespace_prefix(COUNTS_NS), may_scan=False)
    held = np.frombuffer(b"".join(v if v is not None else bytes(16) for v in stored), dtype="<i8")
    held = held.reshape(len(groups), 2).astype(np.int64)
    kg_rows = key_groups[w.ki] - start
    added, removed = w.new & ~leaves, ~w.new & leaves
    for side in (LEFT, RIGHT):
        on = w.side == side
        held[:, side] += np.bincount(kg_rows[on & added], minlength=len(groups)).astype(np.int64)
        held[:, side] -= np.bincount(kg_rows[on & removed], minlength=len(groups)).astype(np.int64)
    changed = np.flatnonzero(np.bincount(kg_rows[added | removed], minlength=len(groups)))
    txn.set_many([count_keys[i] for i in changed], [held[i].astype("<i8").tobytes() for i in changed])
    total = held.sum(axis=0)
    if join.max_state_rows is not None and int(total.sum()) > join.max_state_rows:
        left, right = join.side_names
        raise StateLimitError(
            f"epoch {step.epoch} shard {step.shard}: the join would hold {int(total.sum()):,} waiting rows "
            f"({int(total[0]):,} of {left!r}, {int(total[1]):,} of {right!r}), past max_state_rows="
            f"{join.max_state_rows:,}; nothing was committed. A row waits until the watermark passes its event time "
            f"plus the interval (between=...) and max_out_of_orderness: size max_state_rows to about (rows per second "
            "per shard) x (the interval's width + max_out_of_orderness), narrow between=, lower max_out_of_orderness, "
            "or rescale to more shards (volley rescale --shards); then run the epoch again")
    return total


def _texts(txn: ShardTransaction, w: _Waiting, n_old: int, row_keys: pa.Array, data: pa.Table,
           emitted: np.ndarray) -> pa.Array:
    """The columns' texts of every row, as far as ``emitted`` needs them: the new rows'
    from the epoch, the waiting ones' read from namespace 10 (only those emitted)."""
    waiting = np.unique(emitted[emitted < n_old])
    read = txn.get_many(row_keys.take(pa.array(waiting)).to_pylist(), namespace_prefix(ROWS_NS), may_scan=False) \
        if len(waiting) else []
    found = pa.array(read, pa.binary()).cast(pa.large_string())
    missing = np.flatnonzero(found.is_null().to_numpy(zero_copy_only=False))
    if len(missing):
        raise SnapshotError(
            f"join state: {len(missing)} waiting row(s) lack their columns in namespace {ROWS_NS} "
            f"(first: row {int(w.epoch[waiting[missing[0]]])}:{int(w.row[waiting[missing[0]]])}); the snapshot is "
            "damaged: restore from an earlier epoch")
    position = np.full(len(w.ki), len(waiting) + len(w.ki) - n_old, dtype=np.int64)  # not needed: the null slot
    position[waiting] = np.arange(len(waiting))
    position[n_old:] = len(waiting) + np.arange(len(w.ki) - n_old)
    new_texts = data.column(columns.JOIN_ROW).combine_chunks().cast(pa.large_string())
    return pa.concat_arrays([found, new_texts, pa.nulls(1, pa.large_string())]).take(pa.array(position))


def row_ids(epochs: np.ndarray, rows: np.ndarray, index: np.ndarray) -> pa.Array:
    """Each row's id, ``"<epoch>:<position>"`` (the epoch that read it, its position in
    that epoch's range: unique in the log, the same on every re-run), with ``".<rank>"``
    after it for the second and later rows one record gave one key (``row_numbers``), in
    bulk; null where ``index`` is -1 (the missing side of an outer row)."""
    at = np.maximum(index, 0)
    number = rows[at] if len(index) else np.zeros(0, np.int64)
    packed = np.where(number < 0, -number, 0)
    position = np.where(number < 0, (packed & _SEGMENT_MASK) | (packed & _OFFSET_MASK), number)
    rank = (packed >> _RANK_SHIFT) & ((1 << _RANK_BITS) - 1)
    epoch = pa.array(epochs[at] if len(index) else np.zeros(0, np.int64), pa.int64()).cast(pa.string())
    ids = pc.binary_join_element_wise(epoch, pa.array(position, pa.int64()).cast(pa.string()), pa.scalar(":"))
    if (number < 0).any():
        ranked = pc.binary_join_element_wise(ids, pa.array(rank, pa.int64()).cast(pa.string()), pa.scalar("."))
        ids = pc.if_else(pa.array(number < 0), ranked, ids)
    return pc.if_else(pa.array(index < 0), pa.scalar(None, pa.string()), ids)


def _take_texts(texts: pa.Array, index: np.ndarray) -> pa.Array:
    return texts.take(pa.array(np.maximum(index, 0), pa.int64(), mask=index < 0))
