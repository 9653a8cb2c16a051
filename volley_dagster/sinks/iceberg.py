"""An Iceberg sink (pyiceberg): each epoch is one catalog commit that writes the
rows, tags every snapshot it creates with ``volley.pipeline``/``volley.epoch``
summary properties and the lineage mark (``sinks/lineage.py``), and sets the table
properties ``volley.<pipeline>.<sink>.*`` to the same mark. The table properties are
what ``committed_mark`` reads: unlike snapshot summaries they survive snapshot
expiry and compaction. (Tables written before marks had ``volley.epoch.<pipeline>``.)

pyiceberg retries a failed commit by itself (``commit.retry.num-retries``,
default 4) by rebasing the append onto the winner, which would land a racing
epoch twice. The sink's own transactions start from the table's metadata with that
count at 0, in memory only (``_without_retries``): the table's properties stay its
owner's, and its other writers keep their retries. The shared loop
(``sinks/table.py``) refreshes, re-reads the committed mark, and skips or tries again.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.catalog import Catalog, load_catalog
from pyiceberg.exceptions import CommitFailedException, NoSuchTableError, TableAlreadyExistsError
from pyiceberg.expressions import (
    AlwaysFalse,
    AlwaysTrue,
    And,
    BooleanExpression,
    GreaterThanOrEqual,
    IsNull,
    LessThanOrEqual,
    Or,
)
from pyiceberg.table import Table, Transaction
from pyiceberg.table.snapshots import Snapshot
from sqlalchemy.exc import SQLAlchemyError

from volley_dagster.errors import ConfigError
from volley_dagster.io.s3 import S3Endpoint
from volley_dagster.json_records import JsonObject
from volley_dagster.sinks.base import CommitContext, SinkHistory, SinkLocation, SinkPosition, SinkWrite, commit_tags
from volley_dagster.sinks.lineage import ForeignLineage, SinkCommit, SinkMark
from volley_dagster.sinks.table import Mode, TableSink

NUM_RETRIES = "commit.retry.num-retries"


def sqlite_catalog(path: str | os.PathLike[str]) -> dict[str, str]:
    """The embedded default: a SqlCatalog in ``<path>/catalog.db`` with data and
    metadata under ``<path>/warehouse``."""
    root = Path(path).absolute()
    root.mkdir(parents=True, exist_ok=True)
    return {"type": "sql", "uri": f"sqlite:///{root / 'catalog.db'}", "warehouse": (root / "warehouse").as_uri()}


def catalog_properties(catalog: dict[str, str] | None, path: str | os.PathLike[str] | None,
                       s3: S3Endpoint | None, what: str) -> dict[str, str]:
    """A catalog's properties: the given ones, or the local SQLite catalog under ``path``."""
    if catalog is None and path is None:
        raise ConfigError(f"{what} needs catalog properties or a local path for the SQLite catalog")
    return {**(catalog if catalog is not None else sqlite_catalog(path)),  # type: ignore[arg-type]
            **(s3.iceberg_properties() if s3 else {})}


def catalog_identity(properties: dict[str, str]) -> str:
    """Which catalog the properties open (its uri, else its warehouse): two tables of one
    name in two catalogs are two tables. A secret given as a Dagster ``EnvVar`` (the
    asset specs' settings) is named by its variable, never read."""
    for key in ("uri", "warehouse", "type"):
        value: object = properties.get(key)
        if hasattr(value, "env_var_name"):  # an EnvVar is a str whose text may not be read
            return f"${value.env_var_name}"
        if value:
            return str(value)
    return ""


def split_identifier(table: str) -> tuple[str, str]:
    if "." not in table:
        raise ConfigError(f"Iceberg table {table!r} must be 'namespace.table'")
    namespace, name = table.rsplit(".", 1)
    return namespace, name


def open_catalog(name: str, properties: dict[str, str]) -> Catalog:
    for attempt in range(3):
        try:
            return load_catalog(name, **properties)
        except SQLAlchemyError:
            # Processes opening a fresh SQL catalog together race to create
            # its tables; the loser finds them on the next try.
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def epoch_property(pipeline: str) -> str:
    """Where tables written before lineage marks recorded a pipeline's epoch."""
    return f"volley.epoch.{pipeline}"


def mark_prefix(pipeline: str, sink: str) -> str:
    return f"volley.{pipeline}.{sink}."


