"""Engine errors raised inside Spark tasks come back to the driver as themselves."""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

from pyspark.errors import PythonException

from volley_dagster import errors

if TYPE_CHECKING:
    from volley_dagster.sources.offsets import EpochRange

_TASK_ERROR = re.compile(r"volley_dagster\.errors\.(\w+): (.*)")
_JVM_TAIL = ("\n SQLSTATE", "\n\tat ")  # where a worker's Python traceback ends in a task's error text
_POSITION = re.compile(r"handling position (\d+)")


@contextmanager
def engine_errors() -> Iterator[None]:
    """Re-raise an engine error thrown inside a Spark task as itself, not as a
    Python-worker traceback wrapped in a JVM exception."""
    try:
        yield
    except PythonException as exc:
        match = _TASK_ERROR.search(str(exc))
        cls = getattr(errors, match.group(1), None) if match else None
        if match and isinstance(cls, type) and issubclass(cls, errors.VolleyError):
            message = match.group(2)
            if issubclass(cls, errors.ProcessorError):  # its lines after the first: the processor's traceback
                rest = str(exc)[match.start(2):]
                message = rest[:min([i for i in map(rest.find, _JVM_TAIL) if i >= 0], default=len(rest))].rstrip()
            raise cls(message) from exc
        raise


@contextmanager
def records_located(rng: EpochRange) -> Iterator[None]:
    """A processor's error names a record by its event position (``columns.POS``), all a
    shard task knows: say its file (or topic) and record offset, which a person can open."""
    try:
        yield
    except errors.ProcessorError as exc:
        def where(match: re.Match[str]) -> str:
            segment, offset = rng.segment_of(int(match.group(1)))
            partition = f" (partition {segment.partition})" if segment.partition else ""
            return f"handling {segment.file} record {offset}{partition}"
        text = _POSITION.sub(where, str(exc))
        if text == str(exc):
            raise
        raise errors.ProcessorError(text) from exc
