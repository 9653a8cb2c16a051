"""The shard side of the interval join (``operators/join.py`` has the rules): the rows
each side keeps waiting for a match, in namespaces of the shard that owns the key's key
group, all keyed ``ns | key group | ...`` so a rescale moves them like any keyed state:

```
 9  index      kg | key -> the key's waiting rows: n, then n (side, matched, epoch, position,
                           event time) records, n text lengths, and each row's columns as text
                           (``join_rows.RowCodec``)
17  leaving    kg | first bound | epoch -> the (bound, key) of the rows an epoch stored in the
                           key group, by bound: an epoch finds the keys whose rows leave by
                           reading what the watermark passed, and puts back the rest
12  counts     kg -> rows waiting on the left, on the right (``max_state_rows``, figures)
10, 11         the layout before 2026-12-08 (each row's text, and each row's bound, a key of
               its own): a shard that still has them is rewritten once (``_upgrade``)
```

A waiting row therefore costs its key's one index value and a share of one leaving
entry, not three keys of its own: an epoch writes a value per key it touches and an
entry per key group, and reads the columns of the rows it emits with their index.

One epoch, in bulk: read the leaving entries the watermark reached (one range scan per
key group of namespace 17, up to the new watermark), read the index of every key the
epoch touches or whose rows fall due, join the epoch's rows with each other and with
the waiting ones (range searches over rows sorted by key and time, in NumPy), mark the
matched, let leave every row whose bound the watermark has reached (an unmatched one
of an outer side is emitted with nulls first), and write it all in the shard's one
``WriteBatch``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from volley_dagster import columns
from volley_dagster.errors import ConfigError, SnapshotError, StateLimitError
from volley_dagster.operators.base import OperatorStats, ShardStep, partial_records
from volley_dagster.operators.join_rows import RowCodec
from volley_dagster.state.keys import decode_keys, encode_keys, namespace_prefix
from volley_dagster.state.pending_index import ordered_us
from volley_dagster.state.transaction import ShardTransaction, key_order

INDEX_NS, LEGACY_ROWS_NS, LEGACY_BY_BOUND_NS, COUNTS_NS, LEAVING_NS = 9, 10, 11, 12, 17
JOIN_NAMESPACES_KEYED = (INDEX_NS, LEAVING_NS, COUNTS_NS, LEGACY_ROWS_NS, LEGACY_BY_BOUND_NS)
LEFT, RIGHT = 0, 1
# a row is the epoch that read it and its position in that epoch's range (``columns.POS``);
# the second and later rows one record gives a key (a transform's explode) are told
# apart by their rank among them, packed into a negative position (``row_numbers``)
ENTRY = np.dtype([("side", "u1"), ("matched", "u1"), ("epoch", "<u4"), ("row", "<i8"), ("time", "<i8")])
_LEGACY_ROW_SUFFIX = np.dtype([("side", "u1"), ("epoch", ">u4"), ("row", ">i8")])
_LEAVING_KEY = np.dtype([("ns", ">u2"), ("kg", ">u2"), ("bound", ">u8"), ("epoch", ">u4")])
_UPGRADED_EPOCH = 0  # the leaving entries ``_upgrade`` writes: no epoch is 0
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
    if _upgrade(txn, step, join.bounds):
        txn.flush()  # the leaving entries are read as the last flush left them
    keys_new = data.column(columns.KEY).combine_chunks()
    due_kg, due_keys, reached = _due(txn, step, step.key_kind)
    kg_new = data.column(columns.KEY_GROUP).to_numpy(zero_copy_only=False).astype(np.int64)
    all_keys = pa.concat_arrays([keys_new.cast(due_keys.type), due_keys]) if len(due_keys) else keys_new
    encoded = all_keys.dictionary_encode()
    ki_all = encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    keys = encoded.dictionary
    key_groups = np.zeros(len(keys), dtype=np.int64)
    key_groups[ki_all] = np.concatenate([kg_new, due_kg])
    index_keys = encode_keys(INDEX_NS, key_groups, keys)
    stored = txn.get_many(index_keys, namespace_prefix(INDEX_NS))
    reached.write(txn)  # after the read: an empty cache answers it without a merge

    old, old_texts = decode_index(stored)
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

    texts = pa.concat_arrays([old_texts, data.column(columns.JOIN_ROW).combine_chunks().cast(pa.large_string())])
    had = np.zeros(len(stored), dtype=bool)  # the keys with a value: each holds a row
    had[old["ki"]] = True
    _write(txn, w, ~leaves, key_groups, index_keys, had, texts)
    stays_new = np.flatnonzero(w.new & ~leaves)
    _write_leaving(txn, key_groups[w.ki[stays_new]], join.bounds.leaves_at(w.side[stays_new], w.time[stays_new]),
                   pa.array(index_keys, pa.large_binary()).take(pa.array(w.ki[stays_new])), step.epoch)
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
    return outputs, OperatorStats(len(keys), int(np.count_nonzero(~had)), figures, partial_records(data))


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


@dataclass(frozen=True)
class _Reached:
    """The leaving entries the watermark reached: deleted, with the rows of each that still
    wait put back under their own first bound."""

    entries: list[bytes]
    put_back: tuple[list[bytes], list[bytes]]

    def write(self, txn: ShardTransaction) -> None:
        txn.delete_many(self.entries)
        txn.set_many(*self.put_back)


def _due(txn: ShardTransaction, step: ShardStep, kind: str) -> tuple[np.ndarray, pa.Array, _Reached]:
    """The keys (key groups, keys) of the waiting rows whose bound is in (W[N-1], W[N]]:
    one range scan per key group of namespace 17, over the entries whose first bound the
    watermark reached (every earlier bound has left, so it costs what leaves)."""
    limit, before, layout = step.watermark, step.watermark_before, step.layout
    empty = (np.zeros(0, dtype=np.int64), pa.array([], pa.int64() if kind == "int" else pa.string()),
             _Reached([], ([], [])))
    if limit is None or layout is None or step.shard is None or (before is not None and before >= limit):
        return empty
    upper_at = ordered_us(np.array([min(limit, _MAX - 1) + 1])).tobytes()
    reached: list[tuple[bytes, bytes]] = []
    start, end = layout.key_group_range(step.shard)
    for kg in range(start, end):
        group = namespace_prefix(LEAVING_NS) + int(kg).to_bytes(2, "big")
        reached.extend(txn.scan_flushed(group, group + upper_at))
    if not reached:
        return empty
    due: list[pa.Array] = []
    put_back: tuple[list[bytes], list[bytes]] = ([], [])
    for entry_key, value in reached:
        bounds, keys = _decode_leaving(value)
        cut = int(np.searchsorted(bounds, limit, "right"))
        due.append(keys.slice(0, cut))
        if cut < len(bounds):
            head = np.frombuffer(entry_key, dtype=_LEAVING_KEY)[0]
            put_back[0].append(_leaving_key(int(head["kg"]), int(bounds[cut]), int(head["epoch"])))
            put_back[1].append(_leaving_value(bounds[cut:], keys.slice(cut)))
    groups, keys = decode_keys(kind, pa.concat_arrays(due).to_pylist())
    return groups, keys, _Reached([k for k, _ in reached], put_back)


def _leaving_key(kg: int, bound: int, epoch: int) -> bytes:
    head = np.empty(1, dtype=_LEAVING_KEY)
    head["ns"], head["kg"], head["bound"], head["epoch"] = LEAVING_NS, kg, ordered_us(np.array([bound]))[0], epoch
    return head.tobytes()


def _leaving_value(bounds: np.ndarray, index_keys: pa.Array) -> bytes:
    """``n``, the rows' bounds (ascending) and their index keys (ns 9 | kg | key)."""
    keys = index_keys.cast(pa.large_binary())
    offsets = np.frombuffer(keys.buffers()[1], dtype=np.int64)[keys.offset:keys.offset + len(keys) + 1]
    data = keys.buffers()[2].slice(int(offsets[0]), int(offsets[-1] - offsets[0])).to_pybytes() if len(keys) else b""
    return b"".join((np.array([len(bounds)], "<u4").tobytes(), np.asarray(bounds, "<i8").tobytes(),
                     np.diff(offsets).astype("<u4").tobytes(), data))