class IcebergSink(TableSink[Table]):
    """``table`` is ``"namespace.table"``; ``catalog`` holds pyiceberg catalog
    properties (``type``, ``uri``, ``warehouse``, ``s3.*``), e.g. a SqlCatalog on
    PostgreSQL with ``uri="postgresql+psycopg2://..."``; without it, ``path``
    names a local SQLite catalog (see ``sqlite_catalog``). ``mode="upsert"``
    replaces rows by ``key_columns`` (default: the pipeline's key). ``on_foreign_lineage``:
    what to do when the table holds the pipeline's epochs from another checkpoint lineage."""

    conflicts = (CommitFailedException,)
    process_local = ("_catalog", "_table")  # catalogs hold engines and sockets

    def __init__(
        self,
        table: str,
        catalog: dict[str, str] | None = None,
        name: str = "iceberg",
        mode: Mode = "append",
        key_columns: tuple[str, ...] | list[str] | None = None,
        path: str | os.PathLike[str] | None = None,
        s3: S3Endpoint | None = None,
        catalog_name: str = "volley",
        max_attempts: int = 10,
        on_foreign_lineage: ForeignLineage = "fail",
        epoch_column: str | None = None,
    ) -> None:
        super().__init__(name, mode, key_columns, max_attempts, on_foreign_lineage, epoch_column)
        self.identifier = table
        self.namespace, self.table_name = split_identifier(table)
        self.catalog_properties = catalog_properties(catalog, path, s3, "IcebergSink")
        self.catalog_name = catalog_name
        self._catalog: Catalog | None = None
        self._table: Table | None = None

    @property
    def catalog(self) -> Catalog:
        if self._catalog is None:
            self._catalog = open_catalog(self.catalog_name, self.catalog_properties)
        return self._catalog

    def table(self) -> Table | None:
        """The table at the catalog's current metadata (None before the first commit)."""
        return self._load()

    def _load(self, create_with: pa.Schema | None = None) -> Table | None:
        if self._table is None:
            try:
                self._table = self.catalog.load_table(self.identifier)
            except NoSuchTableError:
                if create_with is None:
                    return None
                self._table = self._create(create_with)
        else:
            self._table.refresh()
        return self._table

    def _forget(self) -> None:
        self._table = None

    def _rows(self, table: Table) -> int | None:
        snapshot = table.current_snapshot()
        if snapshot is None:
            return 0
        total = snapshot.summary.get("total-records") if snapshot.summary is not None else None
        return int(total) if total is not None else None

    def _held(self, table: Table, pipeline: str) -> SinkMark | None:
        prefix = mark_prefix(pipeline, self.name)
        props = {"volley." + k[len(prefix):]: v for k, v in table.properties.items() if k.startswith(prefix)}
        if "volley.epoch" in props:
            return SinkMark.from_tags(props)
        legacy = table.properties.get(epoch_property(pipeline))
        return None if legacy is None else SinkMark(int(legacy))

    def _position(self, table: Table | None) -> SinkPosition:
        return SinkPosition(snapshot_id=None if table is None else _snapshot_id(table))

    def _schema(self, table: Table) -> pa.Schema:
        return table.schema().as_arrow()

    def _change_columns(self, table: Table, added: list[pa.Field], dropped: list[str]) -> None:
        with table.update_schema() as update:  # field ids: a name added again later is a new column
            if added:
                update.union_by_name(pa.schema([f.with_nullable(True) for f in added]))
            for name in dropped:
                update.delete_column(name)

    def _write(self, table: Table | None, output: pa.Table, ctx: CommitContext,
               keys: tuple[str, ...], expired: pa.Table) -> SinkWrite:
        assert table is not None  # ``_load(create_with=...)`` created it
        txn = _without_retries(table).transaction()
        stats = self._stage(txn, table, output, keys, commit_tags(ctx, output.num_rows + expired.num_rows),
                            ctx.replace, expired)
        prefix = mark_prefix(ctx.pipeline, self.name)
        txn.set_properties({prefix + k[len("volley."):]: v for k, v in ctx.mark.tags().items()})
        return SinkWrite(stats, self._position(txn.commit_transaction()))

    def _stage(self, txn: Transaction, table: Table, output: pa.Table, keys: tuple[str, ...],
               summary: dict[str, str], replace: bool, expired: pa.Table) -> dict[str, int]:
        """Stage the epoch's rows in ``txn`` (the caller adds the epoch property).
        ``replace``: delete every row first (another lineage's), in the same commit;
        ``expired``: keys whose rows the upsert deletes (and does not write back).

        Upsert = ``Transaction.overwrite`` with an ``overwrite_filter``: delete, then
        append, in the same transaction. The filter is the epoch's key *range*
        (min..max per key column, and its nulls when the epoch has a null there), and
        the rows of that range whose key the epoch does not carry are written back
        (found with a vectorised join). Not ``IN (keys)``: pyiceberg binds an IN list
        key by key in Python, several times per commit (about 9 s at 100k keys); and
        not pyiceberg 0.12's ``Transaction.upsert``, which builds that same IN list and
        then compares every matched row in a Python loop. Keys match null-safely (a
        null equals a null), as in our Delta MERGE. The range is read with every table
        column: rows written back keep the columns the output lacks (another writer's),
        and an updated row takes them from the row it replaces, as Delta's MERGE keeps
        them. Expired keys (state TTL) are in the range and not written back: deleted
        in the same commit. They widen the range, and so the rows rewritten: with keys
        that grow over time, the oldest expire."""
        if replace:
            summary = {**summary, "volley.replaced": "true"}
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Delete operation did not match any records")
                txn.overwrite(output, overwrite_filter=AlwaysTrue(), snapshot_properties=summary)
            return {"inserted": output.num_rows}
        if self.mode == "append":
            txn.append(output, snapshot_properties=summary)
            return {"inserted": output.num_rows}
        epoch_keys = pa.concat_tables([output.select(list(keys)), expired.select(list(keys)).cast(output.select(list(keys)).schema)])
        condition = _key_range(epoch_keys, keys)
        rows, kept = output, 0
        if table.current_snapshot() is not None and not isinstance(condition, AlwaysFalse):
            selected = table.scan(row_filter=condition).to_arrow()  # every column: others' too
            if selected.num_rows:
                rows, kept = _merged(output, selected, epoch_keys, keys)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Delete operation did not match any records")
            txn.overwrite(rows, overwrite_filter=condition, snapshot_properties=summary)
        return {"upserted": output.num_rows, "rewritten": kept, "expired": expired.num_rows}

    def _create(self, schema: pa.Schema) -> Table:
        """Create the namespace and table on first use; a racing
        creator loses with TableAlreadyExistsError and loads the winner's table."""
        try:
            self.catalog.create_namespace_if_not_exists(self.namespace)
        except Exception:
            # Two creators racing on a SQL catalog can both pass the existence check.
            if not self.catalog.namespace_exists(self.namespace):
                raise
        try:
            self._table = self.catalog.create_table(self.identifier, schema=schema)
        except TableAlreadyExistsError:
            self._table = self.catalog.load_table(self.identifier)
        return self._table

    def commits(self, pipeline: str) -> list[SinkCommit]:
        """One APPEND snapshot per commit (an upsert's DELETE snapshot shares its tags),
        since the last replacing commit."""
        return self.history_from(pipeline, 0).commits

    def history_from(self, pipeline: str, sink_epoch: int) -> SinkHistory:
        """The current snapshot's ancestry, newest first, until a commit before
        ``sink_epoch``, a replacing commit, or the table's first snapshot: complete. An
        oldest snapshot that is not the table's first (its parent is gone, or pyiceberg's
        ``expire_snapshots`` cleared the reference) means expiry removed the older ones."""
        table = self.table()
        snapshot = table.current_snapshot() if table is not None else None
        if table is None or snapshot is None:
            return SinkHistory([], complete=True)
        by_id = {s.snapshot_id: s for s in table.snapshots()}
        commits: list[SinkCommit] = []
        while True:
            props = snapshot.summary.additional_properties if snapshot.summary else {}
            if props.get("volley.pipeline") == pipeline and "volley.epoch" in props:
                mark = SinkMark.from_tags(props)
                if mark.epoch < sink_epoch:
                    return SinkHistory(commits[::-1], complete=True)
                if snapshot.summary is not None and snapshot.summary.operation.value == "append":
                    commits.append(SinkCommit(mark, int(props.get("volley.rows", -1))))
                if props.get("volley.replaced") == "true":
                    return SinkHistory(commits[::-1], complete=True)
            parent = by_id.get(snapshot.parent_snapshot_id) if snapshot.parent_snapshot_id is not None else None
            if parent is None:
                return SinkHistory(commits[::-1], complete=_first_snapshot(snapshot))
            snapshot = parent

    def read(self) -> pa.Table:
        table = self.table()
        return pa.table({}) if table is None else table.scan().to_arrow()

    def location(self) -> SinkLocation:
        return SinkLocation("iceberg", table_name=self.identifier, mode=self.mode,
                            epoch_column=self.epoch_column, catalog=catalog_identity(self.catalog_properties))

    def describe(self) -> JsonObject:
        return {**super().describe(), "table": self.identifier, "mode": self.mode,
                "catalog": {k: v for k, v in self.catalog_properties.items() if "secret" not in k and k != "uri"},
                "key_columns": list(self.key_columns) if self.key_columns else None}


