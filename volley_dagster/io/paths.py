"""Locations as the engine stores them."""

from __future__ import annotations

import os
from pathlib import Path


def table_uri(uri: str | os.PathLike[str]) -> str:
    """A URI as given (``s3://...``), or a local path made absolute: the same table
    from any working directory, in every record that names it."""
    text = os.fspath(uri)
    return text if "://" in text else str(Path(text).absolute())


TableIdentity = tuple[str, str]  # (kind, location or catalog#name): how a table's writer and reader meet


def table_identity(kind: str, where: str, catalog: str | None = None) -> TableIdentity:
    """How a table's writer (a sink's ``SinkLocation``) and its reader (a table source)
    name one table alike: a Delta table by its location (``s3a://`` as ``s3://``,
    ``file://`` and ``..`` resolved, no trailing ``/``), an Iceberg table by its catalog
    and name."""
    if catalog is not None:
        return (kind, f"{catalog}#{where}")
    text = where.replace("s3a://", "s3://", 1) if where.startswith("s3a://") else where
    text = text.removeprefix("file://")
    if "://" not in text:
        text = os.path.normpath(table_uri(text))
    return (kind, text.rstrip("/") or text)
