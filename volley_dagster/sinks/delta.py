"""A Delta Lake sink (delta-rs): each epoch is one Delta commit carrying the app
transaction ``(<pipeline>/<sink name>, epoch)``, the same ``txn`` action Spark's
``txnAppId``/``txnVersion`` write, so the table itself says which epochs it holds.

delta-rs accepts a repeated or lower txn version (it would even move the recorded
version back), and by default it rebases a conflicting blind append onto the
winner's commit, so two writers of the same epoch can both land. Hence: every
commit is built on the very snapshot whose txn version we checked, with
``max_commit_retries=0``; a concurrent commit surfaces as ``CommitFailedError``
and the shared loop (``sinks/table.py``) re-reads the txn version and decides again.

The txn says which epoch number the table holds; the commit info of the commit
that set it (``volley.lineage``, ``volley.range``: ``sinks/lineage.py``) says whose.
Commit infos go with the log's cleanup (``delta.logRetentionDuration``, 30 days by
default, once a checkpoint covers them), but a checkpoint keeps the latest txn of
every app id. So each commit also writes the rest of its mark as txns of their own
(``<app id>#lineage.0..2`` and ``#range.0..2``: the 128-bit lineage and range digest
in 44-bit parts, ``#lineage_epoch``, and ``#marked``: the epoch they describe), and a
pipeline paused past the log's retention is still recognised as the table's writer.
"""

from __future__ import annotations

import os
import re
import time
from contextlib import contextmanager
from typing import Any, Iterator

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from deltalake import Field as DeltaField
from deltalake import Schema as DeltaSchema
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError
from deltalake.transaction import AddAction, RemoveAction, create_table_with_add_actions

from volley_dagster.columns import sql_identifier
from volley_dagster.io.paths import table_uri
from volley_dagster.io.s3 import S3Endpoint
from volley_dagster.json_records import JsonObject
from volley_dagster.sinks.base import CommitContext, SinkHistory, SinkLocation, SinkPosition, SinkWrite, commit_tags
from volley_dagster.sinks.lineage import ForeignLineage, SinkCommit, SinkMark
from volley_dagster.sinks.shard_files import RewrittenFiles, ShardFilesPlan, owned_files
from volley_dagster.sinks.staged_files import StagedFile, StagingTarget
from volley_dagster.sinks.table import Mode, TableSink
from volley_dagster.state.keys import ShardLayout

SCHEMA_CHANGE = "volley.schema_change"  # commit info of a rewrite that only changed the schema
_DELETE = "_volley_delete"  # a MERGE source row that deletes its key's row
_HISTORY_PAGE = 64  # commit infos read at first when walking the history back
_RECENT = 8  # commit infos searched for the mark's own before its txns
_HEX128 = re.compile(r"^[0-9a-f]{32}$")
_PARTS = ((0, 11), (11, 22), (22, 32))  # hex digits of a 128-bit id per txn version (< 2**44, never negative)