def _key_range(output: pa.Table, keys: tuple[str, ...]) -> BooleanExpression:
    """``min(k) <= k <= max(k)`` for every key column of ``output``, or ``k IS NULL``
    where ``output`` has a null in ``k`` (a null key component matches a null)."""
    if output.num_rows == 0:
        return AlwaysFalse()
    condition: BooleanExpression = AlwaysTrue()
    for key in keys:
        column = output.column(key)
        bounds = pc.min_max(column)
        low, high = bounds["min"].as_py(), bounds["max"].as_py()
        matches: list[BooleanExpression] = []
        if low is not None:
            # pyiceberg's predicates are pydantic models whose explicit __init__ mypy does not see
            at_least, at_most = GreaterThanOrEqual(key, low), LessThanOrEqual(key, high)  # type: ignore[call-arg,arg-type,misc]
            matches.append(And(at_least, at_most))
        if column.null_count:
            matches.append(IsNull(key))  # type: ignore[arg-type,misc]
        condition = And(condition, matches[0] if len(matches) == 1 else Or(*matches))
    return condition


def _merged(output: pa.Table, selected: pa.Table, epoch_keys: pa.Table, keys: tuple[str, ...]) -> tuple[pa.Table, int]:
    """The rows that replace ``selected`` (the range's rows, every table column): the
    output's, with the columns only the table has taken from the row each replaces
    (null for a new key), then the rows of keys the epoch does not carry (``epoch_keys``:
    the output's and the expired ones), unchanged; and how many of those there are."""
    old, new = _null_safe(selected, epoch_keys, keys), _null_safe(epoch_keys, epoch_keys, keys)
    on = old.column_names
    old = old.append_column("old", pa.array(np.arange(old.num_rows)))
    survivors = selected.take(old.join(new, keys=on, join_type="left anti").column("old"))
    extra = [n for n in selected.column_names if n not in output.column_names]
    if extra:
        pairs = old.join(new.slice(0, output.num_rows).append_column("new", pa.array(np.arange(output.num_rows))),
                         keys=on, join_type="inner")
        matched = pairs.group_by("new").aggregate([("old", "min")])
        source = np.full(output.num_rows, -1, dtype=np.int64)  # the row each output row replaces, -1: none
        source[matched.column("new").to_numpy()] = matched.column("old_min").to_numpy()
        taken = pa.array(source, mask=source < 0)
        output = pa.table([*output.columns, *(selected.column(n).take(taken) for n in extra)],
                          names=output.column_names + extra)
    if not survivors.num_rows:
        return output, 0
    return pa.concat_tables([output, survivors.select(output.column_names).cast(output.schema)]), survivors.num_rows


