"""What one epoch did: the content of its commit manifest, plus its output in memory."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

import pyarrow as pa

from volley_dagster.checkpoint.manifest import ShardEntry


@dataclass
class EpochResult:
    pipeline: str
    epoch: int
    range: dict[str, str]  # per partition "file:record -> file:record"
    records_in: int
    records_aggregated: int
    dead_letters: int
    records_out: int
    keys_touched: int
    new_keys: int
    state_bytes: int  # bytes of the epoch's snapshots (hardlinked files counted once per snapshot)
    state_bytes_written: int  # bytes this epoch added to the checkpoint root
    shards: dict[int, ShardEntry]  # per shard: the snapshot (path relative to the root), what its task did
    sinks: dict[str, dict[str, Any]]  # per sink: its SinkCommitResult, as recorded
    durations: dict[str, float]
    dead_letter_path: str | None = None
    keys_expired: int = 0  # state TTL: keys this epoch deleted (and emitted with expired = true)
    watermark: int | None = None  # windows, event-time TTL: event time (microseconds) the next epoch starts from
    late_records: int = 0  # windows: (record, window) pairs whose window had closed
    late_records_path: str | None = None
    duplicates: int = 0  # deduplication: records dropped because they repeat a remembered key
    dedup_late: int = 0  # deduplication: records dropped as late (event time + within <= the starting watermark)
    duplicates_path: str | None = None  # with write_duplicates: where both are
    end_of_stream: bool = False
    committed_at: str = ""
    fencing_token: int = 0  # the lease token of the runner that committed it (0: run without one)
    enrichments: dict[str, dict[str, Any]] = field(default_factory=dict)  # per dimension table: version read, unmatched
    already_committed: bool = False
    output: pa.Table | None = field(default=None, repr=False, compare=False)

    def to_manifest(self) -> dict[str, Any]:
        d = asdict(replace(self, shards={}, output=None))
        d.pop("output")
        d.pop("already_committed")
        d["shards"] = {str(shard): entry.to_dict() for shard, entry in sorted(self.shards.items())}
        return d

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any], already_committed: bool = True) -> EpochResult:
        shards = {int(s): ShardEntry.from_dict(entry) for s, entry in manifest["shards"].items()}
        return cls(**{**manifest, "shards": shards}, already_committed=already_committed)

    @property
    def records_per_second(self) -> float:
        total = self.durations.get("total", 0.0)
        return self.records_in / total if total else 0.0
