"""The sink interface: an epoch's output is committed once, and the sink itself
(its own metadata, not a local file) says which epochs it holds and which checkpoint
lineage wrote them (``sinks/lineage.py``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field, fields

import pyarrow as pa

from volley_dagster.errors import ConfigError
from volley_dagster.io.paths import TableIdentity, table_identity
from volley_dagster.json_records import JsonObject
from volley_dagster.sinks.lineage import ForeignLineage, Lineage, SinkBinding, SinkCommit, SinkMark, decide
from volley_dagster.sinks.shard_files import RewrittenFiles
from volley_dagster.sinks.staged_files import StagedFile, StagingTarget
from volley_dagster.state.keys import ShardLayout


@dataclass(frozen=True)
class CommitContext:
    """One epoch's commit to one sink. ``sink_epoch`` is the number the sink stores
    (the epoch itself unless the sink held another lineage's epochs first, see
    ``SinkBinding``); ``replace``: this commit also removes every row the table held;
    ``retired_columns``: output columns a migration removed or renamed away, which an
    upsert table drops (``EpochLog.retired_columns``); ``expiry_column``: the output
    column that is true on a key's expiry (state TTL), whose row an upsert deletes;
    ``staged``: the shard tasks also wrote the epoch's rows (``output`` holds them too) as
    these files in the sink's ``staging_folder``, for the commit to add as they are;
    ``rewritten``: an upsert's shard tasks rewrote the table's files with ``output``
    (``sinks/shard_files.py``), for the commit to swap in when the table is as planned."""

    pipeline: str
    epoch: int
    key_columns: tuple[str, ...]
    lineage: Lineage = field(default_factory=lambda: Lineage("unrecorded"))
    range_digest: str | None = None
    binding: SinkBinding | None = None
    retired_columns: frozenset[str] = frozenset()
    expiry_column: str | None = None
    staged: tuple[StagedFile, ...] = ()
    rewritten: RewrittenFiles | None = None

    @property
    def sink_epoch(self) -> int:
        return self.epoch + (self.binding.offset if self.binding else 0)

    @property
    def replace(self) -> bool:
        return self.binding is not None and self.binding.choice == "replace" and self.epoch == self.binding.first_epoch

    @property
    def mark(self) -> SinkMark:
        return SinkMark(self.sink_epoch, self.lineage.id, self.epoch, self.range_digest)

    def should_commit(self, sink: str, held: SinkMark | None) -> bool:
        """False when the sink already holds this commit; raises ``SinkLineageError``
        when it holds something this lineage cannot follow."""
        return decide(sink, held, self.mark, self.lineage, self.binding)


@dataclass(frozen=True)
class SinkPosition:
    """Where a sink stands after a commit, by its kind: a Delta table's ``version``, an
    Iceberg table's ``snapshot_id``, a file's ``path``, a Kafka ``topic`` (``read_back``:
    its outcome was read back after the producer failed to say). A new kind of sink
    adds its own field here."""

    version: int | None = None
    snapshot_id: int | None = None
    path: str | None = None
    topic: str | None = None
    read_back: bool = False

    def to_dict(self) -> JsonObject:
        return {k: v for k, v in asdict(self).items() if v is not None and v is not False}


_POSITION_KEYS = {f.name for f in fields(SinkPosition)}
_RESULT_KEYS = {"skipped", "rows", "mode", "conflicts", "replaced", "held_epoch", "seconds", "lineage", "sink_epoch"}


@dataclass(frozen=True)
class SinkCommitResult:
    """What one epoch's commit to one sink did; ``to_dict`` is its entry in the manifest
    (one flat object, as every manifest so far has it). ``counts``: the rows the commit
    inserted, updated, deleted, rewritten, by the sink's own names (and the files, where
    the shard tasks rewrote them: ``files_removed``, ``files_added``). ``seconds``,
    ``lineage`` and ``sink_epoch`` are set by the committer (``sinks/committer.py``)."""

    skipped: bool
    rows: int | None = None
    mode: str | None = None
    conflicts: int | None = None
    replaced: bool | None = None
    held_epoch: int | None = None
    position: SinkPosition = field(default_factory=SinkPosition)
    counts: dict[str, int] = field(default_factory=dict)
    seconds: float | None = None
    lineage: str | None = None  # the id of the checkpoint lineage that committed it
    sink_epoch: int | None = None  # the number the sink stores (``CommitContext.sink_epoch``)

    def to_dict(self) -> JsonObject:
        own = {name: getattr(self, name) for name in sorted(_RESULT_KEYS)}
        return {**{k: v for k, v in own.items() if v is not None}, **self.position.to_dict(), **self.counts}

    @classmethod
    def from_dict(cls, d: JsonObject) -> SinkCommitResult:
        position = SinkPosition(**{k: v for k, v in d.items() if k in _POSITION_KEYS})
        # the rest are the sink's row counts; a field a later version adds (not a count) is not one
        counts = {k: v for k, v in d.items() if k not in _POSITION_KEYS | _RESULT_KEYS
                  and isinstance(v, int) and not isinstance(v, bool)}
        return cls(position=position, counts=counts, **{k: v for k, v in d.items() if k in _RESULT_KEYS})


@dataclass(frozen=True)
class SinkWrite:
    """What a table sink's write did: its row counts and where the table stands after it."""

    counts: dict[str, int]
    position: SinkPosition