class DeltaSink(TableSink[DeltaTable]):
    """``mode="append"`` adds each epoch's rows (window results, changelogs);
    ``mode="upsert"`` MERGEs them by ``key_columns`` (default: the pipeline's key)
    for running aggregates. The table is created on the first commit with the
    output's schema; ``uri`` is a local path or ``s3://`` (pass ``s3`` or
    ``storage_options``). ``on_foreign_lineage``: what to do when the table holds the
    pipeline's epochs from another checkpoint lineage (``sinks/lineage.py``).
    ``epoch_column``: a string column holding the epoch that wrote each row (an upsert
    row: the last that changed it) as its Dagster partition key, so that a team's
    per-epoch asset reads one epoch's rows through ``dagster-deltalake``'s IO manager."""

    conflicts = (CommitFailedError,)
    process_local = ("_table",)  # a loaded DeltaTable is process-local

    def __init__(
        self,
        uri: str | os.PathLike[str],
        name: str = "delta",
        mode: Mode = "append",
        key_columns: tuple[str, ...] | list[str] | None = None,
        storage_options: dict[str, str] | None = None,
        partition_by: list[str] | None = None,
        s3: S3Endpoint | None = None,
        max_attempts: int = 10,
        on_foreign_lineage: ForeignLineage = "fail",
        epoch_column: str | None = None,
    ) -> None:
        super().__init__(name, mode, key_columns, max_attempts, on_foreign_lineage, epoch_column)
        self.uri = table_uri(uri)
        self.storage_options = {**(s3.delta_storage_options() if s3 else {}), **(storage_options or {})}
        self.partition_by = list(partition_by) if partition_by else None
        self._table: DeltaTable | None = None

    def app_id(self, pipeline: str) -> str:
        return f"{pipeline}/{self.name}"

    def table(self) -> DeltaTable | None:
        """The table at its latest version (None before the first commit)."""
        return self._load()

    def _load(self, create_with: pa.Schema | None = None) -> DeltaTable | None:
        # Delta creates the table with the first commit itself (see ``_write``).
        if self._table is None:
            try:
                self._table = DeltaTable(self.uri, storage_options=self.storage_options or None)
            except TableNotFoundError:
                return None
        else:
            self._table.update_incremental()
        return self._table

    def _forget(self) -> None:
        self._table = None

    def _rows(self, table: DeltaTable) -> int | None:
        counts = table.get_add_actions(flatten=True).column("num_records").to_pylist()
        return None if any(c is None for c in counts) else int(sum(counts))  # files written without stats

    def _schema(self, table: DeltaTable) -> pa.Schema:
        return pa.schema(table.schema().to_arrow())

    def _change_columns(self, table: DeltaTable, added: list[pa.Field], dropped: list[str]) -> None:
        if added:
            table.alter.add_columns([DeltaField.from_arrow(f.with_nullable(True)) for f in added])
        if dropped:
            # delta-rs has no DROP COLUMN (it needs column mapping), so the table is rewritten
            # without the columns in one overwrite, streamed in batches: the same rows, a
            # commit ``commits`` reads through (it is no other lineage's replace). Built on
            # the checked snapshot: a commit since makes it lose the race and decide again.
            kept = [n for n in self._schema(table).names if n not in dropped]
            rows = table.to_pyarrow_dataset().scanner(columns=kept).to_reader()
            write_deltalake(table, rows, mode="overwrite", schema_mode="overwrite", partition_by=self.partition_by,
                            commit_properties=CommitProperties(
                                custom_metadata={SCHEMA_CHANGE: "dropped " + ",".join(dropped)},
                                max_commit_retries=0))

    def _held(self, table: DeltaTable, pipeline: str) -> SinkMark | None:
        return _mark(table, self.app_id(pipeline), pipeline)

    def _position(self, table: DeltaTable | None) -> SinkPosition:
        return SinkPosition(version=table.version() if table is not None else None)

    def staging_folder(self) -> str | None:
        """The table's own folder, for an append to a local table that no partitioning
        or epoch column shapes: the shard tasks' files are added to it as they are."""
        if self.mode != "append" or self.partition_by or self.epoch_column or "://" in self.uri:
            return None
        return self.uri

    def rewrite_target(self, layout: ShardLayout, key_column: str, expiry_column: str | None) -> StagingTarget | None:
        """For an upsert by the pipeline's key into a local table that no partitioning or
        epoch column shapes, whose files (if any) the shard tasks wrote for ``layout``."""
        if (self.mode != "upsert" or self.partition_by or self.epoch_column or "://" in self.uri
                or self.key_columns not in (None, (key_column,))):
            return None
        table = self._load()
        if table is None:
            return StagingTarget(self.name, self.uri, ShardFilesPlan(None, key_column, expiry_column))
        if _deletion_vectors(table):
            return None
        actions = table.get_add_actions(flatten=True)
        files = owned_files(zip(actions.column("path").to_pylist(), actions.column("size_bytes").to_pylist(),
                                actions.column("num_records").to_pylist(), strict=True), layout)
        if files is None:
            return None
        return StagingTarget(self.name, self.uri, ShardFilesPlan(table.version(), key_column, expiry_column, files))

    def _commit_properties(self, ctx: CommitContext, rows: int) -> CommitProperties:
        app_id = self.app_id(ctx.pipeline)
        return CommitProperties(
            app_transactions=[Transaction(app_id=app_id, version=ctx.sink_epoch), *_mark_transactions(app_id, ctx.mark)],
            custom_metadata={**commit_tags(ctx, rows), "volley.app_id": app_id},
            max_commit_retries=0,
        )

    def _write(self, table: DeltaTable | None, output: pa.Table, ctx: CommitContext,
               keys: tuple[str, ...], expired: pa.Table) -> SinkWrite:
        props = self._commit_properties(ctx, output.num_rows + expired.num_rows)
        counts = self._write_rows(table, output, keys, props, ctx.replace, expired)
        return SinkWrite(counts, self._position(self._load()))

    def _add_files(self, table: DeltaTable | None, files: tuple[StagedFile, ...], schema: pa.Schema,
                   ctx: CommitContext) -> SinkWrite:
        rows = sum(f.rows for f in files)
        props = self._commit_properties(ctx, rows)
        adds = [f.add_action() for f in files]
        if table is None:
            with self._created_exclusively():
                create_table_with_add_actions(self.uri, DeltaSchema.from_arrow(schema), adds, mode="error",
                                              commit_properties=props)
        else:
            changes: list[AddAction | RemoveAction] = [*adds]
            table.create_write_transaction(changes, mode="append", schema=table.schema(), commit_properties=props)
        return SinkWrite({"inserted": rows, "updated": 0}, self._position(self._load()))

    def _rewrite_files(self, table: DeltaTable | None, rewritten: RewrittenFiles, schema: pa.Schema, rows: int,
                       ctx: CommitContext) -> SinkWrite | None:
        files = None if table is None else table.get_add_actions(flatten=True).column("path").to_pylist()
        as_planned = rewritten.planned_on(files) and not (table is not None and _deletion_vectors(table))
        if not as_planned or not (rewritten.added or rewritten.removed):
            return None  # the planned files are not the table's now; an epoch with no changes commits its txn alone
        props = self._commit_properties(ctx, rows)
        adds = [f.add_action() for f in rewritten.added]
        if table is None:
            with self._created_exclusively():
                create_table_with_add_actions(self.uri, DeltaSchema.from_arrow(schema), adds, mode="error",
                                              commit_properties=props)
        else:
            now = int(time.time() * 1000)
            removes = [RemoveAction(f.path, True, now, f.size, {}) for f in rewritten.removed]
            table.create_write_transaction([*removes, *adds], mode="append", schema=table.schema(),
                                           commit_properties=props)
        return SinkWrite(rewritten.counts(), self._position(self._load()))

    @contextmanager
    def _created_exclusively(self) -> Iterator[None]:
        """A first commit made with mode="error", which keeps creation exclusive: a racing
        creator fails to write version 0 (CommitFailedError) or finds the table (DeltaError),
        and either way this commit lost the race."""
        try:
            yield
        except DeltaError as exc:
            if isinstance(exc, CommitFailedError) or self._load() is None:
                raise
            raise CommitFailedError(f"table {self.uri} was created concurrently: {exc}") from exc

    def _write_rows(self, table: DeltaTable | None, output: pa.Table, keys: tuple[str, ...],
                    props: CommitProperties, replace: bool, expired: pa.Table) -> dict[str, int]:
        if table is None:
            # The first commit creates the table (version 0) with this epoch's rows
            # and txn; a MERGE into an empty table would insert the same rows.
            with self._created_exclusively():
                write_deltalake(self.uri, output, mode="error", partition_by=self.partition_by,
                                storage_options=self.storage_options or None, commit_properties=props)
            return {"inserted": output.num_rows, "updated": 0}
        if replace:  # another lineage's rows go in the same commit (its schema too)
            write_deltalake(table, output, mode="overwrite", schema_mode="overwrite", commit_properties=props)
            return {"inserted": output.num_rows, "updated": 0}
        if self.mode == "append" or output.num_rows + expired.num_rows == 0:
            # An empty MERGE commits nothing (delta-rs skips a commit without actions), so
            # an epoch without rows is an append of nothing: a commit that carries the txn.
            write_deltalake(table, output, mode="append", commit_properties=props)
            return {"inserted": output.num_rows, "updated": 0}
        # null-safe, as dedup keys compare (a null component equals a null); parenthesised,
        # or DataFusion reads ``a IS NOT DISTINCT FROM b AND c`` as ``a IS NOT DISTINCT FROM (b AND c)``
        predicate = " AND ".join(f"(target.{sql_identifier(k)} IS NOT DISTINCT FROM source.{sql_identifier(k)})" for k in keys)
        if not expired.num_rows:
            merge = table.merge(output, predicate, source_alias="source", target_alias="target",
                                commit_properties=props).when_matched_update_all().when_not_matched_insert_all()
        else:  # the expired keys' rows go in the same MERGE: matched and deleted
            source = pa.concat_tables([output.append_column(_DELETE, pa.repeat(False, output.num_rows)),
                                       _padded(expired, output.schema).append_column(_DELETE, pa.repeat(True, expired.num_rows))])
            values = {c: f"source.{sql_identifier(c)}" for c in output.column_names}
            keep = f"source.{sql_identifier(_DELETE)} = false"
            merge = (table.merge(source, predicate, source_alias="source", target_alias="target", commit_properties=props)
                     .when_matched_delete(predicate=f"source.{sql_identifier(_DELETE)} = true")
                     .when_matched_update(updates=values, predicate=keep)
                     .when_not_matched_insert(updates=values, predicate=keep))
        checked = table.version()
        metrics = merge.execute()
        if table.version() == checked:
            # a MERGE that changes nothing (only deletes of rows the table lacks) commits
            # nothing, but the epoch needs its commit: one with its txn and no rows, built
            # on the same checked snapshot (a commit since makes it lose the race)
            write_deltalake(table, output.slice(0, 0), mode="append", commit_properties=props)
        return {"inserted": metrics.get("num_target_rows_inserted", 0),
                "updated": metrics.get("num_target_rows_updated", 0),
                "deleted": metrics.get("num_target_rows_deleted", 0)}

    def commits(self, pipeline: str) -> list[SinkCommit]:
        """From the table's commit infos; after a replacing overwrite, only those since."""
        return self.history_from(pipeline, 0).commits

    def history_from(self, pipeline: str, sink_epoch: int) -> SinkHistory:
        """The commit infos newest first, read in growing pages (``history(limit)`` reads
        the newest ``limit`` commits), until a commit of this app before ``sink_epoch``,
        a replacing overwrite or version 0: complete. Running out of commits before
        that means log cleanup removed the older ones (Delta keeps commit infos for
        ``delta.logRetentionDuration``, 30 days by default, once a checkpoint covers them)."""
        table = self._load()
        if table is None:
            return SinkHistory([], complete=True)
        app_id, limit = self.app_id(pipeline), _HISTORY_PAGE
        while True:
            infos = table.history(limit)  # newest first
            commits: list[SinkCommit] = []
            for info in infos:
                if info.get("volley.pipeline") == pipeline and "volley.epoch" in info and _same_app(info, app_id):
                    mark = SinkMark.from_tags(info)
                    if mark.epoch < sink_epoch:
                        return SinkHistory(commits[::-1], complete=True)
                    commits.append(SinkCommit(mark, int(info.get("volley.rows", -1))))
                if (info.get("operation") in ("WRITE", "CREATE OR REPLACE TABLE") and _overwrote(info)) \
                        or info.get("version") == 0:
                    return SinkHistory(commits[::-1], complete=True)
            if len(infos) < limit:
                return SinkHistory(commits[::-1], complete=False)
            limit *= 4

    def read(self) -> pa.Table:
        table = self._load()
        return pa.table({}) if table is None else table.to_pyarrow_table()

    def location(self) -> SinkLocation:
        return SinkLocation("delta", uri=self.uri, mode=self.mode, epoch_column=self.epoch_column)

    def describe(self) -> JsonObject:
        return {**super().describe(), "uri": self.uri, "mode": self.mode,
                "key_columns": list(self.key_columns) if self.key_columns else None}


