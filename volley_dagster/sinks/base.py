"""The sink interface: an epoch's output is committed once, and the sink itself
(its own metadata, not a local file) says which epochs it already holds."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from volley_dagster.errors import ConfigError


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

    @abstractmethod
    def epoch_history(self, pipeline: str) -> dict[int, list[int]]:
        """Per epoch of ``pipeline``, the row count of each commit tagged with it, read
        from the sink's own history. Exactly-once means one entry per epoch."""

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "type": type(self).__name__}


def commit_tags(ctx: CommitContext, rows: int) -> dict[str, str]:
    """The properties every sink stores with an epoch's commit."""
    return {"volley.pipeline": ctx.pipeline, "volley.epoch": str(ctx.epoch), "volley.rows": str(rows)}


def upsert_keys(sink: Sink, mode: str, key_columns: tuple[str, ...] | None, ctx: CommitContext) -> tuple[str, ...]:
    """The columns an upsert matches on: the sink's own, else the pipeline's key."""
    if mode != "upsert":
        return ()
    keys = key_columns or ctx.key_columns
    if not keys:
        raise ConfigError(f"{type(sink).__name__} {sink.name!r} upserts but has no key columns")
    return tuple(keys)
