"""How a runner runs its pipeline's epochs: one record, checked once, carried whole from
the runner to each epoch attempt instead of as separate keyword arguments."""

from __future__ import annotations

import os
import tempfile
import warnings
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Mapping

from volley_dagster.checkpoint.lease import DEFAULT_TTL_S, DEFAULT_WAIT_S
from volley_dagster.checkpoint.s3_snapshots import S3SnapshotStore
from volley_dagster.checkpoint.state_reader import ReadSettings
from volley_dagster.errors import ConfigError
from volley_dagster.state.options import RocksDBOptions
from volley_dagster.state.resident import ResidentStateCache
from volley_dagster.state.transaction import DEFAULT_SCAN_FRACTION


def default_snapshot_cache() -> str:
    """This user's folder under the system temp dir: a snapshot cache must be its user's alone."""
    return str(Path(tempfile.gettempdir()) / f"volley-snapshot-cache-{os.getuid()}")


@dataclass(frozen=True)
class RunSettings:
    """How a runner runs epochs (``EpochRunner(pipeline, root, RunSettings(...))``):

    - ``max_records_per_epoch``: how much one cut takes at most (None: everything waiting).
    - ``keep_epochs``: committed epochs whose snapshots retention keeps (at least 1).
    - ``rocksdb``: RocksDB options of the shard stores (``state/options.py``).
    - ``scan_fraction``: above this share of a shard's keys touched, read the shard
      with one scan instead of ``multi_get``.
    - ``verify_checksums``: hash every file of N-1's snapshots before restoring them
      (default: sizes only; the asset check hashes the files each run made new).
    - ``snapshot_store``: also keep every shard snapshot on S3, incrementally (only
      new SSTs upload); a task whose machine lacks N-1's snapshot restores it from
      there into ``snapshot_cache`` (default: this user's folder under the system
      temp dir; it must be this user's alone).
    - ``resident_state``: keep running-aggregate shards' state in the machines' memory
      between epochs (``state/resident.py``; default: as ``VOLLEY_RESIDENT_STATE_MIB``
      says); None reads state from RocksDB every epoch.
    - ``lease_wait_s``: how long a run waits for another runner of the pipeline to
      finish before ``PipelineBusyError``; ``lease_ttl_s``: how long a holder on
      another machine counts as alive after its last heartbeat."""

    max_records_per_epoch: int | None = 1_000_000
    keep_epochs: int = 3
    rocksdb: RocksDBOptions = field(default_factory=RocksDBOptions)
    scan_fraction: float = DEFAULT_SCAN_FRACTION
    verify_checksums: bool = False
    snapshot_store: S3SnapshotStore | None = None
    snapshot_cache: str = field(default_factory=default_snapshot_cache)
    resident_state: ResidentStateCache | None = field(default_factory=ResidentStateCache.from_env)
    lease_wait_s: float = DEFAULT_WAIT_S
    lease_ttl_s: float = DEFAULT_TTL_S

    def __post_init__(self) -> None:
        if self.keep_epochs < 1:
            raise ConfigError(f"keep_epochs must be at least 1 (the last committed epoch), got {self.keep_epochs}")
        if self.max_records_per_epoch is not None and self.max_records_per_epoch < 1:
            raise ConfigError(f"max_records_per_epoch must be positive or None, got {self.max_records_per_epoch}")

    @property
    def reading(self) -> ReadSettings:
        """What reading snapshots needs of these (state reads, the dedup probe)."""
        return ReadSettings(self.snapshot_store, self.snapshot_cache, self.rocksdb, self.verify_checksums)


def with_runner_keywords(settings: RunSettings | None, keywords: Mapping[str, object]) -> RunSettings:
    """``EpochRunner(pipeline, root, max_records_per_epoch=..., keep_epochs=...)``, as it
    was before ``RunSettings`` (deprecated, see CHANGELOG.md): the keywords still work,
    over ``settings``, with a warning that names the replacement."""
    settings = settings or RunSettings()
    if not keywords:
        return settings
    known = {f.name for f in fields(RunSettings)}
    unknown = sorted(set(keywords) - known)
    if unknown:
        raise TypeError(f"EpochRunner() got an unexpected keyword argument {unknown[0]!r}; "
                        f"its settings are RunSettings's: {sorted(known)}")
    given = dict(keywords)
    if isinstance(given.get("resident_state"), bool):  # True: the default cache, False: none
        given["resident_state"] = ResidentStateCache.from_env() if given["resident_state"] else None
    if given.get("rocksdb", RocksDBOptions()) is None:
        given["rocksdb"] = RocksDBOptions()
    if given.get("snapshot_cache", "") is None:
        given["snapshot_cache"] = default_snapshot_cache()
    elif "snapshot_cache" in given:
        given["snapshot_cache"] = str(given["snapshot_cache"])
    shown = ", ".join(f"{name}=..." for name in sorted(given))
    warnings.warn(f"EpochRunner({shown}) is deprecated: pass settings=RunSettings({shown}) instead "
                  "(volley_dagster.RunSettings); the keywords will be removed in 1.0", DeprecationWarning, stacklevel=3)
    return replace(settings, **given)  # type: ignore[arg-type]
