"""Locations as the engine stores them."""

from __future__ import annotations

import os
from pathlib import Path


def table_uri(uri: str | os.PathLike[str]) -> str:
    """A URI as given (``s3://...``), or a local path made absolute: the same table
    from any working directory, in every record that names it."""
    text = os.fspath(uri)
    return text if "://" in text else str(Path(text).absolute())
