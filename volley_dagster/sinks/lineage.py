"""Which checkpoint lineage wrote a sink's epochs, and whether this one may write next.

An epoch number alone does not say whose epoch a table holds: a checkpoint root
deleted and started again, or restored from a copy, numbers its epochs from where
*it* stands while the tables keep the old ones. So every commit carries a mark: the
lineage (a UUID written once into the root's ``pipeline.json``), the lineage's epoch
and a digest of the epoch's recorded range. Before a commit, ``decide`` compares
the sink's latest mark with the one this epoch would write.

A sink that holds another lineage's epochs fails with ``SinkLineageError`` unless
the sink says otherwise (``on_foreign_lineage``): "replace" drops the old rows in
the first commit, "continue" keeps them. Either way this lineage's epochs then
number after the old ones *in that sink*, as recorded once in the root's
``sinks/<name>.json`` (a ``SinkBinding``), so the sink's own epoch numbers (Delta
txn versions, Iceberg properties, file names) keep growing.

The latest mark must outlive the table's own retention, or a pipeline paused longer
than it would find its table foreign: Delta keeps it as txn actions, which its
checkpoints keep (the latest per app id) when log cleanup removes the commit infos;
Iceberg keeps it in table properties set in the epoch's own commit, which snapshot
expiry leaves alone; Kafka keeps it as the committed offset of a consumer group of the
sink's own, set in the epoch's transaction, which the topic's retention and compaction
leave alone (``sinks/kafka.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

from volley_dagster.errors import ConfigError, SinkLineageError
from volley_dagster.json_records import JsonObject

ForeignLineage = Literal["fail", "replace", "continue"]


def check_choice(sink: str, choice: str) -> ForeignLineage:
    if choice not in get_args(ForeignLineage):
        raise ConfigError(f"sink {sink!r}: on_foreign_lineage must be one of {get_args(ForeignLineage)}, not {choice!r}")
    return choice  # type: ignore[return-value]


@dataclass(frozen=True)
class SinkMark:
    """What a sink stores with one commit. ``epoch`` is the sink's own number (txn
    version, table property, file name); the rest is None for commits made before
    sinks recorded lineages."""

    epoch: int
    lineage: str | None = None
    lineage_epoch: int | None = None
    range_digest: str | None = None

    def tags(self) -> dict[str, str]:
        tags = {"volley.epoch": str(self.epoch)}
        if self.lineage is not None:
            tags["volley.lineage"] = self.lineage
        if self.lineage_epoch is not None:
            tags["volley.lineage_epoch"] = str(self.lineage_epoch)
        if self.range_digest is not None:
            tags["volley.range"] = self.range_digest
        return tags

    @classmethod
    def from_tags(cls, tags: dict[str, Any], epoch: int | None = None) -> SinkMark:
        lineage_epoch = tags.get("volley.lineage_epoch")
        return cls(
            epoch=int(tags["volley.epoch"]) if epoch is None else epoch,
            lineage=tags.get("volley.lineage"),
            lineage_epoch=int(lineage_epoch) if lineage_epoch is not None else None,
            range_digest=tags.get("volley.range"),
        )

    def describe(self) -> str:
        if self.lineage is None:
            return f"epoch {self.epoch} of an unrecorded lineage (written before sinks recorded lineages)"
        return f"epoch {self.epoch} of lineage {self.lineage} (its epoch {self.lineage_epoch})"


@dataclass(frozen=True)
class SinkCommit:
    """One commit in a sink's own history."""

    mark: SinkMark
    rows: int


@dataclass(frozen=True)
class Lineage:
    """A checkpoint root's lineage. ``unlabelled_through``: a root older than lineages
    committed its epochs up to there with marks that carry none; those are its own."""

    id: str
    unlabelled_through: int = 0

    def owns(self, mark: SinkMark) -> bool:
        return mark.lineage == self.id or (mark.lineage is None and mark.epoch <= self.unlabelled_through)

    def epoch_of(self, mark: SinkMark) -> int:
        """The lineage's epoch of one of its own marks."""
        return mark.lineage_epoch if mark.lineage_epoch is not None else mark.epoch


@dataclass(frozen=True)
class SinkBinding:
    """This lineage met ``foreign`` in sink ``sink`` at its epoch ``first_epoch`` and the
    sink chose ``choice``: from then on, lineage epoch e is sink epoch e + offset."""

    sink: str
    choice: ForeignLineage
    foreign: SinkMark
    first_epoch: int

    @property
    def offset(self) -> int:
        return self.foreign.epoch + 1 - self.first_epoch

    def to_dict(self) -> JsonObject:
        return {"sink": self.sink, "choice": self.choice, "foreign": asdict(self.foreign), "first_epoch": self.first_epoch}

    @classmethod
    def from_dict(cls, d: JsonObject) -> SinkBinding:
        return cls(d["sink"], d["choice"], SinkMark(**d["foreign"]), int(d["first_epoch"]))


def decide(sink: str, held: SinkMark | None, want: SinkMark, lineage: Lineage, binding: SinkBinding | None) -> bool:
    """True: commit ``want``; False: the sink already holds it. Raises
    ``SinkLineageError`` when the sink holds something this lineage cannot follow."""
    if held is None:
        return True
    if lineage.owns(held):
        if held.epoch == want.epoch:
            if held.range_digest is not None and held.range_digest != want.range_digest:
                raise SinkLineageError(
                    f"sink {sink!r} holds epoch {lineage.epoch_of(held)} of this lineage ({lineage.id}) over another "
                    f"source range (digest {held.range_digest}, this epoch's is {want.range_digest}): the checkpoint "
                    "root was restored from an older copy and cut the epoch again. Nothing was committed to the sink; "
                    "restore the newest copy of the root, or write to a new table"
                )
            return False
        if held.epoch > want.epoch:
            return False  # the runner checks the range of the epoch itself (``Sink.commit_of``)
        if held.epoch == want.epoch - 1:
            return True
        next_epoch = lineage.epoch_of(want)
        raise SinkLineageError(
            f"sink {sink!r} holds this lineage's ({lineage.id}) epochs only up to {lineage.epoch_of(held)}, but epoch "
            f"{next_epoch} is next: epochs {lineage.epoch_of(held) + 1}..{next_epoch - 1} are missing "
            "from it (was the table rolled back or restored?). Nothing was committed to the sink; restore the table, "
            "or write to a new table"
        )
    if binding is not None and held == binding.foreign and want.epoch == binding.foreign.epoch + 1:
        return True  # the first commit after the sink's choice
    raise SinkLineageError(
        f"sink {sink!r} holds {held.describe()}, but this checkpoint root is lineage {lineage.id}, at its epoch "
        f"{want.lineage_epoch}: the root was deleted, replaced or restored while the table was kept. Nothing was "
        "committed to the sink. Choose on the sink: on_foreign_lineage='replace' (this lineage's first commit to it "
        "replaces every row the table holds) or 'continue' (keep them; this lineage's epochs follow theirs), or "
        "point the sink at a new table"
    )
