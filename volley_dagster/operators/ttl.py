"""State TTL for running aggregates: a key not updated for a while expires.

The rules (decided per epoch, so a re-run decides the same):

- A key's state record carries ``_touched``: the epoch of its last update
  (``ttl_epochs``), or the latest event time it has seen (``ttl`` on event time).
  Its deadline is ``_touched + ttl``.
- Epoch N first merges its records, then expires every key whose deadline is at
  or before the epoch's limit: N itself (epochs), or the watermark after N (event
  time). By epochs, a key updated in epoch N so lives on. On event time, a key
  whose latest event time is already older than the watermark less the TTL (a late
  record) expires in the epoch that updated it. A key that expires is deleted from
  state and emitted once with ``expired = true`` (an upsert sink deletes its row,
  an append sink keeps the row); if it comes back, it starts from empty.

Finding the expired keys costs what expires, not the state held: each shard keeps
an expiry index ordered by deadline, the pending-window index's shape
(``state/pending_index.py``: lazily restored, popped as a sorted prefix, evicted to
RocksDB beyond a bound). Every live key has exactly one entry, with a deadline no
later than its own; an update leaves the entry as it is, and when the entry comes
due the key's record decides: expired, or a new entry at its current deadline. So
a key updated every epoch costs one index entry per TTL period, not one per update.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column
from pyspark.sql import functions as F

from volley_dagster.errors import ConfigError
from volley_dagster.json_records import JsonObject
from volley_dagster.operators.base import ShardStep, StateNamespaces
from volley_dagster.operators.event_time import EventTime
from volley_dagster.state.keys import namespace_prefix
from volley_dagster.state.pending_index import PersistentPendingIndex
from volley_dagster.state.transaction import ShardTransaction

EXPIRY_NS, EXPIRY_META_NS = 5, 6  # ns | deadline | state key; the in-memory part and its meta record
EXPIRED = "expired"  # the output column: true on a key's last row, the one that expires it
TOUCHED = "_touched"  # the state record's field
TOUCHED_PARTIAL = "_volley_touched"  # event time: a key's latest event time in the epoch (microseconds)
DEFAULT_MAX_RESIDENT_ENTRIES = 100_000
KEYS_EXPIRED = "keys_expired"  # the epoch's figure: keys deleted (and emitted with expired = true)
NEXT_DUE = "expiry_next"  # a shard's figure: its earliest deadline (NO_ENTRY: none)
_MAX = np.iinfo(np.int64).max


@dataclass(frozen=True)
class StateTtl:
    """``epochs``: a key expires once that many epochs pass without an update; or
    ``duration_us`` on ``event_time``: once the watermark passes its latest event time
    plus the duration. ``max_resident_entries``: the in-memory expiry index per shard."""

    epochs: int | None = None
    duration_us: int | None = None
    event_time: EventTime | None = None
    max_resident_entries: int | None = DEFAULT_MAX_RESIDENT_ENTRIES

    def __post_init__(self) -> None:
        if (self.epochs is None) == (self.duration_us is None):
            raise ConfigError("aggregate(...): give either ttl= (a duration, on event_time=) or ttl_epochs=, not both")
        if self.epochs is not None and self.epochs < 1:
            raise ConfigError(f"ttl_epochs must be at least 1, got {self.epochs}")
        if self.duration_us is not None:
            if self.event_time is None:
                raise ConfigError("aggregate(ttl=...) expires keys on event time: name the timestamp column with "
                                  "event_time='...' (or count epochs with ttl_epochs=)")
            if self.duration_us < 1:
                raise ConfigError("aggregate(ttl=...) must be positive")
        if self.max_resident_entries is not None and self.max_resident_entries < 1:
            raise ConfigError(f"max_expiry_entries must be positive or None, got {self.max_resident_entries}")

    @property
    def amount(self) -> int:
        return self.epochs if self.epochs is not None else int(self.duration_us or 0)

    @property
    def by_epochs(self) -> bool:
        return self.epochs is not None

    def layout(self) -> JsonObject:
        """What must not change between epochs of one checkpoint root (the skew bound may)."""
        if self.event_time is None:
            return {"epochs": self.epochs}
        return {"duration_us": self.duration_us, "time_column": self.event_time.time_column,
                "out_of_orderness_us": self.event_time.out_of_orderness_us}

    @classmethod
    def recorded(cls, layout: JsonObject) -> StateTtl:
        if "epochs" in layout:
            return cls(epochs=layout["epochs"])
        return cls(duration_us=layout["duration_us"],
                   event_time=EventTime(layout["time_column"], layout["out_of_orderness_us"]))

    @property
    def namespaces(self) -> tuple[int, int]:
        return EXPIRY_NS, EXPIRY_META_NS

    def partial_exprs(self) -> list[Column]:
        """Event time: each key's latest event time, pre-aggregated with its partials."""
        if self.event_time is None:
            return []
        return [F.max(self.event_time.event_us()).alias(TOUCHED_PARTIAL)]

    def limit(self, step: ShardStep) -> int | None:
        """Keys whose deadline is at or before this expire in the step's epoch (None: none)."""
        return step.epoch if self.by_epochs else step.expire_limit