def _decode_leaving(value: bytes) -> tuple[np.ndarray, pa.Array]:
    n = int(np.frombuffer(value, "<u4", count=1)[0])
    bounds = np.frombuffer(value, "<i8", count=n, offset=4)
    lengths = np.frombuffer(value, "<u4", count=n, offset=4 + 8 * n).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    data = pa.py_buffer(value[4 + 12 * n:])
    return bounds, pa.Array.from_buffers(pa.large_binary(), n, [None, pa.py_buffer(offsets.tobytes()), data])


def _write_leaving(txn: ShardTransaction, key_groups: np.ndarray, bounds: np.ndarray, index_keys: pa.Array,
                   epoch: int) -> None:
    """One leaving entry per key group for the rows ``epoch`` stores there, by bound."""
    if not len(bounds):
        return
    order = np.lexsort((bounds, key_groups))
    groups, bounds = key_groups[order], bounds[order]
    keys = index_keys.take(pa.array(order))
    starts = np.flatnonzero(np.concatenate([[True], groups[1:] != groups[:-1]]))
    ends = np.append(starts[1:], len(order))
    entry_keys = [_leaving_key(int(groups[a]), int(bounds[a]), epoch) for a in starts.tolist()]
    values = [_leaving_value(bounds[a:b], keys.slice(a, b - a)) for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]
    txn.set_many(entry_keys, values)


