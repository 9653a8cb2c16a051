"""``Pipeline.process``'s reference: the rules of ``volley_dagster.operators.process``
applied to the same processor record by record in plain Python, one epoch at a time.
It shares no code with the engine: state lives in dicts, timers in sets, a key's
records are gathered one at a time in log order.

A record is a dict of the input columns, the event time (``time_column``) in
microseconds since the epoch. ``run`` returns the emitted rows as ``(key, row)``
tuples (the row without the key, in the output's column order) and the late records."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

END_OF_STREAM_US = (1 << 63) - 2


@dataclass
class _Access:
    """The handle's state: ``(variable, key) -> [(expires, row)]`` (expires: ms of
    processing time, None without a TTL) and ``key -> timers`` (ms)."""

    state: dict[tuple[str, Any], list[tuple[int | None, tuple[Any, ...]]]] = field(default_factory=dict)
    timers: dict[Any, set[int]] = field(default_factory=lambda: defaultdict(set))
    ttl_ms: dict[str, int | None] = field(default_factory=dict)
    key: Any = None
    now_ms: int = -1  # the epoch's processing time


def _row(value: Any) -> tuple[Any, ...]:
    return value if isinstance(value, tuple) else (value,)


class _Value:
    def __init__(self, access: _Access, name: str) -> None:
        self.access, self.name = access, name

    def _entries(self) -> list[tuple[int | None, tuple[Any, ...]]]:
        """The live rows: a TTL's expired ones are gone."""
        return [(e, r) for e, r in self.access.state.get((self.name, self.access.key), [])
                if e is None or e > self.access.now_ms]

    def _rows(self) -> list[tuple[Any, ...]]:
        return [r for _, r in self._entries()]

    def _fresh(self) -> int | None:
        ttl = self.access.ttl_ms.get(self.name)
        return None if ttl is None else self.access.now_ms + ttl

    def _store(self, entries: list[tuple[int | None, tuple[Any, ...]]]) -> None:
        if entries:
            self.access.state[(self.name, self.access.key)] = entries
        else:
            self.clear()

    def exists(self) -> bool:
        return bool(self._rows())

    def get(self) -> tuple[Any, ...] | None:
        rows = self._rows()
        return rows[0] if rows else None

    def update(self, value: Any) -> None:
        self._store([(self._fresh(), _row(value))])

    def clear(self) -> None:
        self.access.state.pop((self.name, self.access.key), None)


class _List(_Value):
    def get(self) -> Any:  # type: ignore[override]
        return iter(self._rows())

    def put(self, rows: list[Any]) -> None:
        self._store([(self._fresh(), _row(r)) for r in rows])

    def appendValue(self, value: Any) -> None:
        self.appendList([value])

    def appendList(self, values: list[Any]) -> None:
        self._store(self._entries() + [(self._fresh(), _row(v)) for v in values])


class _Map(_Value):
    """User key -> value, in first-put order; an update starts that entry's TTL."""

    def __init__(self, access: _Access, name: str, key_fields: int) -> None:
        super().__init__(access, name)
        self.n = key_fields

    def _dict(self) -> dict[tuple[Any, ...], tuple[int | None, tuple[Any, ...]]]:
        return {r[:self.n]: (e, r[self.n:]) for e, r in self._entries()}

    def _put(self, entries: dict[tuple[Any, ...], tuple[int | None, tuple[Any, ...]]]) -> None:
        self._store([(e, k + v) for k, (e, v) in entries.items()])

    def getValue(self, key: Any) -> Any:
        found = self._dict().get(_row(key))
        return None if found is None else found[1]

    def containsKey(self, key: Any) -> bool:
        return _row(key) in self._dict()

    def updateValue(self, key: Any, value: Any) -> None:
        entries = self._dict()
        entries[_row(key)] = (self._fresh(), _row(value))
        self._put(entries)

    def iterator(self) -> Any:
        return iter([(k, v) for k, (_, v) in self._dict().items()])

    def keys(self) -> Any:
        return iter(list(self._dict()))

    def values(self) -> Any:
        return iter([v for _, v in self._dict().values()])

    def removeKey(self, key: Any) -> None:
        entries = self._dict()
        entries.pop(_row(key), None)
        self._put(entries)


class _Handle:
    def __init__(self, access: _Access) -> None:
        self.access = access

    def getValueState(self, name: str, schema: object, ttlDurationMs: int | None = None) -> _Value:
        self.access.ttl_ms[name] = ttlDurationMs
        return _Value(self.access, name)

    def getListState(self, name: str, schema: object, ttlDurationMs: int | None = None) -> _List:
        self.access.ttl_ms[name] = ttlDurationMs
        return _List(self.access, name)

    def getMapState(self, name: str, key_schema: str, value_schema: str, ttlDurationMs: int | None = None) -> _Map:
        self.access.ttl_ms[name] = ttlDurationMs
        return _Map(self.access, name, len(key_schema.split(",")))

    def registerTimer(self, ms: int) -> None:
        self.access.timers[self.access.key].add(int(ms))

    def deleteTimer(self, ms: int) -> None:
        self.access.timers[self.access.key].discard(int(ms))

    def listTimers(self) -> Any:
        return iter(sorted(self.access.timers[self.access.key]))


