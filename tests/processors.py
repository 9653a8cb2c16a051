"""Processors a team might write (``Pipeline.process``), shared by the engine's tests
and the reference (``tests/process_reference.py``): the demo's ``VelocityAlert``
(list state, a timer per payment; it subclasses ``volley_dagster.StatefulProcessor``)
and ``OrderMachine`` (value state, timers deleted and fired; it subclasses pyspark's
own ``StatefulProcessor``, as a processor written for ``transformWithStateInPandas`` does)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pandas as pd
from pyspark.sql.streaming.stateful_processor import (
    ExpiredTimerInfo,
    StatefulProcessor,
    StatefulProcessorHandle,
    TimerValues,
)

from volley_dagster.demo.velocity import millis


class OrderMachine(StatefulProcessor):
    """An order's state machine, placed -> paid -> shipped, in value state; an event-time
    timer at payment plus ``timeout_ms`` emits "not shipped" unless shipping deleted it;
    how many events of each status the order saw, in map state."""

    OUTPUT = "order_id bigint, event string, at_ms bigint"

    def __init__(self, timeout_ms: int = 86_400_000, clock: str = "event", seen_ttl_ms: int | None = None) -> None:
        self.timeout_ms, self.clock = timeout_ms, clock  # "processing": the timeout runs on the epochs' cut times
        self.seen_ttl_ms = seen_ttl_ms  # the map's entries expire this long after their last update

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.order = handle.getValueState("order", "status string, paid_at_ms bigint")
        self.seen = handle.getMapState("seen", "status string", "events bigint, last_ms bigint", self.seen_ttl_ms)

    def handleInputRows(self, key: Any, rows: Iterator[pd.DataFrame],
                        timerValues: TimerValues) -> Iterator[pd.DataFrame]:
        events = []
        for frame in rows:
            for at_ms, status in zip(millis(frame["event_time"]), frame["status"].tolist(), strict=True):
                before = self.seen.getValue((status,))
                self.seen.updateValue((status,), ((before[0] if before else 0) + 1, at_ms))
                current = self.order.get()
                now = None if current is None else current[0]
                if status == "placed" and now is None:
                    self.order.update(("placed", None))
                elif status == "paid" and now in (None, "placed"):
                    paid = at_ms if self.clock == "event" else timerValues.getCurrentProcessingTimeInMs()
                    self.order.update(("paid", paid))
                    self.handle.registerTimer(paid + self.timeout_ms)
                elif status == "shipped" and now in ("paid", "late"):
                    assert current is not None
                    self.handle.deleteTimer(current[1] + self.timeout_ms)
                    self.order.clear()
                else:
                    status = f"unexpected {status} after {now}"
                events.append((key[0], status, at_ms))
        yield pd.DataFrame(events, columns=["order_id", "event", "at_ms"])

    def handleExpiredTimer(self, key: Any, timerValues: TimerValues,
                           expiredTimerInfo: ExpiredTimerInfo) -> Iterator[pd.DataFrame]:
        current = self.order.get()
        if self.seen.containsKey(("placed",)) and not self.seen.containsKey(("shipped",)):
            self.seen.removeKey(("placed",))  # forget the placements of an order given up on
        if current is not None and current[0] == "paid":
            self.order.update(("late", current[1]))
            yield pd.DataFrame([(key[0], "not shipped", expiredTimerInfo.getExpiryTimeInMs())],
                               columns=["order_id", "event", "at_ms"])


class Heartbeat(StatefulProcessor):
    """A beat every ``every_ms`` after a key's latest record, ``beats`` times: a timer
    that re-arms itself in its own handler (it fires once an epoch, as in Spark)."""

    OUTPUT = "beat bigint, at_ms bigint"

    def __init__(self, every_ms: int = 10_000, beats: int = 5) -> None:
        self.every_ms, self.beats = every_ms, beats

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.left = handle.getValueState("left", "bigint")

    def handleInputRows(self, key: Any, rows: Iterator[pd.DataFrame],
                        timerValues: TimerValues) -> Iterator[pd.DataFrame]:
        latest = max(max(millis(frame["event_time"])) for frame in rows)
        for pending in list(self.handle.listTimers()):
            self.handle.deleteTimer(pending)
        self.left.update(self.beats)
        self.handle.registerTimer(latest + self.every_ms)
        return iter([])

    def handleExpiredTimer(self, key: Any, timerValues: TimerValues,
                           expiredTimerInfo: ExpiredTimerInfo) -> Iterator[pd.DataFrame]:
        current = self.left.get()
        left = (current[0] if current else 1) - 1
        yield pd.DataFrame({"beat": [self.beats - left], "at_ms": [expiredTimerInfo.getExpiryTimeInMs()]})
        if left > 0:
            self.left.update(left)
            self.handle.registerTimer(expiredTimerInfo.getExpiryTimeInMs() + self.every_ms)
        else:
            self.left.clear()


class NewHighs(StatefulProcessor):
    """A key's new highs: each input row whose ``events`` beats every earlier one of the
    key is emitted (append), the best so far kept in value state; e.g. over a window's
    counts, the windows that set a merchant's record."""

    OUTPUT = "window_start timestamp, window_end timestamp, events bigint"

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.best = handle.getValueState("best", "bigint")

    def handleInputRows(self, key: Any, rows: Iterator[pd.DataFrame],
                        timerValues: TimerValues) -> Iterator[pd.DataFrame]:
        current = self.best.get()
        best = current[0] if current else 0
        highs = []
        for frame in rows:
            for start, end, events in zip(frame["window_start"], frame["window_end"], frame["events"], strict=True):
                if events > best:
                    best = int(events)
                    highs.append((start, end, best))
        self.best.update((best,))
        yield pd.DataFrame(highs, columns=["window_start", "window_end", "events"])
