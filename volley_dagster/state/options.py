"""RocksDB options for state shards: point-lookup friendly, compressed, WAL-free writes."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import rocksdict

from volley_dagster.errors import ConfigError

_BLOCK_CACHES: dict[int, rocksdict.Cache] = {}


@dataclass(frozen=True)
class RocksDBOptions:
    """Tuning knobs; the defaults suit one shard per task with a few million keys."""

    block_cache_mb: int = 64
    bloom_bits_per_key: float = 10.0
    write_buffer_mb: int = 64
    background_jobs: int = 2
    compact_every: int = 10
    compact_together: int = field(default_factory=lambda: os.cpu_count() or 1)
    compact_l0_files: int = 20
    compact_l0_share: float = 2.0
    compact_in_background: bool = True  # the driver's compactor folds committed snapshots (``state/compactor.py``)

    def __post_init__(self) -> None:
        for name in ("compact_every", "compact_together", "compact_l0_files"):
            if getattr(self, name) < 1:
                raise ConfigError(f"RocksDBOptions.{name} must be at least 1, got {getattr(self, name)}")

    def build(self) -> rocksdict.Options:
        opts = rocksdict.Options(raw_mode=True)
        opts.create_if_missing(True)
        # A shard is open for one epoch: RocksDB's own compactions started at every open
        # past four level-0 files, took a core beside the tasks and were dropped unfinished
        # at close, so level 0 only grew. The shard compacts when its snapshot is due one.
        opts.set_disable_auto_compactions(True)
        table = rocksdict.BlockBasedOptions()
        table.set_bloom_filter(self.bloom_bits_per_key, False)  # type: ignore[arg-type]  # the stub says int; RocksDB takes a double
        table.set_block_cache(_shared_cache(self.block_cache_mb))
        table.set_cache_index_and_filter_blocks(True)
        opts.set_block_based_table_factory(table)
        opts.set_compression_type(rocksdict.DBCompressionType.lz4())
        opts.set_bottommost_compression_type(rocksdict.DBCompressionType.zstd())
        opts.set_write_buffer_size(self.write_buffer_mb * 1024 * 1024)
        opts.set_max_background_jobs(self.background_jobs)
        return opts

    def compaction_turn(self, epoch: int, shard: int) -> bool:
        """Whether ``epoch`` is ``shard``'s turn to compact. Shards see the same churn, so
        without turns they all compacted in the same epoch, a spike of every shard's
        compaction at once. Turns come every ``compact_every`` epochs to groups of
        ``compact_together`` consecutive shards (as many as run at once: the default is
        this machine's cores, what ``local[*]`` runs; a cluster sets its task slots),
        group g at the epochs where ``(epoch - g) % compact_every == 0``: a group's
        compactions fill the cores side by side, where one alone left the others idle."""
        return (epoch - shard // self.compact_together) % self.compact_every == 0

    def compaction_due(self, level0_files: int, newer_bytes: int, base_bytes: int, turn: bool = False,
                       backstop: bool = False) -> bool:
        """Whether a shard folds level 0 into its base before a snapshot: on its turn;
        out of it, only at ``compact_l0_files`` files (a shard that missed its turns,
        each file one more place a read looks) or when the files newer than the base hold
        more than ``compact_l0_share`` times its bytes (the space of keys written again: a
        shard whose every key changes compacts every second or third epoch). A lone
        file, never. ``backstop``: a task's own check while the background compactor
        does this work (``compact_in_background``), for a shard whose compactions it
        missed: only at the cap or at twice the share, never on a turn."""
        if level0_files < 2:
            return False
        if backstop:
            return level0_files >= self.compact_l0_files or newer_bytes > 2 * self.compact_l0_share * base_bytes
        if turn:
            return True
        return level0_files >= self.compact_l0_files or newer_bytes > self.compact_l0_share * base_bytes


def _shared_cache(mb: int) -> rocksdict.Cache:
    """One block cache per process and size, shared by every shard it opens."""
    if mb not in _BLOCK_CACHES:
        _BLOCK_CACHES[mb] = rocksdict.Cache(mb * 1024 * 1024)
    return _BLOCK_CACHES[mb]


def write_options() -> rocksdict.WriteOptions:
    """No WAL: every flush is followed by a checkpoint, which is the durable copy."""
    wo = rocksdict.WriteOptions()
    wo.disable_wal = True  # type: ignore[method-assign,assignment]  # a property in rocksdict, a method in its stub
    return wo
