"""The epoch log: what each epoch reads, and whether it committed.

Layout under the checkpoint root::

    pipeline.json                      identity: layout the state was written with
    epochs/0000000007/offsets.json     the range, written once before the first attempt
    epochs/0000000007/manifest.json    the commit point, written last
    epochs/0000000007/dead_letters.parquet
    epochs/0000000007/late_records.parquet   windows: records whose window had closed
    snapshots/0000000007/shard-0003/   RocksDB checkpoint (hardlinked SSTs)
    work/0000000007/shard-0003-<attempt>/  a task attempt's writable DB (deleted after)

An epoch is committed exactly when its manifest exists.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from volley_dagster import faults
from volley_dagster.checkpoint.atomic import create_json_exclusive, read_json
from volley_dagster.errors import EpochNotCutError, StateLayoutError
from volley_dagster.sources.offsets import EpochRange


def epoch_key(epoch: int) -> str:
    """Zero-padded, so that names (and Dagster partition keys) sort as numbers."""
    return f"{epoch:010d}"


class EpochLog:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).absolute()

    # -- paths ---------------------------------------------------------------------

    def epoch_dir(self, epoch: int) -> Path:
        return self.root / "epochs" / epoch_key(epoch)

    def snapshot_dir(self, epoch: int, shard: int) -> Path:
        return self.root / "snapshots" / epoch_key(epoch) / f"shard-{shard:04d}"

    def work_dir(self, epoch: int) -> Path:
        return self.root / "work" / epoch_key(epoch)

    def dead_letter_path(self, epoch: int) -> Path:
        return self.epoch_dir(epoch) / "dead_letters.parquet"

    def late_records_path(self, epoch: int) -> Path:
        return self.epoch_dir(epoch) / "late_records.parquet"

    # -- identity ------------------------------------------------------------------

    def identity(self) -> dict[str, Any]:
        """The state layout recorded by the first epoch (see ``check_identity``)."""
        return read_json(self.root / "pipeline.json")

    def check_identity(self, identity: dict[str, Any]) -> None:
        """Record the pipeline's state layout on first use; refuse a different one later."""
        create_json_exclusive(self.root / "pipeline.json", identity)  # no-op when recorded already
        recorded = self.identity()
        if recorded != identity:
            diff = {k: (recorded.get(k), identity.get(k)) for k in set(recorded) | set(identity) if recorded.get(k) != identity.get(k)}
            raise StateLayoutError(
                f"checkpoint root {self.root} was written by a different pipeline layout; "
                f"differences (recorded, now): {diff}. Use a new checkpoint root, or rescale/migrate the state"
            )

    # -- offsets -------------------------------------------------------------------

    def epochs_cut(self) -> list[int]:
        d = self.root / "epochs"
        if not d.is_dir():
            return []
        return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit() and (p / "offsets.json").exists())

    def last_cut(self) -> int:
        cut = self.epochs_cut()
        return cut[-1] if cut else 0

    def last_committed(self) -> int:
        for epoch in reversed(self.epochs_cut()):
            if self.is_committed(epoch):
                return epoch
        return 0

    def record_offsets(self, rng: EpochRange) -> EpochRange:
        """Write the range unless the epoch was cut already; the recorded one wins."""
        create_json_exclusive(self.epoch_dir(rng.epoch) / "offsets.json", rng.to_dict())
        return self.offsets(rng.epoch)

    def offsets(self, epoch: int) -> EpochRange:
        path = self.epoch_dir(epoch) / "offsets.json"
        if not path.exists():
            last = self.last_cut()
            raise EpochNotCutError(
                f"epoch {epoch} has no recorded offset range (the last cut epoch is {last}); "
                "epochs are cut in order by the runner, sensor or schedule before they run"
            )
        return EpochRange.from_dict(read_json(path))

    # -- commits -------------------------------------------------------------------

    def is_committed(self, epoch: int) -> bool:
        return (self.epoch_dir(epoch) / "manifest.json").exists()

    def manifest(self, epoch: int) -> dict[str, Any] | None:
        path = self.epoch_dir(epoch) / "manifest.json"
        return read_json(path) if path.exists() else None

    def write_manifest(self, epoch: int, manifest: dict[str, Any]) -> bool:
        """Commit the epoch; False when another attempt committed it first."""
        return create_json_exclusive(self.epoch_dir(epoch) / "manifest.json", manifest)

    # -- retention -----------------------------------------------------------------

    def prune(self, committed: int, keep: int) -> list[int]:
        """Delete snapshots older than the last ``keep`` committed epochs, and every
        working directory up to ``committed``. Offsets and manifests stay: they are
        the history the UI shows."""
        removed = []
        snaps = self.root / "snapshots"
        if snaps.is_dir():
            for p in sorted(snaps.iterdir()):
                if p.name.isdigit() and int(p.name) <= committed - keep:
                    faults.fault_point("during_retention", committed)
                    shutil.rmtree(p)
                    removed.append(int(p.name))
        work = self.root / "work"
        if work.is_dir():
            for p in work.iterdir():
                if p.name.isdigit() and int(p.name) <= committed:
                    shutil.rmtree(p, ignore_errors=True)
        return removed

    def retained_snapshots(self) -> list[int]:
        snaps = self.root / "snapshots"
        return sorted(int(p.name) for p in snaps.iterdir() if p.name.isdigit()) if snaps.is_dir() else []
