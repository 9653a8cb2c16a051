"""The pipeline's one event-time clock, shared by windows, event-time TTL and
deduplication (a pipeline has one: ``Pipeline._check_clock``).

The rules, for every operator that uses event time:

- **Watermark.** After epoch N it is ``max(W[N-1], latest believable event time of
  epoch N - max_out_of_orderness)``: it never moves back, it is stored in the
  epoch's manifest, and a re-run of the epoch computes the same one.
- **Skew guard.** With ``max_event_time_skew`` (by default ``"1 day"``, for every
  operator on event time; None turns it off), an event time later than the wall
  clock when the epoch was cut plus the skew is not believed: the record is a bad
  record (dead letter, or the epoch fails), and never moves the watermark. So one
  record stamped 2099 never makes every later record late: Spark and Flink follow it. The cut
  time is recorded with the range, so every attempt decides the same; a pause in
  the stream longer than the skew is not a reason (the guard is the wall clock, not
  the watermark), and old data replayed lies before the wall clock.
- **Handed on.** In a chain (``chain.py``), a stage after the first whose operator
  has an event time does not observe its own: the stage before hands it its
  watermark (``handed``), ``max(W[N-1], given - max_out_of_orderness)``, as Spark 4
  and Flink pass a watermark from one operator to the next.
- **Late.** A record is late when what it belongs to had closed when its epoch
  began, judged against ``W[N-1]``: a window whose end plus ``allowed_lateness`` is
  at or before it (``operators.window``); dedup and TTL deadlines likewise compare
  with the watermark (``operators.dedup``, ``operators.ttl``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from typing import TypeVar

from pyspark.sql import Column
from pyspark.sql import functions as F
from pyspark.sql import types as T

from volley_dagster.errors import ConfigError
from volley_dagster.watermarks import Watermarks

Duration = str | timedelta

_UNITS_US = {
    "us": 1, "microsecond": 1, "ms": 1_000, "millisecond": 1_000, "s": 1_000_000, "sec": 1_000_000,
    "second": 1_000_000, "m": 60_000_000, "min": 60_000_000, "minute": 60_000_000, "h": 3_600_000_000,
    "hour": 3_600_000_000, "d": 86_400_000_000, "day": 86_400_000_000,
}
_DURATION = re.compile(r"^\s*(\d+)\s*([a-z]+?)s?\s*$")


def describe_event_time(micros: int) -> str:
    """An event time (microseconds since 1970, UTC) as ISO 8601; one Python's datetime
    cannot hold (after year 9999, before year 1) as its number, so a single record with
    a wild event time never breaks what shows a watermark."""
    try:
        return datetime.fromtimestamp(micros / 1e6, tz=timezone.utc).isoformat()
    except (OverflowError, ValueError, OSError):
        return f"{micros} microseconds since 1970-01-01T00:00:00+00:00"


_Clock = TypeVar("_Clock", bound="EventTime")

# a clock a day fast is wrong, not early: time zones put honest clocks at most 14 h ahead
DEFAULT_MAX_EVENT_TIME_SKEW: Duration = "1 day"


def skew_us(value: Duration | None) -> int | None:
    """``max_event_time_skew`` in microseconds; None: every event time is believed."""
    return None if value is None else duration_us(value, "max_event_time_skew")


def duration_us(value: Duration, what: str) -> int:
    """``"30 seconds"``, ``"1 minute"``, ``"500ms"`` or a ``timedelta``, in microseconds."""
    if isinstance(value, timedelta):
        us = value // timedelta(microseconds=1)
    else:
        match = _DURATION.match(str(value).lower())
        unit = match and (_UNITS_US.get(match.group(2)) or _UNITS_US.get(match.group(2) + "s"))
        if not match or not unit:
            raise ConfigError(f"{what}: cannot read {value!r} as a duration; use e.g. '30 seconds', '1 minute', '250 ms'")
        us = int(match.group(1)) * unit
    if us < 0:
        raise ConfigError(f"{what} must not be negative, got {value!r}")
    return us


@dataclass(frozen=True)
class EventTime:
    """The timestamp column ``time_column`` and the watermark policy over it.
    ``max_skew_us``: how far past the wall clock of the cut an event time is
    believed; None believes any."""

    time_column: str
    out_of_orderness_us: int = 0
    max_skew_us: int | None = None
    # a chain's later stage: the watermark the stage before hands on for this epoch
    # (None: none yet), instead of the latest event time observed
    handed: bool = field(default=False, kw_only=True)
    given_us: int | None = field(default=None, kw_only=True)

    def handed_on(self: _Clock, given_us: int | None) -> _Clock:
        """This clock in a stage whose watermark the stage before hands on. Its event
        times move nothing, so none is refused as too far ahead (the skew guard is off):
        a week's window the stream's end fires is dated a week past the cut."""
        return replace(self, handed=True, given_us=given_us, max_skew_us=None)

    def check(self, schema: T.StructType, what: str) -> None:
        column = self.time_column
        if column not in schema.names:
            raise ConfigError(f"{what}(on={column!r}): no such column; columns are {schema.names}")
        if not isinstance(schema[column].dataType, (T.TimestampType, T.TimestampNTZType)):
            raise ConfigError(
                f"{what}(on={column!r}): the event-time column must be a timestamp, "
                f"got {schema[column].dataType.simpleString()}"
            )

    def column(self) -> Column:
        """Each record's event time (a join takes each side's from its own column)."""
        return F.col(self.time_column)

    @property
    def shown(self) -> str:
        """How errors and dead letters name the event time."""
        return repr(self.time_column)

    def event_us(self) -> Column:
        return F.unix_micros(self.column().cast("timestamp"))

    def before(self, micros: int) -> Column:
        """Whether a record's event time is earlier than ``micros``, compared on the column
        itself (``event_us() < micros``; the cast is dropped for a timestamp column), so
        Spark can push it into a Parquet scan."""
        return self.column().cast("timestamp") < F.timestamp_micros(F.lit(micros))

    def event_time_bound(self, watermark: int | None, cut_at_us: int | None) -> int | None:
        """The latest event time an epoch believes: ``max_event_time_skew`` past the wall
        clock when it was cut (recorded with the range, so a retry decides the same).
        Later ones are bad records: one record from the far future would otherwise move
        the watermark for good. Not the watermark plus the skew: a stream that resumes
        after a pause longer than the skew (a night, a weekend) would then be refused
        whole, every epoch again, and which records pass would depend on the cuts.
        Backfills of old data lie before the wall clock and pass. Only a range cut
        before its cut time was recorded falls back to the watermark."""
        if self.max_skew_us is None:
            return None
        anchor = cut_at_us if cut_at_us is not None else watermark
        return None if anchor is None else anchor + self.max_skew_us

    @property
    def inputs(self) -> tuple[str, ...]:
        """The inputs with a watermark of their own ("": the pipeline's one)."""
        return ("",)

    def time_column_of(self, name: str) -> str:
        """Input ``name``'s event-time column."""
        return self.time_column

    def input_of(self, source: str | None, source_column: str | None) -> str | None:
        """Which input the records of source ``source`` feed, when a pipeline of several
        sources names each record's in ``source_column`` (None, None: a single source);
        None: it cannot tell from the source alone."""
        return ""

    def maxima(self, valid_time: Column) -> dict[str, Column]:
        """What the side-output job observes of the epoch's valid event times (microseconds):
        their maximum; per input for a clock of several."""
        return {"": F.max(valid_time)}

    def advance_all(self, previous: Watermarks, maxima: dict[str, int | None]) -> Watermarks:
        """The watermarks after an epoch whose observed ``maxima`` are these."""
        return Watermarks(self.advance(previous.value, maxima.get("")))

    def advance(self, previous: int | None, max_event_us: int | None) -> int | None:
        """The watermark after an epoch whose latest event time is ``max_event_us``."""
        if self.handed:
            max_event_us = self.given_us
        if max_event_us is None:
            return previous
        candidate = max_event_us - self.out_of_orderness_us
        return candidate if previous is None else max(previous, candidate)
