"""What one epoch did: the content of its commit manifest, plus its output in memory."""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field, fields, replace

import pyarrow as pa

from volley_dagster.checkpoint.manifest import ShardEntry
from volley_dagster.dimensions.base import EnrichmentRead
from volley_dagster.json_records import JsonObject
from volley_dagster.sinks.base import SinkCommitResult

# figures manifests written before operators reported their own kept at the top level
_LEGACY_FIGURES = ("keys_expired", "duplicates", "dedup_late")


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
    sinks: dict[str, SinkCommitResult]  # per sink, in commit order
    durations: dict[str, float]
    dead_letter_path: str | None = None
    watermark: int | None = None  # windows, event-time TTL: event time (microseconds) the next epoch starts from
    input_watermarks: dict[str, int] = field(default_factory=dict)  # a join: each side's; ``watermark`` is the least
    late_records: int = 0  # (record, window) pairs whose window had closed, records an event-time TTL refused
    late_records_path: str | None = None
    # the operator's figures (``epoch_figures``: keys_expired, duplicates, dedup_late,
    # windows_fired, ...), each a number Dagster plots
    figures: dict[str, int] = field(default_factory=dict)
    duplicates_path: str | None = None  # records the operator dropped (a deduplication's), with their reason
    end_of_stream: bool = False
    committed_at: str = ""
    fencing_token: int = 0  # the lease token of the runner that committed it (0: run without one)
    enrichments: dict[str, EnrichmentRead] = field(default_factory=dict)  # per dimension table: version read, unmatched
    already_committed: bool = False
    output: pa.Table | None = field(default=None, repr=False, compare=False)

    def to_manifest(self) -> JsonObject:
        d = asdict(replace(self, shards={}, sinks={}, enrichments={}, output=None))
        d.pop("output")
        d.pop("already_committed")
        d["shards"] = {str(shard): entry.to_dict() for shard, entry in sorted(self.shards.items())}
        d["sinks"] = {name: commit.to_dict() for name, commit in self.sinks.items()}
        d["enrichments"] = {name: read.to_dict() for name, read in self.enrichments.items()}
        return d

    @classmethod
    def from_manifest(cls, manifest: JsonObject, already_committed: bool = True) -> EpochResult:
        known = {f.name for f in fields(cls)}
        d = {k: v for k, v in manifest.items() if k in known}
        figures = manifest.get("figures")
        if figures is None:
            figures = {name: manifest[name] for name in _LEGACY_FIGURES if manifest.get(name)}
        return cls(**{**d, "figures": figures, "already_committed": already_committed,
                      "shards": {int(s): ShardEntry.from_dict(entry) for s, entry in manifest["shards"].items()},
                      "sinks": {name: SinkCommitResult.from_dict(c) for name, c in manifest["sinks"].items()},
                      "enrichments": {name: EnrichmentRead.from_dict(r)
                                      for name, r in manifest.get("enrichments", {}).items()}})

    def _legacy_figure(self, name: str) -> int:
        warnings.warn(f"EpochResult.{name} is deprecated: read EpochResult.figures[{name!r}] instead "
                      "(every operator's figures are there); it will be removed in 1.0", DeprecationWarning, stacklevel=3)
        return self.figures.get(name, 0)

    @property
    def keys_expired(self) -> int:
        """Deprecated: ``figures["keys_expired"]``."""
        return self._legacy_figure("keys_expired")

    @property
    def duplicates(self) -> int:
        """Deprecated: ``figures["duplicates"]``."""
        return self._legacy_figure("duplicates")

    @property
    def dedup_late(self) -> int:
        """Deprecated: ``figures["dedup_late"]``."""
        return self._legacy_figure("dedup_late")

    @property
    def records_per_second(self) -> float:
        total = self.durations.get("total", 0.0)
        return self.records_in / total if total else 0.0