def _deletion_vectors(table: DeltaTable) -> bool:
    """Whether the table may hold deletion vectors: a file removed with its rows
    rewritten from the file alone would bring back the rows its vector deleted."""
    return "deletionVectors" in (table.protocol().writer_features or [])


def _padded(keys: pa.Table, schema: pa.Schema) -> pa.Table:
    """Key rows with every other column of ``schema`` null (a MERGE source's delete rows)."""
    return pa.table({f.name: keys.column(f.name).cast(f.type) if f.name in keys.column_names
                     else pa.nulls(keys.num_rows, f.type) for f in schema})


def _same_app(info: dict[str, Any], app_id: str) -> bool:
    return info.get("volley.app_id", app_id) == app_id  # commits before app ids were tagged: the pipeline's


def _overwrote(info: dict[str, Any]) -> bool:
    """A replacing commit (another lineage's rows gone); a schema change's rewrite is not one."""
    mode = str((info.get("operationParameters") or {}).get("mode", "")).lower()
    return mode == "overwrite" and SCHEMA_CHANGE not in info


def _mark(table: DeltaTable, app_id: str, pipeline: str) -> SinkMark | None:
    """The txn version, with the lineage of the commit that set it: from that commit's
    info while the log still has it among the latest commits, else from the mark's own
    txns (kept by checkpoints). Only a table last written before those were kept has
    its whole retained history searched, as it was before."""
    version = table.transaction_version(app_id)
    if version is None:
        return None
    recent = _from_history(table.history(_RECENT), app_id, pipeline, version)
    if recent is not None:
        return recent
    kept = _kept_mark(table, app_id, version)
    if kept is not None:
        return kept
    if table.transaction_version(f"{app_id}#marked") is None:  # written before marks were kept as txns
        return _from_history(table.history(), app_id, pipeline, version) or SinkMark(version)
    return SinkMark(version)