@dataclass(frozen=True)
class SinkHistory:
    """A pipeline's commits that a sink's own history holds from one sink epoch on,
    oldest first. ``complete``: the history reaches back that far (a commit before it,
    the table's creation, or a replacing commit was found); otherwise the sink's own
    retention (Delta log cleanup, Iceberg snapshot expiry, topic retention) removed
    the older commits, and the oldest commit here is where its history begins."""

    commits: list[SinkCommit]
    complete: bool

    def first_epoch(self) -> int | None:
        """The sink epoch of the oldest commit held (None: none)."""
        return self.commits[0].mark.epoch if self.commits else None


@dataclass(frozen=True)
class SinkLocation:
    """Where a sink's table lives, as an orchestrator shows it: its kind ("delta",
    "iceberg", ...), a URI or a catalog table name, its write mode, and the column that
    holds each row's epoch when it writes one."""

    kind: str
    uri: str | None = None
    table_name: str | None = None
    mode: str | None = None
    epoch_column: str | None = None
    catalog: str | None = None  # an Iceberg table's catalog (its uri or warehouse): what tells two tables apart, never shown

    def identity(self) -> TableIdentity | None:
        """The table as a table source names what it reads (``Source.upstream_table``)."""
        where = self.uri if self.uri is not None else self.table_name
        return None if where is None else table_identity(self.kind, where, self.catalog)


class Sink(ABC):
    name: str
    on_foreign_lineage: ForeignLineage = "fail"

    def location(self) -> SinkLocation:
        return SinkLocation(type(self).__name__.lower())

    def staging_folder(self) -> str | None:
        """A folder on this machine where the shard tasks may write an epoch's rows as
        Parquet files, for ``commit`` to add as they are (``CommitContext.staged``); None:
        the rows come to the driver."""
        return None

    def rewrite_target(self, layout: ShardLayout, key_column: str, expiry_column: str | None) -> StagingTarget | None:
        """Where and how the shard tasks rewrite this upsert table's files themselves,
        each its own keys' (``sinks/shard_files.py``), when its files are laid out by
        ``layout``'s shards; None: the sink commits the rows it is given."""
        return None

    @abstractmethod
    def committed_mark(self, pipeline: str) -> SinkMark | None:
        """The mark of the latest commit of ``pipeline``, read from the sink itself."""

    @abstractmethod
    def commit(self, output: pa.Table, ctx: CommitContext) -> SinkCommitResult:
        """Write one epoch's output atomically, tagged with ``ctx.mark`` (decided again
        with ``ctx.should_commit`` after a lost race); returns what the manifest records."""

    @abstractmethod
    def commits(self, pipeline: str) -> list[SinkCommit]:
        """Every commit of ``pipeline`` the sink's own history still holds, oldest first
        (after a ``replace``, only those since)."""

    def history_from(self, pipeline: str, sink_epoch: int) -> SinkHistory:
        """The commits of ``pipeline`` numbered ``sink_epoch`` or later. Table sinks read
        their history newest first and stop there, so the cost is the epochs asked for;
        this default reads ``commits`` and takes the oldest commit held as the start of
        the retained history."""
        commits = self.commits(pipeline)
        return SinkHistory([c for c in commits if c.mark.epoch >= sink_epoch],
                           complete=bool(commits) and commits[0].mark.epoch <= sink_epoch)

    def committed_epoch(self, pipeline: str) -> int | None:
        """The sink's own number of the latest epoch of ``pipeline`` it holds."""
        mark = self.committed_mark(pipeline)
        return None if mark is None else mark.epoch

    def epoch_history(self, pipeline: str, lineage: Lineage | None = None) -> dict[int, list[int]]:
        """Per epoch, the row count of each commit tagged with it. Exactly-once means one
        entry per epoch. With ``lineage``: only its commits, by the lineage's epoch."""
        history: dict[int, list[int]] = {}
        for commit in self.commits(pipeline):
            if lineage is None:
                history.setdefault(commit.mark.epoch, []).append(commit.rows)
            elif lineage.owns(commit.mark):
                history.setdefault(lineage.epoch_of(commit.mark), []).append(commit.rows)
        return history

    def commit_of(self, pipeline: str, sink_epoch: int) -> SinkMark | None:
        """The mark of the commit the sink numbers ``sink_epoch`` (None if its history
        no longer has it)."""
        commits = self.history_from(pipeline, sink_epoch).commits  # read back no further than that epoch
        return next((c.mark for c in reversed(commits) if c.mark.epoch == sink_epoch), None)

    def row_count(self) -> int | None:
        """The rows the table holds now, from its own metadata (None: unknown or no table)."""
        return None

    def describe(self) -> JsonObject:
        return {"name": self.name, "type": type(self).__name__, "on_foreign_lineage": self.on_foreign_lineage}


def commit_tags(ctx: CommitContext, rows: int) -> dict[str, str]:
    """The properties every sink stores with an epoch's commit."""
    return {"volley.pipeline": ctx.pipeline, **ctx.mark.tags(), "volley.rows": str(rows)}


def upsert_keys(sink: Sink, mode: str, key_columns: tuple[str, ...] | None, ctx: CommitContext) -> tuple[str, ...]:
    """The columns an upsert matches on: the sink's own, else the pipeline's key."""
    if mode != "upsert":
        return ()
    keys = key_columns or ctx.key_columns
    if not keys:
        raise ConfigError(f"{type(sink).__name__} {sink.name!r} upserts but has no key columns")
    return tuple(keys)
