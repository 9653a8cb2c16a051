"""What a stateful operator is to the engine: Spark-side partials, then one call per
shard task that folds them into the shard's state through its transaction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from volley_dagster.state.transaction import ShardTransaction


@dataclass(frozen=True)
class ShardStep:
    """What a shard task knows about the epoch beyond its own rows."""

    epoch: int
    key_kind: str  # "int" | "str": how state keys encode the key
    fire_limit: int | None = None  # windows ending at or before this fire (microseconds)


class StatefulOperator(Protocol):
    @property
    def resident_records(self) -> np.dtype | None:
        """One key's state as a fixed-width record, when a shard's state can stay
        resident between epochs (``state/resident.py``); None: RocksDB only."""

    def layout(self) -> dict[str, Any]:
        """What must not change between epochs of one checkpoint root."""

    def output_ddl(self) -> list[str]:
        """Spark DDL of the output columns after the key."""

    def output_names(self) -> list[str]:
        """Names of the output columns after the key."""

    def apply(self, txn: ShardTransaction, data: pa.Table, step: ShardStep) -> tuple[list[pa.Array], dict[str, Any]]:
        """Fold one shard's partials (key, key group and partial columns) into state;
        returns the output columns (key first) and statistics for the manifest."""
