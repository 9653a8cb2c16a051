"""An upsert table whose files each hold one shard's keys, so that each shard task
rewrites its own files with the epoch's changes, side by side with the others, and the
sink commits their remove and add actions in the epoch's one commit
(``TableSink._rewrite_files``), instead of the driver MERGEing every changed row into
the whole table alone.

A file's name says whose keys it holds: the shard's key-group range (``state/keys.py``)
and, inside it, one of ``buckets`` buckets by a hash of the key, so that a shard with
many rows rewrites only the buckets an epoch touched. A shard's buckets double when its
rows would pass ``max_rows_per_file`` a file; its files are then rewritten once into
the new buckets.

The layout holds while every file of the table is one of these, named for a shard's
own key-group range. Any other file (a MERGE's, another writer's, or one from before a
rescale moved the ranges) leaves the sink MERGEing the rows as before, as does a table
whose files changed between the plan and the commit (a commit that changed only its
metadata, such as a migration's added column, does not count: the tasks' old rows get
nulls in it, as a MERGE leaves the rows it does not touch). A task that cannot rewrite
its files (one vanished, it has a column the rows lack) says why, and the sink MERGEs
that epoch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from volley_dagster.json_records import JsonObject
from volley_dagster.sinks.staged_files import StagedFile, StagingTarget, same_columns, stage_rows
from volley_dagster.state.keys import ShardLayout, string_key_hashes

MAX_ROWS_PER_FILE = 1_000_000
_NAME = re.compile(r"^volley-kg(\d{5})-(\d{5})-of-(\d{5})-b(\d{4})-of-(\d{4})-e\d+-[0-9a-f]+\.parquet$")


@dataclass(frozen=True)
class OwnedFile:
    """A file of the table holding bucket ``bucket`` of ``buckets`` of one shard's keys."""

    path: str  # relative to the table, as its log names it
    size: int
    rows: int
    bucket: int
    buckets: int


@dataclass(frozen=True)
class ShardFilesPlan:
    """One upsert sink's files per shard at table ``version`` (None: no table yet),
    given to every shard task with the columns it needs to rewrite them."""

    version: int | None
    key_column: str
    expiry_column: str | None  # true on a key's expiry: its row is deleted
    files: dict[int, tuple[OwnedFile, ...]] = field(default_factory=dict)
    max_rows_per_file: int = MAX_ROWS_PER_FILE


@dataclass(frozen=True)
class ShardRewrite:
    """What one shard task did to its files: the files it replaces and the ones that
    replace them, and the rows inserted, updated and deleted (a MERGE's counts).
    ``refused``: why it rewrote nothing, and the sink MERGEs the epoch instead."""

    shard: int
    removed: tuple[OwnedFile, ...] = ()
    added: tuple[StagedFile, ...] = ()
    inserted: int = 0
    updated: int = 0
    deleted: int = 0
    refused: str | None = None

    def to_dict(self) -> JsonObject:
        return {"shard": self.shard, "removed": [vars(f) for f in self.removed],
                "added": [f.to_dict() for f in self.added], "inserted": self.inserted,
                "updated": self.updated, "deleted": self.deleted, "refused": self.refused}

    @classmethod
    def from_dict(cls, d: JsonObject) -> ShardRewrite:
        return cls(d["shard"], tuple(OwnedFile(**f) for f in d["removed"]),
                   tuple(StagedFile.from_dict(f) for f in d["added"]), d["inserted"], d["updated"], d["deleted"],
                   d["refused"])


@dataclass(frozen=True)
class RewrittenFiles:
    """Every shard's rewrite of one sink's files, all planned on table ``version``
    (None: no table yet), whose files were ``planned``."""

    version: int | None
    shards: tuple[ShardRewrite, ...]
    planned: frozenset[str] = frozenset()

    def planned_on(self, files: Iterable[str] | None) -> bool:
        """Whether a table holding ``files`` (None: no table) is the one the rewrite was planned on."""
        if files is None or self.version is None:
            return files is None and self.version is None
        return frozenset(files) == self.planned

    @property
    def removed(self) -> list[OwnedFile]:
        return [f for s in self.shards for f in s.removed]

    @property
    def added(self) -> list[StagedFile]:
        return [f for s in self.shards for f in s.added]

    def counts(self) -> dict[str, int]:
        return {"inserted": sum(s.inserted for s in self.shards), "updated": sum(s.updated for s in self.shards),
                "deleted": sum(s.deleted for s in self.shards), "files_removed": len(self.removed),
                "files_added": len(self.added)}


def collected(plan: ShardFilesPlan, rewrites: list[ShardRewrite], num_shards: int) -> RewrittenFiles | None:
    """The shard tasks' rewrites of one sink, when every shard rewrote its files (None:
    one refused, and the sink MERGEs the epoch's rows)."""
    if sorted(r.shard for r in rewrites) != list(range(num_shards)) or any(r.refused for r in rewrites):
        return None
    return RewrittenFiles(plan.version, tuple(sorted(rewrites, key=lambda r: r.shard)),
                          frozenset(f.path for files in plan.files.values() for f in files))


def file_name(layout: ShardLayout, shard: int, bucket: int, buckets: int, epoch: int, attempt: str) -> str:
    start, end = layout.key_group_range(shard)
    return (f"volley-kg{start:05d}-{end:05d}-of-{layout.num_key_groups:05d}-b{bucket:04d}-of-{buckets:04d}"
            f"-e{epoch:010d}-{attempt}.parquet")


