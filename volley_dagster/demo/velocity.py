"""The demo's own processor (``Pipeline.process``): a card paying ``threshold`` times
within ``window_ms`` raises an alert. Cards are the demo's merchants folded onto
fewer keys (``merchant_id % cards``), so alerts come often at the demo's rates. The
alerts go to a Delta table (append)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd

from volley_dagster import FileLog, Pipeline, StatefulProcessor
from volley_dagster.deploy import Deployment, TableSettings
from volley_dagster.operators.process_api import ExpiredTimerInfo, StatefulProcessorHandle, TimerValues
from volley_dagster.sinks import DeltaSink

_EPOCH = pd.Timestamp(0)


def millis(times: pd.Series) -> list[int]:
    """Timestamps (any unit; UTC's wall clock, as Spark hands them over) as milliseconds since the epoch."""
    return ((times - _EPOCH) // pd.Timedelta(milliseconds=1)).astype("int64").tolist()


class VelocityAlert(StatefulProcessor):
    """Each card's recent payments in list state, dropped by an event-time timer once
    they age out of the window."""

    OUTPUT = "card bigint, alert_at_ms bigint, payments int, total double"

    def __init__(self, window_ms: int = 60_000, threshold: int = 5) -> None:
        self.window_ms, self.threshold = window_ms, threshold

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.recent = handle.getListState("recent", "at_ms bigint, amount double")

    def handleInputRows(self, key: tuple[Any, ...], rows: Iterator[pd.DataFrame],
                        timerValues: TimerValues) -> Iterator[pd.DataFrame]:
        recent = list(self.recent.get())
        alerts = []
        for frame in rows:
            for at_ms, amount in zip(millis(frame["event_time"]), frame["amount"].tolist(), strict=True):
                recent = [r for r in recent if r[0] > at_ms - self.window_ms] + [(at_ms, float(amount))]
                if len(recent) >= self.threshold:
                    alerts.append((key[0], at_ms, len(recent), sum(a for _, a in recent)))
                self.handle.registerTimer(at_ms + self.window_ms)
        if recent:
            self.recent.put(recent)
        else:
            self.recent.clear()
        if alerts:
            yield pd.DataFrame(alerts, columns=["card", "alert_at_ms", "payments", "total"])

    def handleExpiredTimer(self, key: tuple[Any, ...], timerValues: TimerValues,
                           expiredTimerInfo: ExpiredTimerInfo) -> Iterator[pd.DataFrame]:
        cutoff = expiredTimerInfo.getExpiryTimeInMs() - self.window_ms
        left = [r for r in self.recent.get() if r[0] > cutoff]
        if left:
            self.recent.put(left)
        else:
            self.recent.clear()
        return iter([])


def velocity_pipeline(events: str | Path, tables: TableSettings, cards: int = 17, window_ms: int = 60_000,
                      threshold: int = 5, shards: int = 4) -> Pipeline:
    return (
        Pipeline("velocity")
        .source(FileLog(events, format="parquet"))
        .with_column("card", f"merchant_id % {cards}")
        .key_by("card")
        .process(VelocityAlert(window_ms, threshold), output_schema=VelocityAlert.OUTPUT, time_mode="EventTime",
                 event_time="event_time", max_out_of_orderness="10 seconds",
                 input_columns=["card", "event_time", "amount"])
        .sink(DeltaSink(f"{tables.warehouse}/delta/velocity_alerts", name="alerts", mode="append",
                        storage_options=tables.delta_storage_options, on_foreign_lineage=tables.on_foreign_lineage))
        .with_shards(shards)
    )


def velocity_deployment(events: str | Path, cards: int = 17) -> Deployment:
    from volley_dagster.demo.payments import demo_deployment

    return demo_deployment("velocity", lambda tables: velocity_pipeline(events, tables, cards=cards))
