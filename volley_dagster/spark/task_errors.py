"""Engine errors raised inside Spark tasks come back to the driver as themselves."""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Iterator

from pyspark.errors import PythonException

from volley_dagster import errors

_TASK_ERROR = re.compile(r"volley_dagster\.errors\.(\w+): (.*)")


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
            raise cls(match.group(2)) from exc
        raise
