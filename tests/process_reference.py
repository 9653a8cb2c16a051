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
MAX_ROUNDS = 64


@dataclass
class _Access:
    """The handle's state: ``(variable, key) -> rows`` and ``key -> timers`` (ms)."""

    state: dict[tuple[str, Any], list[tuple[Any, ...]]] = field(default_factory=dict)
    timers: dict[Any, set[int]] = field(default_factory=lambda: defaultdict(set))
    key: Any = None


class _Value:
    def __init__(self, access: _Access, name: str) -> None:
        self.access, self.name = access, name

    def _rows(self) -> list[tuple[Any, ...]]:
        return self.access.state.get((self.name, self.access.key), [])

    def exists(self) -> bool:
        return bool(self._rows())

    def get(self) -> tuple[Any, ...] | None:
        rows = self._rows()
        return rows[0] if rows else None

    def update(self, value: Any) -> None:
        self.access.state[(self.name, self.access.key)] = [value if isinstance(value, tuple) else (value,)]

    def clear(self) -> None:
        self.access.state.pop((self.name, self.access.key), None)


class _List(_Value):
    def get(self) -> Any:  # type: ignore[override]
        return iter(list(self._rows()))

    def put(self, rows: list[Any]) -> None:
        if rows:
            self.access.state[(self.name, self.access.key)] = [r if isinstance(r, tuple) else (r,) for r in rows]
        else:
            self.clear()

    def appendValue(self, value: Any) -> None:
        self.put([*self._rows(), value])

    def appendList(self, values: list[Any]) -> None:
        self.put([*self._rows(), *values])


class _Map(_Value):
    """User key -> value, kept as rows (key fields, then value fields) in first-put order."""

    def __init__(self, access: _Access, name: str, key_fields: int) -> None:
        super().__init__(access, name)
        self.n = key_fields

    def _dict(self) -> dict[tuple[Any, ...], tuple[Any, ...]]:
        return {r[:self.n]: r[self.n:] for r in self._rows()}

    def _store(self, entries: dict[tuple[Any, ...], tuple[Any, ...]]) -> None:
        if entries:
            self.access.state[(self.name, self.access.key)] = [k + v for k, v in entries.items()]
        else:
            self.clear()

    def getValue(self, key: Any) -> Any:
        return self._dict().get(key if isinstance(key, tuple) else (key,))

    def containsKey(self, key: Any) -> bool:
        return (key if isinstance(key, tuple) else (key,)) in self._dict()

    def updateValue(self, key: Any, value: Any) -> None:
        entries = self._dict()
        entries[key if isinstance(key, tuple) else (key,)] = value if isinstance(value, tuple) else (value,)
        self._store(entries)

    def iterator(self) -> Any:
        return iter(list(self._dict().items()))

    def keys(self) -> Any:
        return iter(list(self._dict()))

    def values(self) -> Any:
        return iter(list(self._dict().values()))

    def removeKey(self, key: Any) -> None:
        entries = self._dict()
        entries.pop(key if isinstance(key, tuple) else (key,), None)
        self._store(entries)


class _Handle:
    def __init__(self, access: _Access) -> None:
        self.access = access

    def getValueState(self, name: str, schema: object, ttlDurationMs: int | None = None) -> _Value:
        return _Value(self.access, name)

    def getListState(self, name: str, schema: object, ttlDurationMs: int | None = None) -> _List:
        return _List(self.access, name)

    def getMapState(self, name: str, key_schema: str, value_schema: str, ttlDurationMs: int | None = None) -> _Map:
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
        by_key: dict[Any, list[dict[str, Any]]] = {}
        for record in on_time:  # one at a time, in log order
            by_key.setdefault(record[self.key_column], []).append(record)
        out: list[tuple[Any, tuple[Any, ...]]] = []
        for key, rows in by_key.items():
            self.access.key = key
            self._emit(key, self.processor.handleInputRows((key,), iter([(frame or self.frame)(rows)]), values), out)
        limit = (END_OF_STREAM_US if end_of_stream else self.watermark) if event else processing_us
        for _ in range(MAX_ROUNDS if limit is not None else 0):
            due = sorted((t, key) for key, ts in self.access.timers.items() for t in ts if t * 1000 <= limit)
            if not due:
                break
            for t, key in due:
                self.access.key = key
                self._emit(key, self.processor.handleExpiredTimer((key,), values, _Expired(t)), out)
                self.access.timers[key].discard(t)
        else:
            if limit is not None:
                raise RuntimeError("timers still due after 64 rounds")
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
        return {k: list(v) for k, v in self.access.state.items() if v}

    def timers(self) -> dict[Any, list[int]]:
        return {k: sorted(v) for k, v in self.access.timers.items() if v}
