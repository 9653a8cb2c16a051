"""The commit lifecycle every idempotent table sink shares, so a table format only
says how to read what it holds and how to write one epoch atomically.

One attempt: load the table as it is now; read its lineage mark; let the epoch's
``CommitContext`` decide (skip, commit, or ``SinkLineageError``); write the epoch in
one commit built on the very table state that was checked. A write that loses a race
to another writer (``conflicts``) is decided again from the new state, so two writers
of one epoch leave exactly one copy; any other failure of the table library comes
out as ``SinkCommitError`` with the library's error as its cause.

A migration changes the columns an epoch writes. The first epoch after it first
changes the table's schema in a commit of its own, before its rows: columns the
output has and the table lacks are added (nullable); an upsert table loses the
columns a migration retired (``CommitContext.retired_columns``: removed or renamed
away), since its rows are the state and that state no longer exists. The attempt
then decides again on the changed table, as after a lost race. The change is
idempotent, so a crash between it and the rows leaves a schema the retry finds. An
append table keeps every column (its old rows hold them) and new rows get nulls; a
column someone else added to a table is never dropped, and an upsert keeps its values
(in the rows it updates too: each format's ``_write`` carries them over).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar, Generic, Literal, TypeVar

import pyarrow as pa
import pyarrow.compute as pc

from volley_dagster.checkpoint.epoch_archive import epoch_key
from volley_dagster.errors import ConfigError, SinkCommitError, VolleyError
from volley_dagster.sinks.base import CommitContext, Sink, SinkCommitResult, SinkPosition, SinkWrite, upsert_keys
from volley_dagster.sinks.lineage import ForeignLineage, SinkMark, check_choice
from volley_dagster.sinks.shard_files import RewrittenFiles
from volley_dagster.sinks.staged_files import StagedFile, same_columns

Mode = Literal["append", "upsert"]
Table = TypeVar("Table")


class TableSink(Sink, Generic[Table]):
    """``mode="append"`` adds each epoch's rows; ``mode="upsert"`` replaces rows by
    ``key_columns`` (default: the pipeline's key). Subclasses implement ``_load``,
    ``_held``, ``_write`` and ``_position`` and name their lost-race errors."""

    conflicts: ClassVar[tuple[type[BaseException], ...]] = ()
    process_local: ClassVar[tuple[str, ...]] = ()  # cached clients and tables: reopened where the sink is used

    def __init__(self, name: str, mode: Mode, key_columns: tuple[str, ...] | list[str] | None,
                 max_attempts: int, on_foreign_lineage: ForeignLineage, epoch_column: str | None = None) -> None:
        if mode not in ("append", "upsert"):
            raise ConfigError(f"{type(self).__name__} mode must be 'append' or 'upsert', not {mode!r}")
        if max_attempts < 1:
            raise ConfigError(f"{type(self).__name__} {name!r}: max_attempts must be at least 1, got {max_attempts}")
        self.name = name
        self.mode: Mode = mode
        self.key_columns = tuple(key_columns) if key_columns else None
        self.max_attempts = max_attempts
        self.on_foreign_lineage = check_choice(name, on_foreign_lineage)
        self.epoch_column = epoch_column

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, **{attr: None for attr in self.process_local}}

    # -- what a table format implements ----------------------------------------------

    @abstractmethod
    def _load(self, create_with: pa.Schema | None = None) -> Table | None:
        """The table at its latest state (None before it exists; with ``create_with``,
        formats that must exist before a commit create it)."""

    @abstractmethod
    def _forget(self) -> None:
        """Drop cached table state after a lost race."""

    @abstractmethod
    def _held(self, table: Table, pipeline: str) -> SinkMark | None:
        """The mark of ``pipeline``'s latest commit, from ``table``'s own metadata."""

    @abstractmethod
    def _write(self, table: Table | None, output: pa.Table, ctx: CommitContext,
               keys: tuple[str, ...], expired: pa.Table) -> SinkWrite:
        """Commit the epoch on exactly the state of ``table`` that was checked, tagged
        with ``ctx.mark``; raise one of ``conflicts`` when another writer got there first.
        ``expired``: upsert only, the keys (``keys`` columns) whose rows the same commit
        deletes (state TTL). Returns the row counts and the table's new position."""

    def _add_files(self, table: Table | None, files: tuple[StagedFile, ...], schema: pa.Schema,
                   ctx: CommitContext) -> SinkWrite:
        """Commit the epoch as ``files`` (rows of ``schema``, already in the table's
        ``staging_folder``), as ``_write`` commits rows: on the checked state of ``table``
        (None: create it), tagged with ``ctx.mark``. Only a sink with a staging folder
        is given files."""
        raise NotImplementedError(f"{type(self).__name__} has no staging folder")

    def _rewrite_files(self, table: Table | None, rewritten: RewrittenFiles, schema: pa.Schema, rows: int,
                       ctx: CommitContext) -> SinkWrite | None:
        """Commit the epoch as the shard tasks' rewrite of the table's files (of
        ``schema``; ``rows``: the epoch's changed and deleted rows), on the checked state
        of ``table``, tagged with ``ctx.mark``; None when ``table`` does not hold the files
        the rewrite was planned on (or it changes nothing), and the rows are committed
        instead. Only a sink that gives a ``rewrite_target`` is given a rewrite."""
        raise NotImplementedError(f"{type(self).__name__} has no rewrite target")

    @abstractmethod
    def _position(self, table: Table | None) -> SinkPosition:
        """Where the table stands (its version or snapshot id), for the manifest."""

    @abstractmethod
    def _rows(self, table: Table) -> int | None:
        """The rows ``table`` holds, from its metadata (no data file is read)."""

    @abstractmethod
    def _schema(self, table: Table) -> pa.Schema:
        """The table's columns, as Arrow types."""

    @abstractmethod
    def _change_columns(self, table: Table, added: list[pa.Field], dropped: list[str]) -> None:
        """Add nullable columns and drop columns in one commit of its own, with no new rows."""

    # -- the lifecycle ------------------------------------------------------------------

    def committed_mark(self, pipeline: str) -> SinkMark | None:
        table = self._load()
        return None if table is None else self._held(table, pipeline)

    def row_count(self) -> int | None:
        table = self._load()
        return None if table is None else self._rows(table)

    def commit(self, output: pa.Table, ctx: CommitContext) -> SinkCommitResult:
        keys = upsert_keys(self, self.mode, self.key_columns, ctx)
        # the tasks' files hold ``output`` as it came: an append's rows, no epoch column added
        staged = ctx.staged if self.mode == "append" and self.epoch_column is None and not ctx.replace else ()
        rewritten = ctx.rewritten if self.mode == "upsert" and self.epoch_column is None and not ctx.replace else None
        output, expired = _split_expired(_with_epoch(output, self.epoch_column, ctx.epoch), ctx.expiry_column, keys)
        conflicts, lost_to = 0, None
        for _ in range(self.max_attempts):
            try:
                table = self._load(create_with=output.schema)
                held = None if table is None else self._held(table, ctx.pipeline)
                if not ctx.should_commit(self.name, held):
                    return SinkCommitResult(skipped=True, held_epoch=held.epoch if held else None,
                                            conflicts=conflicts, mode=self.mode, position=self._position(table))
                rows, fits = output, table is None
                if table is not None and not ctx.replace:
                    schema = self._schema(table)
                    if self._change_schema(table, schema, output.schema, ctx):
                        self._forget()
                        continue  # decide again on the table as its schema change left it
                    if self.mode == "append" or output.num_rows == 0:
                        rows = _with_table_columns(schema, output)
                    fits = same_columns(schema, output.schema)
                written: SinkWrite | None = None
                if staged and fits:
                    written = self._add_files(table, staged, output.schema, ctx)
                elif rewritten is not None and fits:  # None: the table's files changed since the plan
                    written = self._rewrite_files(table, rewritten, output.schema, output.num_rows + expired.num_rows, ctx)
                if written is None:  # files the shard tasks wrote that no commit adds are left to the format's cleanup
                    written = self._write(table, rows, ctx, keys, expired)
            except self.conflicts as exc:
                conflicts, lost_to = conflicts + 1, exc  # someone committed since we looked (possibly this very epoch): decide again
                self._forget()
                continue
            except VolleyError:
                raise
            except Exception as exc:
                raise SinkCommitError(
                    f"sink {self.name!r} ({self.describe_target()}): epoch {ctx.epoch} did not commit: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            return SinkCommitResult(skipped=False, rows=output.num_rows + expired.num_rows, mode=self.mode, conflicts=conflicts,
                                    replaced=ctx.replace, position=written.position, counts=written.counts)
        raise SinkCommitError(
            f"sink {self.name!r} ({self.describe_target()}): epoch {ctx.epoch} lost {conflicts} commit races in a row "
            f"(max_attempts={self.max_attempts}); another writer keeps committing to the table. Nothing of this "
            "epoch was committed to it; retrying is safe"
        ) from lost_to

    def _change_schema(self, table: Table, schema: pa.Schema, output: pa.Schema, ctx: CommitContext) -> bool:
        """Bring the table's schema to the output's after a migration, in a commit of its
        own (see the module's docstring); False when there is nothing to change."""
        added = [f for f in output if f.name not in schema.names]
        dropped = ([n for n in schema.names if n in ctx.retired_columns and n not in output.names]
                   if self.mode == "upsert" else [])
        if added or dropped:
            self._change_columns(table, added, dropped)
        return bool(added or dropped)

    def describe_target(self) -> str:
        location = self.location()
        return f"{location.kind} {location.uri or location.table_name}"


def _with_epoch(output: pa.Table, column: str | None, epoch: int) -> pa.Table:
    """The rows tagged with the epoch that wrote them (an upsert row: the last that
    changed it), as its Dagster partition key, which a per-epoch reader filters on."""
    if column is None:
        return output
    if column in output.column_names:
        raise ConfigError(f"epoch_column {column!r} is already an output column; name it otherwise")
    return output.append_column(pa.field(column, pa.string()), pa.repeat(pa.scalar(epoch_key(epoch)), output.num_rows))


def _split_expired(output: pa.Table, expiry_column: str | None, keys: tuple[str, ...]) -> tuple[pa.Table, pa.Table]:
    """An upsert's rows to write, and the keys of the rows to delete (expired state);
    an append table keeps every row, the expiry column with them."""
    if not keys or expiry_column is None or expiry_column not in output.column_names:
        return output, output.select(list(keys)).slice(0, 0)
    flag = output.column(expiry_column)
    return output.filter(pc.invert(flag)).drop_columns([expiry_column]), output.filter(flag).select(list(keys))


def _with_table_columns(schema: pa.Schema, output: pa.Table) -> pa.Table:
    """Appended rows carry nulls in the table's columns the output lacks."""
    if schema.names == output.schema.names:
        return output
    return pa.table({f.name: output.column(f.name) if f.name in output.schema.names
                     else pa.nulls(output.num_rows, f.type) for f in schema})
