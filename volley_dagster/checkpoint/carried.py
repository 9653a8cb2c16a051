"""Columns an operator's state carries whole (a join's waiting rows): recorded by type in
the pipeline's identity under ``CARRIED_COLUMNS`` (``{group: {column: Spark type}}``),
and checked apart from the rest of it. A column may come or go (rows written without
it read it as null; a column no longer carried is ignored), and an integer may widen;
any other change of type is refused by name before an epoch runs, since the rows
already waiting were written with the old type and cannot be read as the new."""

from __future__ import annotations

from volley_dagster.json_records import JsonObject

CARRIED_COLUMNS = "carried_columns"
_INTEGERS = ("tinyint", "smallint", "int", "bigint")  # widening order


def readable_as(written: str, wanted: str) -> bool:
    """Whether a value written as Spark type ``written`` reads back as ``wanted``."""
    if written == wanted:
        return True
    return written in _INTEGERS and wanted in _INTEGERS and _INTEGERS.index(written) <= _INTEGERS.index(wanted)


def carried_type_changes(recorded: JsonObject, proposed: JsonObject) -> list[str]:
    """Each column carried under both operator layouts whose type the proposed one reads
    differently (a recorded layout without the record: none known, none refused)."""
    old, new = recorded.get(CARRIED_COLUMNS) or {}, proposed.get(CARRIED_COLUMNS) or {}
    return [f"column {name!r} of {group!r} was carried as {old[group][name]} and is now {kind}"
            for group, columns in new.items() for name, kind in columns.items()
            if name in old.get(group, {}) and not readable_as(old[group][name], kind)]


def without_carried(identity: JsonObject) -> JsonObject:
    """The identity without its carried columns' record, which ``carried_type_changes`` checks."""
    operator = identity.get("aggregate")
    if not isinstance(operator, dict) or CARRIED_COLUMNS not in operator:
        return identity
    return {**identity, "aggregate": {k: v for k, v in operator.items() if k != CARRIED_COLUMNS}}
