"""What a team writes for ``Pipeline.process(...)``: Spark 4's ``StatefulProcessor``
shape (``pyspark/sql/streaming/stateful_processor.py``), so a processor written for
``transformWithStateInPandas`` runs here unchanged. A worker needs none of pyspark's
API client: the handle and the state variables talk to a ``StateAccess``, which the
shard task (``operators/process_state.py``) or the driver's declaring pass gives them.

Frames and state hand timestamps over as Spark does: UTC's wall clock, without a
zone. Differences from Spark, each for exactly-once per epoch: a key's rows arrive in
log order; event-time timers fire at the watermark the epoch's own records move to (and
all of them at the end of the stream); a state variable's type changes only through
``volley migrate``, so ``deleteIfExists`` of a recorded variable is refused."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    import pandas as pd

StateKind = Literal["value", "list", "map"]


@dataclass(frozen=True)
class StateVariable:
    """A state variable as ``init`` declares it: its name, kind and Spark DDL schema."""

    name: str
    kind: StateKind
    schema: object  # Spark DDL text or a StructType, as given (a map's: its value's)
    ttl_ms: int | None = None
    key_schema: object = None  # a map's user key


class StateAccess(Protocol):
    """Where a handle's calls go: the current key's state in a shard task."""

    def declare(self, variable: StateVariable) -> None: ...
    def rows(self, name: str) -> list[tuple[Any, ...]]:
        """The current key's live rows of a variable (a TTL's expired ones left out)."""
    def expiries(self, name: str) -> list[int | None]:
        """When each of ``rows`` expires (µs; None without a TTL)."""
    def put(self, name: str, rows: list[Any], expires: list[int | None] | None = None) -> None:
        """The variable's rows for the current key; ``expires``: each one's expiry kept
        from ``expiries`` (None: the row is written now, so it expires a TTL from now)."""
    def register_timer(self, ms: int) -> None: ...
    def delete_timer(self, ms: int) -> None: ...
    def timers(self) -> list[int]: ...
    def drop(self, name: str) -> None: ...


class TimerValues:
    """The epoch's clocks as a handler sees them, in milliseconds (-1: none yet)."""

    def __init__(self, currentProcessingTimeInMs: int = -1, currentWatermarkInMs: int = -1) -> None:
        self._processing = currentProcessingTimeInMs
        self._watermark = currentWatermarkInMs

    def getCurrentProcessingTimeInMs(self) -> int:
        return self._processing

    def getCurrentWatermarkInMs(self) -> int:
        return self._watermark


class ExpiredTimerInfo:
    def __init__(self, expiryTimeInMs: int = -1) -> None:
        self._expiry = expiryTimeInMs

    def getExpiryTimeInMs(self) -> int:
        return self._expiry


class ValueState:
    """One row per key."""

    def __init__(self, access: StateAccess, name: str) -> None:
        self._access, self._name = access, name

    def exists(self) -> bool:
        return bool(self._access.rows(self._name))

    def get(self) -> tuple[Any, ...] | None:
        rows = self._access.rows(self._name)
        return rows[0] if rows else None

    def update(self, newValue: Any) -> None:
        self._access.put(self._name, [newValue])

    def clear(self) -> None:
        self._access.put(self._name, [])


class ListState:
    """Rows per key, in the order they were put."""

    def __init__(self, access: StateAccess, name: str) -> None:
        self._access, self._name = access, name

    def exists(self) -> bool:
        return bool(self._access.rows(self._name))

    def get(self) -> Iterator[tuple[Any, ...]]:
        return iter(self._access.rows(self._name))

    def put(self, newState: list[Any]) -> None:
        self._access.put(self._name, list(newState))

    def appendValue(self, newState: Any) -> None:
        self.appendList([newState])

    def appendList(self, newState: list[Any]) -> None:
        """The rows already held keep their expiry (a TTL), the new ones start theirs."""
        rows, expires = self._access.rows(self._name), self._access.expiries(self._name)
        self._access.put(self._name, [*rows, *newState], [*expires, *(None for _ in newState)])

    def clear(self) -> None:
        self._access.put(self._name, [])