_INDEX_ROW = np.dtype([("ki", "<i8"), ("side", "u1"), ("matched", "u1"), ("epoch", "<i8"), ("row", "<i8"),
                       ("time", "<i8")])


def decode_index(stored: Sequence[bytes | None]) -> tuple[np.ndarray, pa.Array]:
    """The waiting rows of each stored index value, with the value's place (``ki``), and
    each row's columns as text, in bulk: the values joined into one buffer, their parts
    gathered by NumPy."""
    lengths = np.fromiter((-1 if v is None else len(v) for v in stored), dtype=np.int64, count=len(stored))
    present = np.flatnonzero(lengths >= 0)
    buffer = np.frombuffer(b"".join(v for v in stored if v is not None), dtype=np.uint8)
    starts = np.cumsum(lengths[present]) - lengths[present]
    sizes = lengths[present]
    counts = _gathered(buffer, starts, np.minimum(sizes, 4)).view("<u4").astype(np.int64) \
        if bool((sizes >= 4).all()) else np.full(len(present), -1)
    _check_sizes(sizes, (counts >= 0) & (4 + counts * (ENTRY.itemsize + 4) <= sizes), present)
    entries = _gathered(buffer, starts + 4, counts * ENTRY.itemsize).view(ENTRY)
    text_lengths = _gathered(buffer, starts + 4 + counts * ENTRY.itemsize, counts * 4).view("<u4").astype(np.int64)
    per_value = np.bincount(np.repeat(np.arange(len(present)), counts), weights=text_lengths,
                            minlength=len(present)).astype(np.int64)
    _check_sizes(sizes, 4 + counts * (ENTRY.itemsize + 4) + per_value == sizes, present)
    text_starts = np.repeat(starts + 4 + counts * (ENTRY.itemsize + 4), counts)
    before = np.cumsum(text_lengths) - text_lengths  # each row's text after its value's first row's
    within = before - before[np.repeat(np.cumsum(counts) - counts, counts)]
    data = _gathered(buffer, text_starts + within, text_lengths)
    offsets = np.concatenate([[0], np.cumsum(text_lengths)]).astype(np.int64)
    texts = pa.Array.from_buffers(pa.large_string(), len(entries),
                                  [None, pa.py_buffer(offsets.tobytes()), pa.py_buffer(data.tobytes())])
    out = np.zeros(len(entries), dtype=_INDEX_ROW)
    out["ki"] = np.repeat(present, counts)
    for name in ("side", "matched", "epoch", "row", "time"):
        out[name] = entries[name]
    return out, texts


