"""A Delta Lake sink (delta-rs): each epoch is one Delta commit carrying the app
transaction ``(<pipeline>/<sink name>, epoch)``, the same ``txn`` action Spark's
``txnAppId``/``txnVersion`` write, so the table itself says which epochs it holds.

delta-rs accepts a repeated or lower txn version (it would even move the recorded
version back), and by default it rebases a conflicting blind append onto the
winner's commit, so two writers of the same epoch can both land. Hence: every
commit is built on the very snapshot whose txn version we checked, with
``max_commit_retries=0``; a concurrent commit surfaces as ``CommitFailedError``
and our own loop re-reads the txn version and skips or tries again.

The txn says which epoch number the table holds; the commit info of the commit
that set it (``volley.lineage``, ``volley.range``: ``sinks/lineage.py``) says whose.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError

from volley_dagster.errors import ConfigError
from volley_dagster.sinks.base import CommitContext, Sink, commit_tags, upsert_keys
from volley_dagster.sinks.lineage import ForeignLineage, SinkCommit, SinkMark, check_choice
from volley_dagster.sinks.s3 import S3Endpoint

Mode = Literal["append", "upsert"]


def _quote(column: str) -> str:
    return "`" + column.replace("`", "``") + "`"


class DeltaSink(Sink):
    """``mode="append"`` adds each epoch's rows (window results, changelogs);
    ``mode="upsert"`` MERGEs them by ``key_columns`` (default: the pipeline's key)
    for running aggregates. The table is created on the first commit with the
    output's schema; ``uri`` is a local path or ``s3://`` (pass ``s3`` or
    ``storage_options``). ``on_foreign_lineage``: what to do when the table holds the
    pipeline's epochs from another checkpoint lineage (``sinks/lineage.py``)."""

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
    ) -> None:
        self.on_foreign_lineage = check_choice(name, on_foreign_lineage)
        if mode not in ("append", "upsert"):
            raise ConfigError(f"DeltaSink mode must be 'append' or 'upsert', not {mode!r}")
        text = os.fspath(uri)
        self.uri = text if "://" in text else str(Path(text).absolute())
        self.name = name
        self.mode: Mode = mode
        self.key_columns = tuple(key_columns) if key_columns else None
        self.storage_options = {**(s3.delta_storage_options() if s3 else {}), **(storage_options or {})}
        self.partition_by = list(partition_by) if partition_by else None
        self.max_attempts = max_attempts
        self._table: DeltaTable | None = None

    def __getstate__(self) -> dict[str, Any]:
        # A loaded DeltaTable is process-local: reload it where the sink is used.
        return {**self.__dict__, "_table": None}

    def app_id(self, pipeline: str) -> str:
        return f"{pipeline}/{self.name}"

    def table(self) -> DeltaTable | None:
        """The table at its latest version (None before the first commit)."""
        if self._table is None:
            try:
                self._table = DeltaTable(self.uri, storage_options=self.storage_options or None)
            except TableNotFoundError:
                return None
        else:
            self._table.update_incremental()
        return self._table

    def committed_mark(self, pipeline: str) -> SinkMark | None:
        return _mark(self.table(), self.app_id(pipeline), pipeline)

    def commit(self, output: pa.Table, ctx: CommitContext) -> dict[str, Any]:
        keys = upsert_keys(self, self.mode, self.key_columns, ctx)
        app_id = self.app_id(ctx.pipeline)
        props = CommitProperties(
            app_transactions=[Transaction(app_id=app_id, version=ctx.sink_epoch)],
            custom_metadata={**commit_tags(ctx, output.num_rows), "volley.app_id": app_id},
            max_commit_retries=0,
        )
        conflicts = 0
        last: Exception = RuntimeError(f"Delta sink {self.name!r}: max_attempts={self.max_attempts} allows no commit")
        for _ in range(self.max_attempts):
            table = self.table()
            held = _mark(table, app_id, ctx.pipeline)
            if not ctx.should_commit(self.name, held):
                return {"skipped": True, "held_epoch": held.epoch if held else None, "conflicts": conflicts,
                        "mode": self.mode, "version": table.version() if table is not None else None}
            try:
                metrics = self._write(table, output, keys, props, ctx.replace)
            except CommitFailedError as exc:
                # Someone committed between our read and our commit (possibly this
                # very epoch): drop the cached snapshot and decide again.
                conflicts += 1
                self._table = None
                last = exc
                continue
            table = self.table()
            assert table is not None
            return {"skipped": False, "version": table.version(), "rows": output.num_rows, "mode": self.mode,
                    "conflicts": conflicts, "replaced": ctx.replace, **metrics}
        raise last

    def _write(self, table: DeltaTable | None, output: pa.Table, keys: tuple[str, ...],
               props: CommitProperties, replace: bool) -> dict[str, Any]:
        if table is None:
            # The first commit creates the table (version 0) with this epoch's rows
            # and txn; a MERGE into an empty table would insert the same rows.
            # mode="error" keeps creation exclusive: a racing creator fails to
            # write version 0 (CommitFailedError) or finds the table (DeltaError).
            try:
                write_deltalake(self.uri, output, mode="error", partition_by=self.partition_by,
                                storage_options=self.storage_options or None, commit_properties=props)
            except DeltaError as exc:
                if isinstance(exc, CommitFailedError) or self.table() is None:
                    raise
                raise CommitFailedError(f"table {self.uri} was created concurrently: {exc}") from exc
            return {"inserted": output.num_rows, "updated": 0}
        if replace:  # another lineage's rows go in the same commit (its schema too)
            write_deltalake(table, output, mode="overwrite", schema_mode="overwrite", commit_properties=props)
            return {"inserted": output.num_rows, "updated": 0}
        if self.mode == "append" or output.num_rows == 0:
            # An empty MERGE commits nothing (delta-rs skips a commit without actions), so
            # an epoch without rows is an append of nothing: a commit that carries the txn.
            write_deltalake(table, output, mode="append", commit_properties=props)
            return {"inserted": output.num_rows, "updated": 0}
        predicate = " AND ".join(f"target.{_quote(k)} = source.{_quote(k)}" for k in keys)
        metrics = (
            table.merge(output, predicate, source_alias="source", target_alias="target", commit_properties=props)
            .when_matched_update_all()
            .when_not_matched_insert_all()
            .execute()
        )
        return {"inserted": metrics.get("num_target_rows_inserted", 0),
                "updated": metrics.get("num_target_rows_updated", 0)}

    def commits(self, pipeline: str) -> list[SinkCommit]:
        """From the table's commit infos; after a replacing overwrite, only those since."""
        table = self.table()
        commits: list[SinkCommit] = []
        for info in table.history() if table is not None else []:  # newest first
            if info.get("volley.pipeline") == pipeline and "volley.epoch" in info and _same_app(info, self.app_id(pipeline)):
                commits.append(SinkCommit(SinkMark.from_tags(info), int(info.get("volley.rows", -1))))
            if info.get("operation") in ("WRITE", "CREATE OR REPLACE TABLE") and _overwrote(info):
                break
        return commits[::-1]

    def read(self) -> pa.Table:
        table = self.table()
        return pa.table({}) if table is None else table.to_pyarrow_table()

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "uri": self.uri, "mode": self.mode,
                "key_columns": list(self.key_columns) if self.key_columns else None}


def _same_app(info: dict[str, Any], app_id: str) -> bool:
    return info.get("volley.app_id", app_id) == app_id  # commits before app ids were tagged: the pipeline's


def _overwrote(info: dict[str, Any]) -> bool:
    return str((info.get("operationParameters") or {}).get("mode", "")).lower() == "overwrite"


def _mark(table: DeltaTable | None, app_id: str, pipeline: str) -> SinkMark | None:
    """The txn version, with the lineage of the commit that set it: the newest commit
    of this app carrying that version (found within the log's retained history)."""
    version = None if table is None else table.transaction_version(app_id)
    if version is None:
        return None
    assert table is not None
    for limit in (8, None):
        for info in table.history(limit):
            if (info.get("volley.pipeline") == pipeline and info.get("volley.epoch") == str(version)
                    and _same_app(info, app_id)):
                return SinkMark.from_tags(info, epoch=version)
    return SinkMark(version)