class MapState:
    """Rows per key under user keys, each user key once, in the order first put."""

    def __init__(self, access: StateAccess, name: str, key_fields: int) -> None:
        self._access, self._name, self._n = access, name, key_fields

    def _entries(self) -> dict[tuple[Any, ...], tuple[tuple[Any, ...], int | None]]:
        rows, expires = self._access.rows(self._name), self._access.expiries(self._name)
        return {row[:self._n]: (row[self._n:], e) for row, e in zip(rows, expires, strict=True)}

    def _put(self, entries: dict[tuple[Any, ...], tuple[tuple[Any, ...], int | None]]) -> None:
        """An entry updated starts its expiry (a TTL), the others keep theirs."""
        self._access.put(self._name, [k + v for k, (v, _) in entries.items()], [e for _, e in entries.values()])

    @staticmethod
    def _tuple(value: Any) -> tuple[Any, ...]:
        return value if isinstance(value, tuple) else (value,)

    def exists(self) -> bool:
        return bool(self._access.rows(self._name))

    def getValue(self, key: Any) -> tuple[Any, ...] | None:
        found = self._entries().get(self._tuple(key))
        return None if found is None else found[0]

    def containsKey(self, key: Any) -> bool:
        return self._tuple(key) in self._entries()

    def updateValue(self, key: Any, value: Any) -> None:
        entries = self._entries()
        entries[self._tuple(key)] = (self._tuple(value), None)
        self._put(entries)

    def iterator(self) -> Iterator[tuple[tuple[Any, ...], tuple[Any, ...]]]:
        return iter([(k, v) for k, (v, _) in self._entries().items()])

    def keys(self) -> Iterator[tuple[Any, ...]]:
        return iter(list(self._entries()))

    def values(self) -> Iterator[tuple[Any, ...]]:
        return iter([v for v, _ in self._entries().values()])

    def removeKey(self, key: Any) -> None:
        entries = self._entries()
        if entries.pop(self._tuple(key), None) is not None:
            self._put(entries)

    def clear(self) -> None:
        self._access.put(self._name, [])


class StatefulProcessorHandle:
    """What ``init`` declares state and timers with."""

    def __init__(self, access: StateAccess) -> None:
        self._access = access

    def getValueState(self, stateName: str, schema: object, ttlDurationMs: int | None = None) -> ValueState:
        self._access.declare(StateVariable(stateName, "value", schema, ttlDurationMs))
        return ValueState(self._access, stateName)

    def getListState(self, stateName: str, schema: object, ttlDurationMs: int | None = None) -> ListState:
        self._access.declare(StateVariable(stateName, "list", schema, ttlDurationMs))
        return ListState(self._access, stateName)

    def getMapState(self, stateName: str, userKeySchema: object, valueSchema: object,
                    ttlDurationMs: int | None = None) -> MapState:
        from volley_dagster.operators.process_rows import parse_schema

        self._access.declare(StateVariable(stateName, "map", valueSchema, ttlDurationMs, userKeySchema))
        return MapState(self._access, stateName, len(parse_schema(userKeySchema, f"state variable {stateName!r}")))

    def registerTimer(self, expiryTimestampMs: int) -> None:
        """An event-time timer of the current key: it fires once the watermark reaches it."""
        self._access.register_timer(int(expiryTimestampMs))

    def deleteTimer(self, expiryTimestampMs: int) -> None:
        self._access.delete_timer(int(expiryTimestampMs))

    def listTimers(self) -> Iterator[int]:
        return iter(self._access.timers())

    def deleteIfExists(self, stateName: str) -> None:
        self._access.drop(stateName)


class StatefulProcessor(ABC):
    """A team's own per-key logic (Spark 4's ``StatefulProcessor``, pandas form).
    Processors must be deterministic: the same rows and clocks give the same state and
    rows on every retry (use ``TimerValues``, never the wall clock or unseeded randomness)."""

    @abstractmethod
    def init(self, handle: StatefulProcessorHandle) -> None:
        """Declare the state variables (once on the driver, then in every shard task)."""

    @abstractmethod
    def handleInputRows(self, key: tuple[Any, ...], rows: Iterator[pd.DataFrame],
                        timerValues: TimerValues) -> Iterator[pd.DataFrame]:
        """One key's rows of the epoch, in log order; yields output rows."""

    def handleExpiredTimer(self, key: tuple[Any, ...], timerValues: TimerValues,
                           expiredTimerInfo: ExpiredTimerInfo) -> Iterator[pd.DataFrame]:
        return iter([])

    def close(self) -> None:  # noqa: B027 - optional, as in Spark
        """Called after the shard's keys and timers."""

    def handleInitialState(self, key: tuple[Any, ...], initialState: pd.DataFrame,  # noqa: B027
                           timerValues: TimerValues) -> None:
        """Not called yet: ``Pipeline.process`` takes no initial state."""