def legacy_index(values: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """The rows of index values written before 2026-12-08 (n 22-byte records each, no
    count, no texts), and how many each value holds."""
    sizes = np.array([len(v) for v in values], dtype=np.int64)
    _check_sizes(sizes, sizes % ENTRY.itemsize == 0, np.arange(len(values)))
    return np.frombuffer(b"".join(values), dtype=ENTRY), sizes // ENTRY.itemsize


def _check_sizes(sizes: np.ndarray, fits: np.ndarray, present: np.ndarray) -> None:
    """Refuses, by name, index values that do not hold what their counts say."""
    if bool(fits.all()):
        return
    at = int(np.flatnonzero(~fits)[0])
    legacy = " or written before 2026-12-08 (rows of 22 bytes only)" if sizes[at] % ENTRY.itemsize == 0 else ""
    raise SnapshotError(
        f"join state: {int(np.count_nonzero(~fits))} index value(s) in namespace {INDEX_NS} do not hold the rows "
        f"they count (the first, of key #{int(present[at])}, is {int(sizes[at])} bytes): the snapshot is damaged"
        f"{legacy}; an epoch rewrites a shard of the old layout before anything reads it: run one, or restore "
        "from an earlier epoch")


def _gathered(buffer: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The bytes ``buffer[starts[i]:starts[i] + lengths[i]]`` of every ``i``, joined."""
    total = int(lengths.sum())
    if not total:
        return np.zeros(0, dtype=np.uint8)
    runs = np.cumsum(lengths) - lengths
    return buffer[np.repeat(starts - runs, lengths) + np.arange(total, dtype=np.int64)]


def index_values(w_side: np.ndarray, w_matched: np.ndarray, w_epoch: np.ndarray, w_row: np.ndarray,
                 w_time: np.ndarray, texts: pa.Array, counts: np.ndarray) -> list[bytes]:
    """Each key's index value from its rows (given in key order, ``counts`` per key): the
    parts laid side by side as Arrow binary arrays and joined per key, in C++."""
    entries = np.empty(len(w_side), dtype=ENTRY)
    entries["side"], entries["matched"], entries["epoch"] = w_side, w_matched, w_epoch
    entries["row"], entries["time"] = w_row, w_time
    texts = texts.cast(pa.large_binary())
    text_offsets = np.frombuffer(texts.buffers()[1], dtype=np.int64)[texts.offset:texts.offset + len(texts) + 1]
    bounds = np.concatenate([[0], np.cumsum(counts)])
    parts = [_per_key(counts.astype("<u4").tobytes(), np.arange(len(counts) + 1) * 4),
             _per_key(entries.tobytes(), bounds * ENTRY.itemsize),
             _per_key(np.diff(text_offsets).astype("<u4").tobytes(), bounds * 4),
             pa.Array.from_buffers(pa.large_binary(), len(counts),
                                              [None, pa.py_buffer(text_offsets[bounds].astype(np.int64).tobytes()),
                                               texts.buffers()[2]])]
    return pc.binary_join_element_wise(*parts, pa.scalar(b"", pa.large_binary())).to_pylist()


def _per_key(data: bytes, offsets: np.ndarray) -> pa.Array:
    return pa.Array.from_buffers(pa.large_binary(), len(offsets) - 1,
                                            [None, pa.py_buffer(np.asarray(offsets, np.int64).tobytes()),
                                             pa.py_buffer(data)])


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


def _upgrade(txn: ShardTransaction, step: ShardStep, bounds: JoinBounds) -> bool:
    """A shard written before 2026-12-08 keeps each row's text (namespace 10) and bound
    (11) under keys of their own: its index is rewritten once with the rows' texts, its
    leaving entries written, and those keys deleted, in a batch of its own before the
    epoch's (into the attempt's working copy: a crash leaves the snapshot it started
    from). Whether it did."""
    def scan(ns: int) -> list[tuple[bytes, bytes]]:
        return list(txn.scan_flushed(namespace_prefix(ns), namespace_prefix(ns + 1)))

    by_bound = scan(LEGACY_BY_BOUND_NS)
    if not by_bound:
        return False
    index, stored_texts = scan(INDEX_NS), dict(scan(LEGACY_ROWS_NS))
    entries, counts = legacy_index([v for _, v in index])
    row_index_keys = [k for (k, _), n in zip(index, counts.tolist(), strict=True) for _ in range(n)]
    suffix = np.empty(len(entries), dtype=_LEGACY_ROW_SUFFIX)
    suffix["side"], suffix["epoch"], suffix["row"] = entries["side"], entries["epoch"], entries["row"]
    row_keys = [namespace_prefix(LEGACY_ROWS_NS) + k[2:] + tail
                for k, tail in zip(row_index_keys, suffix.view(f"V{suffix.itemsize}").tolist(), strict=True)]
    texts = [stored_texts.get(k) for k in row_keys]
    if any(t is None for t in texts):
        at = next(i for i, t in enumerate(texts) if t is None)
        raise SnapshotError(
            f"epoch {step.epoch} shard {step.shard}: join state written before 2026-12-08 lacks the columns of "
            f"waiting row {int(entries['epoch'][at])}:{int(entries['row'][at])} in namespace {LEGACY_ROWS_NS}; the "
            "snapshot is damaged: restore from an earlier epoch")
    values = index_values(entries["side"], entries["matched"], entries["epoch"], entries["row"], entries["time"],
                          pa.array(texts, pa.large_binary()).cast(pa.large_string()), counts)
    txn.set_many([k for k, _ in index], values)
    key_groups = np.array([int.from_bytes(k[2:4], "big") for k in row_index_keys], dtype=np.int64)
    _write_leaving(txn, key_groups, bounds.leaves_at(entries["side"], entries["time"].astype(np.int64)),
                   pa.array(row_index_keys, pa.large_binary()), _UPGRADED_EPOCH)
    txn.delete_many(list(stored_texts) + [k for k, _ in by_bound])
    return True


def _write(txn: ShardTransaction, w: _Waiting, stays: np.ndarray, key_groups: np.ndarray, index_keys: list[bytes],
           had: np.ndarray, texts: pa.Array) -> None:
    """Each touched key's index rewritten (the matched flags, the rows that came and
    left, their columns), in key order so the batch is kept as it is; a key left with no
    row deleted. ``had``: the keys that had a value."""
    order = np.lexsort((w.row, w.epoch, w.side, w.ki))
    order = order[stays[order]]
    counts = np.bincount(w.ki[order], minlength=len(index_keys))
    kept = np.flatnonzero(counts > 0)
    values = index_values(w.side[order], w.matched[order], w.epoch[order], w.row[order], w.time[order],
                          texts.take(pa.array(order)), counts[kept])
    in_order = key_order([index_keys[i] for i in kept])
    txn.set_many([index_keys[i] for i in kept[in_order].tolist()], [values[i] for i in in_order.tolist()])
    txn.delete_many([index_keys[i] for i in np.flatnonzero(had & (counts == 0)).tolist()])


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