def owned_files(files: Iterable[tuple[str, int, int | None]], layout: ShardLayout) -> dict[int, tuple[OwnedFile, ...]] | None:
    """The table's files (path, size, rows) per shard of ``layout``; None when any file
    is not one a shard task wrote for its own key groups, or a shard's buckets disagree."""
    ranges = {layout.key_group_range(s): s for s in range(layout.num_shards)}
    per_shard: dict[int, list[OwnedFile]] = {}
    for path, size, rows in files:
        match = _NAME.match(path)
        if match is None or rows is None:
            return None
        start, end, groups, bucket, buckets = (int(g) for g in match.groups())
        shard = ranges.get((start, end))
        if shard is None or groups != layout.num_key_groups or bucket >= buckets:
            return None
        per_shard.setdefault(shard, []).append(OwnedFile(path, size, rows, bucket, buckets))
    for owned in per_shard.values():
        if len({f.buckets for f in owned}) != 1 or len({f.bucket for f in owned}) != len(owned):
            return None
    return {s: tuple(owned) for s, owned in per_shard.items()}


def rewrite_shard(rows: pa.Table, target: StagingTarget, layout: ShardLayout, shard: int, epoch: int,
                  attempt: str) -> ShardRewrite:
    """Shard ``shard``'s files with the epoch's ``rows`` (each of its changed keys once)
    upserted and its expired keys deleted, written into the table's folder."""
    plan = target.rewrite
    assert plan is not None
    if not rows.num_rows:
        return ShardRewrite(shard)
    key, expiry = plan.key_column, plan.expiry_column
    kept = rows
    if expiry is not None and expiry in rows.column_names:
        kept = rows.filter(pc.invert(pc.fill_null(rows.column(expiry), False))).drop_columns([expiry])
    owned = plan.files.get(shard, ())
    had = owned[0].buckets if owned else 1
    buckets = max(had, _power_of_two_at_least(-(-(sum(f.rows for f in owned) + kept.num_rows) // plan.max_rows_per_file)))
    changed = rows.column(key).combine_chunks()
    reading = owned  # a shard whose buckets doubled rewrites all its files into the new ones
    if buckets == had:
        touched = set(np.unique(buckets_of(changed, buckets)).tolist())
        reading = tuple(f for f in owned if f.bucket in touched)
    try:
        old = _read(Path(target.folder), reading, kept.schema)
    except (OSError, pa.ArrowInvalid) as exc:
        return ShardRewrite(shard, refused=f"shard {shard}: its files could not be read ({exc})")
    if isinstance(old, str):
        return ShardRewrite(shard, refused=f"shard {shard}: {old}")
    found = pc.is_in(old.column(key), value_set=changed)
    matched = int(pc.sum(found).as_py() or 0)
    deleted = 0
    if kept.num_rows != rows.num_rows:
        gone = rows.filter(pc.fill_null(rows.column(expiry), False)).column(key).combine_chunks()
        deleted = int(pc.sum(pc.is_in(old.column(key), value_set=gone)).as_py() or 0)
    merged = pa.concat_tables([old.filter(pc.invert(found)), kept])
    added = tuple(stage_rows(part, target, file_name(layout, shard, bucket, buckets, epoch, attempt), key)
                  for bucket, part in _by_bucket(merged, key, buckets))
    return ShardRewrite(shard, reading, added, inserted=kept.num_rows - (matched - deleted),
                        updated=matched - deleted, deleted=deleted)


def buckets_of(keys: pa.Array, buckets: int) -> np.ndarray:
    """Each key's bucket of ``buckets``: a 64-bit mix of the key (an int's own bits, a
    string's FNV-1a), stable across processes and machines."""
    if buckets == 1:
        return np.zeros(len(keys), np.int64)
    if pa.types.is_integer(keys.type):
        h = keys.to_numpy(zero_copy_only=False).astype(np.int64).view(np.uint64)
    else:
        h = string_key_hashes(keys).view(np.uint64)
    h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)  # splitmix64's finaliser
    h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    h ^= h >> np.uint64(31)
    return (h % np.uint64(buckets)).astype(np.int64)


def _by_bucket(rows: pa.Table, key: str, buckets: int) -> Iterable[tuple[int, pa.Table]]:
    if buckets == 1:
        if rows.num_rows:
            yield 0, rows
        return
    of = buckets_of(rows.column(key).combine_chunks(), buckets)
    order = np.argsort(of, kind="stable")
    bounds = np.searchsorted(of[order], np.arange(buckets + 1))
    for bucket in range(buckets):
        if bounds[bucket + 1] > bounds[bucket]:
            yield bucket, rows.take(pa.array(order[bounds[bucket]:bounds[bucket + 1]]))


def _read(folder: Path, files: tuple[OwnedFile, ...], schema: pa.Schema) -> pa.Table | str:
    """The files' rows as ``schema``, null in the columns a migration added since they
    were written; a string says why they cannot be (a column the rows lack)."""
    parts = []
    for f in files:
        part = pq.read_table(folder / f.path)
        extra = [n for n in part.schema.names if n not in schema.names]
        if extra:
            return f"file {f.path} has columns {extra} the epoch's rows lack"
        part = pa.table({c.name: part.column(c.name) if c.name in part.schema.names else pa.nulls(part.num_rows, c.type)
                         for c in schema})
        if not same_columns(part.schema, schema):
            return f"file {f.path} has columns {part.schema}, the epoch's rows {schema}"
        parts.append(part.cast(schema))
    return pa.concat_tables(parts) if parts else schema.empty_table()


def _power_of_two_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
