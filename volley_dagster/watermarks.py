"""The watermarks an epoch starts from or ends at, as one typed record (the clock's
rules: ``operators/event_time.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Watermarks:
    """The pipeline's watermark and, when it has several inputs with an event time each
    (a join's two sides), each input's own: the pipeline's is their minimum (Spark's
    ``multipleWatermarkPolicy=min``), so a source that runs ahead never makes the
    other's records late."""

    value: int | None = None
    inputs: dict[str, int] = field(default_factory=dict)
