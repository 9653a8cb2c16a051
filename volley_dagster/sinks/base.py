"""The sink interface: an epoch's output is committed once, and the sink itself
(its own metadata, not a local file) says which epochs it already holds."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import pyarrow as pa


@dataclass(frozen=True)
class CommitContext:
    pipeline: str
    epoch: int
    key_columns: tuple[str, ...]


class Sink(ABC):
    name: str

    @abstractmethod
    def committed_epoch(self, pipeline: str) -> int | None:
        """The highest epoch of ``pipeline`` this sink holds, read from the sink itself."""

    @abstractmethod
    def commit(self, output: pa.Table, ctx: CommitContext) -> dict[str, Any]:
        """Write one epoch's output atomically; returns what the manifest records."""

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "type": type(self).__name__}
