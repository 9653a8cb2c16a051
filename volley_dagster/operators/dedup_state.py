"""A deduplication's remembered keys in a shard's state, as runs.

State layout (keyed by key group, so rescaling moves it like any keyed state):

- ``RUNS_NS | key group | epoch``: a run, the keys epoch ``epoch`` remembered in that
  key group with the event time of each one's kept record (Arrow IPC: ``key``,
  ``time``). An epoch writes one run per key group it remembers keys in; forgetting
  rewrites a run without its due keys, or deletes it once all are due.

An epoch reads its shard's runs once, a sequential scan of what the shard remembers
(Spark's ``dropDuplicatesWithinWatermark`` scans its whole state to evict each batch),
and tests its records' keys against them in one hash lookup; it writes a value per
key group, not two entries per key. The remembered set is bounded by the watermark:
a key is in it while its deadline (event time + ``within``) is after the watermark.

Checkpoints written before runs hold a key per entry (``LEGACY_SEEN_NS | key group |
key -> time``, and its deadline index ``LEGACY_BY_DEADLINE_NS``). They are read as
remembered keys too, and the next epoch moves them into its runs and deletes them, in
its own ``WriteBatch``: the layout changes with a committed epoch, never half-way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from volley_dagster.errors import StateLayoutError
from volley_dagster.state.keys import PREFIX_BYTES, decode_keys, key_kind, namespace_prefix
from volley_dagster.state.transaction import ShardTransaction

RUNS_NS = 13
LEGACY_SEEN_NS, LEGACY_BY_DEADLINE_NS = 7, 8  # before runs: ns | kg | key -> time; ns | kg | deadline | key
DEDUP_NAMESPACES = (RUNS_NS, LEGACY_SEEN_NS, LEGACY_BY_DEADLINE_NS)  # the runs first: what state reads decode


def run_key(key_group: int, epoch: int) -> bytes:
    return namespace_prefix(RUNS_NS) + int(key_group).to_bytes(2, "big") + int(epoch).to_bytes(8, "big")


def run_key_group(state_key: bytes) -> int:
    return int.from_bytes(state_key[2:PREFIX_BYTES], "big")


def canonical_keys(keys: pa.Array) -> pa.Array:
    """Keys as runs store them: int64, or UTF-8 strings."""
    return keys.cast(pa.int64() if key_kind(keys.type) == "int" else pa.string())


def encode_run(keys: pa.Array, times: np.ndarray) -> bytes:
    table = pa.table({"key": canonical_keys(keys), "time": pa.array(times, pa.int64())})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def decode_run(state_key: bytes, value: bytes) -> pa.Table:
    """A run (``state_key``: where it is stored, for the error; empty for one in flight)."""
    try:
        return pa.ipc.open_stream(pa.py_buffer(value)).read_all()
    except (pa.ArrowInvalid, OSError) as exc:
        if not state_key:
            raise
        group = run_key_group(state_key)
        epoch = int.from_bytes(state_key[PREFIX_BYTES:], "big")
        raise StateLayoutError(
            f"the deduplication's run of key group {group} written by epoch {epoch} cannot be read ({exc}): the "
            f"snapshot is damaged; restore the checkpoint root from a copy or re-run from an earlier epoch") from exc


@dataclass(frozen=True)
class RememberedKeys:
    """What one shard remembers when an epoch starts (N-1's state): every key, with
    its key group, event time and the run it is in (-1: a legacy per-key entry)."""

    key_groups: np.ndarray
    keys: pa.Array
    times: np.ndarray
    run_of: np.ndarray
    runs: tuple[bytes, ...]  # the runs' state keys, in key order
    legacy: bool  # the shard still holds per-key entries from before runs

    def contains(self, keys: pa.Array) -> np.ndarray:
        """Whether each of ``keys`` is remembered, in one hash lookup."""
        if not len(self.keys) or not len(keys):
            return np.zeros(len(keys), dtype=bool)
        found = pc.is_in(canonical_keys(keys), value_set=self.keys)
        return found.to_numpy(zero_copy_only=False).astype(bool)


def read_remembered(txn: ShardTransaction, kind: str) -> RememberedKeys:
    """The shard's remembered keys as its last flush left them (``kind``: the
    deduplication key's, ``"int"`` or ``"str"``, for legacy entries)."""
    runs = list(txn.scan_flushed(namespace_prefix(RUNS_NS), namespace_prefix(RUNS_NS + 1)))
    tables = [decode_run(k, v) for k, v in runs]
    groups, keys, times = decoded_runs([run_key_group(k) for k, _ in runs], tables, kind)
    run_of = np.repeat(np.arange(len(runs), dtype=np.int64), [t.num_rows for t in tables])
    legacy = list(txn.scan_flushed(namespace_prefix(LEGACY_SEEN_NS), namespace_prefix(LEGACY_SEEN_NS + 1)))
    if legacy:
        legacy_groups, legacy_keys = decode_keys(kind, [k for k, _ in legacy])
        groups = np.concatenate([groups, legacy_groups])
        keys = pa.concat_arrays([keys, canonical_keys(legacy_keys)])
        times = np.concatenate([times, np.frombuffer(b"".join(v for _, v in legacy), dtype="<i8").astype(np.int64)])
        run_of = np.concatenate([run_of, np.full(len(legacy), -1, np.int64)])
    return RememberedKeys(groups, keys, times, run_of, tuple(k for k, _ in runs), bool(legacy))


def decoded_runs(key_groups: list[int], runs: list[pa.Table], kind: str) -> tuple[np.ndarray, pa.Array, np.ndarray]:
    """The key group, key and event time of every entry of ``runs`` (of ``key_groups``), in bulk."""
    groups = np.repeat(np.asarray(key_groups, np.int64), [r.num_rows for r in runs]) if runs else np.zeros(0, np.int64)
    keys = pa.concat_arrays([r.column("key").combine_chunks() for r in runs]) if runs else pa.array(
        [], pa.int64() if kind == "int" else pa.string())
    times = np.concatenate([r.column("time").to_numpy() for r in runs]) if runs else np.zeros(0, np.int64)
    return groups, keys, times.astype(np.int64)


def runs_by_key_group(key_groups: np.ndarray, keys: pa.Array, times: np.ndarray) -> list[tuple[int, bytes]]:
    """``keys`` (and their event times) as one run per key group, in key group order."""
    if not len(keys):
        return []
    # a radix sort: key groups fit 16 bits (ShardLayout allows at most 65,535; run_key stores 2 bytes)
    order = np.argsort(key_groups.astype(np.uint16), kind="stable")
    cuts = [*np.flatnonzero(np.diff(key_groups[order], prepend=-1)).tolist(), len(order)]
    return [(int(key_groups[order[lo]]), encode_run(keys.take(pa.array(order[lo:hi])), times[order[lo:hi]]))
            for lo, hi in zip(cuts[:-1], cuts[1:], strict=True)]


def write_remembered(txn: ShardTransaction, remembered: RememberedKeys, due: np.ndarray, epoch: int,
                     key_groups: np.ndarray, keys: pa.Array, times: np.ndarray) -> None:
    """Forget the ``due`` remembered keys (a run all due is deleted, one partly due
    rewritten) and remember ``keys`` in this epoch's runs, with any legacy entries
    that are not due (whose namespaces are then emptied)."""
    deletes: list[bytes] = []
    writes: dict[bytes, bytes] = {}
    if len(remembered.runs):
        in_runs = remembered.run_of[remembered.run_of >= 0]  # the runs' entries come first, run by run
        bounds = np.searchsorted(in_runs, np.arange(len(remembered.runs) + 1))
        for i, state_key in enumerate(remembered.runs):
            lo, hi = int(bounds[i]), int(bounds[i + 1])
            gone = due[lo:hi]
            if gone.all():
                deletes.append(state_key)
            elif gone.any():
                stay = np.flatnonzero(~gone) + lo
                writes[state_key] = encode_run(remembered.keys.take(pa.array(stay)), remembered.times[stay])
    if remembered.legacy:
        moved = np.flatnonzero((remembered.run_of < 0) & ~due)
        key_groups = np.concatenate([remembered.key_groups[moved], key_groups])
        keys = pa.concat_arrays([remembered.keys.take(pa.array(moved)), canonical_keys(keys)])
        times = np.concatenate([remembered.times[moved], times])
        for ns in (LEGACY_SEEN_NS, LEGACY_BY_DEADLINE_NS):
            deletes.extend(k for k, _ in txn.scan_flushed(namespace_prefix(ns), namespace_prefix(ns + 1)))
    if len(keys) and any(k[PREFIX_BYTES:] == int(epoch).to_bytes(8, "big") for k in remembered.runs):
        raise StateLayoutError(f"the deduplication's state this epoch starts from already holds runs of epoch "
                               f"{epoch}: it is not epoch {epoch - 1}'s snapshot")
    for group, run in runs_by_key_group(key_groups, keys, times):
        writes[run_key(group, epoch)] = run
    if deletes:
        txn.delete_many(deletes)
    if writes:
        txn.set_many(list(writes), list(writes.values()))