def _from_history(infos: list[dict[str, Any]], app_id: str, pipeline: str, version: int) -> SinkMark | None:
    for info in infos:
        if info.get("volley.pipeline") == pipeline and info.get("volley.epoch") == str(version) and _same_app(info, app_id):
            return SinkMark.from_tags(info, epoch=version)
    return None


def _mark_transactions(app_id: str, mark: SinkMark) -> list[Transaction]:
    """The txns that keep ``mark`` in the table's checkpoints. All or none: a mark
    without a 128-bit hex lineage and range (only tests and roots from before lineages
    make one) writes none, and ``#marked`` left at an older epoch says so."""
    if mark.lineage_epoch is None or not all(v is not None and _HEX128.match(v) for v in (mark.lineage, mark.range_digest)):
        return []
    assert mark.lineage is not None and mark.range_digest is not None
    return [*_hex_transactions(f"{app_id}#lineage", mark.lineage), *_hex_transactions(f"{app_id}#range", mark.range_digest),
            Transaction(app_id=f"{app_id}#lineage_epoch", version=mark.lineage_epoch),
            Transaction(app_id=f"{app_id}#marked", version=mark.epoch)]


def _hex_transactions(name: str, value: str) -> list[Transaction]:
    return [Transaction(app_id=f"{name}.{i}", version=int(value[a:b], 16)) for i, (a, b) in enumerate(_PARTS)]


def _read_hex(table: DeltaTable, name: str) -> str | None:
    parts = [table.transaction_version(f"{name}.{i}") for i in range(len(_PARTS))]
    if any(p is None for p in parts):
        return None
    return "".join(f"{p:0{b - a}x}" for p, (a, b) in zip(parts, _PARTS, strict=True))


def _kept_mark(table: DeltaTable, app_id: str, version: int) -> SinkMark | None:
    """The mark of sink epoch ``version`` from its txns; None when they describe
    another epoch (a commit that kept no mark came since) or are absent."""
    if table.transaction_version(f"{app_id}#marked") != version:
        return None
    lineage, digest = _read_hex(table, f"{app_id}#lineage"), _read_hex(table, f"{app_id}#range")
    lineage_epoch = table.transaction_version(f"{app_id}#lineage_epoch")
    if lineage is None or digest is None or lineage_epoch is None:
        return None
    return SinkMark(version, lineage, lineage_epoch, digest)