def _null_safe(rows: pa.Table, epoch_keys: pa.Table, keys: tuple[str, ...]) -> pa.Table:
    """``rows``' key columns as join columns on which a null equals a null: where the
    epoch's keys hold a null, a flag for it and the value with nulls filled by the
    epoch's least value (only the flag when the epoch has no other value there)."""
    columns: dict[str, pa.ChunkedArray] = {}
    for i, key in enumerate(keys):
        column = rows.column(key)
        if not epoch_keys.column(key).null_count:
            columns[f"k{i}"] = column
            continue
        columns[f"null{i}"] = pc.is_null(column)
        fill = pc.min_max(epoch_keys.column(key))["min"]
        if fill.is_valid:
            columns[f"k{i}"] = pc.fill_null(column, fill.cast(column.type))
    return pa.table(columns)


def _first_snapshot(snapshot: Snapshot) -> bool:
    """Whether a snapshot without a parent is the table's first: in a v2 table its
    sequence number is 1 (a v1 table numbers none, and counts as first)."""
    return snapshot.parent_snapshot_id is None and (snapshot.sequence_number or 0) <= 1


def _snapshot_id(table: Table) -> int | None:
    snapshot = table.current_snapshot()
    return None if snapshot is None else snapshot.snapshot_id


def _without_retries(table: Table) -> Table:
    """``table`` as the sink's transaction starts from it: pyiceberg takes the retry
    count from the metadata a transaction starts from, so only this copy says 0. The
    commit sends no property change: the catalog keeps the owner's value."""
    if table.properties.get(NUM_RETRIES) == "0":
        return table
    metadata = table.metadata.model_copy(update={"properties": {**table.metadata.properties, NUM_RETRIES: "0"}})
    return Table(table.name(), metadata, table.metadata_location, table.io, table.catalog)
