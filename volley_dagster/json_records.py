"""The JSON form of the engine's typed records, for the files they are written to
(manifests, offsets, layouts, ``pipeline.json``) and the descriptions an orchestrator
shows. A ``JsonObject`` is what a record's ``to_dict`` returns and its ``from_dict``
reads: code between modules passes the typed records themselves, never these."""

from __future__ import annotations

from typing import Any

JsonObject = dict[str, Any]  # a parsed JSON object, at a file or display boundary only

__all__ = ["JsonObject"]