class _Values:
    def __init__(self, watermark_ms: int, processing_ms: int = -1) -> None:
        self.watermark_ms, self.processing_ms = watermark_ms, processing_ms

    def getCurrentProcessingTimeInMs(self) -> int:
        return self.processing_ms

    def getCurrentWatermarkInMs(self) -> int:
        return self.watermark_ms


class _Expired:
    def __init__(self, ms: int) -> None:
        self.ms = ms

    def getExpiryTimeInMs(self) -> int:
        return self.ms


@dataclass
class ProcessReference:
    processor: Any
    key_column: str
    time_column: str
    output_columns: list[str]  # after the key
    out_of_orderness_us: int = 0
    clock: str = "event"  # the timers' clock: "event" (the watermark) or "processing" (the epoch's cut time)
    watermark: int | None = None
    access: _Access = field(default_factory=_Access)

    def __post_init__(self) -> None:
        self.processor.init(_Handle(self.access))

    def run(self, records: list[dict[str, Any]], end_of_stream: bool = False,
            frame: Callable[[list[dict[str, Any]]], pd.DataFrame] | None = None, processing_us: int | None = None
            ) -> tuple[list[tuple[Any, tuple[Any, ...]]], list[dict[str, Any]]]:
        """``processing_us``: the epoch's processing time (its cut's)."""
        before = self.watermark
        event = self.clock == "event"
        late = [r for r in records if event and before is not None and r[self.time_column] <= before]
        on_time = [r for r in records if not (event and before is not None and r[self.time_column] <= before)]
        if records and event:
            latest = max(r[self.time_column] for r in records) - self.out_of_orderness_us
            self.watermark = latest if before is None else max(before, latest)
        values = _Values(-1 if self.watermark is None else self.watermark // 1000,
                         -1 if processing_us is None else processing_us // 1000)
        self.access.now_ms = -1 if processing_us is None else processing_us // 1000
        by_key: dict[Any, list[dict[str, Any]]] = {}
        for record in on_time:  # one at a time, in log order
            by_key.setdefault(record[self.key_column], []).append(record)
        out: list[tuple[Any, tuple[Any, ...]]] = []
        for key, rows in by_key.items():
            self.access.key = key
            self._emit(key, self.processor.handleInputRows((key,), iter([(frame or self.frame)(rows)]), values), out)
        limit = (END_OF_STREAM_US if end_of_stream else self.watermark) if event else processing_us
        # the timers due when their turn comes, each once; one a timer's handler registers waits for the next epoch
        due = [] if limit is None else [(key, t) for key, ts in self.access.timers.items() for t in ts
                                        if t * 1000 <= limit]
        for key, t in sorted(due, key=lambda d: d[1]):
            if t not in self.access.timers[key]:
                continue  # deleted by a handler of its key
            self.access.key = key
            self._emit(key, self.processor.handleExpiredTimer((key,), values, _Expired(t)), out)
            self.access.timers[key].discard(t)
        self.access.key = None
        return out, late

    def frame(self, rows: list[dict[str, Any]]) -> pd.DataFrame:
        """A key's records as Spark hands them over: the event time UTC's wall clock, no zone."""
        df = pd.DataFrame(rows)
        df[self.time_column] = pd.to_datetime(df[self.time_column], unit="us").astype("datetime64[us]")
        return df

    def _emit(self, key: Any, frames: Any, out: list[tuple[Any, tuple[Any, ...]]]) -> None:
        for df in frames or []:
            for row in df[self.output_columns].itertuples(index=False):
                out.append((key, tuple(row)))

    def state(self) -> dict[tuple[str, Any], list[tuple[Any, ...]]]:
        """Every variable's live rows after the last epoch (a TTL's expired ones are gone)."""
        now = self.access.now_ms
        live = {k: [r for e, r in v if e is None or e > now] for k, v in self.access.state.items()}
        return {k: v for k, v in live.items() if v}

    def expiries(self) -> dict[tuple[str, Any], list[int | None]]:
        now = self.access.now_ms
        return {k: [e for e, _ in v if e is None or e > now] for k, v in self.access.state.items()
                if any(e is None or e > now for e, _ in v)}

    def timers(self) -> dict[Any, list[int]]:
        return {k: sorted(v) for k, v in self.access.timers.items() if v}