def with_ttl_namespaces(keyed: int, ttl: StateTtl | None) -> StateNamespaces:
    """A running aggregate's namespaces: its keyed state, and with a TTL the expiry index."""
    if ttl is None:
        return StateNamespaces((keyed,))
    return StateNamespaces((keyed,), EXPIRY_NS, EXPIRY_META_NS)


class ShardExpiry:
    """One shard's TTL work in one epoch. Built before the state lookup: it pops the
    entries due at the epoch's limit, so the lookup reads the keys they name
    (``due``) together with the epoch's own."""

    def __init__(self, ttl: StateTtl, txn: ShardTransaction, step: ShardStep, touched: list[bytes]) -> None:
        self.ttl = ttl
        self.epoch = step.epoch
        self.limit = ttl.limit(step)
        self.index = PersistentPendingIndex(txn, namespace_prefix(EXPIRY_META_NS), namespace_prefix(EXPIRY_NS),
                                            ttl.max_resident_entries, evict_latest=True)
        popped = self.index.pop_due(self.limit) if self.limit is not None and self.index.may_fire(self.limit) else []
        self.refreshed = np.zeros(len(touched), dtype=bool)  # touched keys whose entry came due
        self.due: list[bytes] = []  # keys whose entry came due, not touched
        if popped:
            popped_arr, touched_arr = pa.array(popped, pa.binary()), pa.array(touched, pa.binary())
            self.refreshed = pc.is_in(touched_arr, value_set=popped_arr).to_numpy(zero_copy_only=False)
            untouched = pc.invert(pc.is_in(popped_arr, value_set=touched_arr))
            self.due = popped_arr.filter(untouched).to_pylist()
        self.expired = 0

    def settle(self, keys: list[bytes], state: np.ndarray, existed: np.ndarray, touched_now: np.ndarray) -> np.ndarray:
        """After the merge: stamp the touched rows (the first ``len(touched_now)``), and
        return which rows expire now. Rows are the touched keys, then ``due``; the index
        gets an entry for each key that lives on and lost, or never had, one."""
        n, rows = len(touched_now), len(state)
        is_touched = np.arange(rows) < n
        stamps = state[TOUCHED]
        stamps[:n] = np.where(existed[:n], np.maximum(stamps[:n], touched_now), touched_now)
        deadline = np.minimum(stamps, _MAX - self.ttl.amount) + self.ttl.amount
        live = existed | is_touched  # a due entry whose key is gone names nothing
        expired = live & (deadline <= self.limit) if self.limit is not None else np.zeros(rows, dtype=bool)
        lost_entry = np.concatenate([~existed[:n] | self.refreshed, np.ones(rows - n, dtype=bool)])
        needs_entry = live & ~expired & lost_entry
        if needs_entry.any():
            self.index.add(np.array(keys, dtype=object)[needs_entry], deadline[needs_entry], self.epoch)
        self.index.flush()
        self.expired = int(expired.sum())
        return expired

    def figures(self) -> dict[str, int]:
        """For the manifest; ``expiry_next``: the earliest deadline left (absent: unknown),
        so that an epoch without records and nothing due can skip the shard tasks."""
        figures = {KEYS_EXPIRED: self.expired, "expiry_resident": self.index.meta.resident,
                   "expiry_evicted": self.index.meta.evicted}
        next_due = self.index.next_due()
        return figures if next_due is None else {**figures, NEXT_DUE: next_due}


def next_due(figures: list[dict[str, int]]) -> int | None:
    """The earliest deadline over a committed epoch's shards (None: some shard did not say)."""
    dues = [f.get(NEXT_DUE) for f in figures]
    return None if not dues or any(d is None for d in dues) else min(d for d in dues if d is not None)
