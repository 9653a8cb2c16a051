"""The operator that wrote a checkpoint root, rebuilt from the layout it recorded
(``pipeline.json``): for the tools that have no pipeline (``volley rescale``, ``volley
migrate``, ``volley state``)."""

from __future__ import annotations

from volley_dagster.errors import StateLayoutError
from volley_dagster.json_records import JsonObject
from volley_dagster.operators import accumulators as acc
from volley_dagster.operators.aggregate import Aggregate
from volley_dagster.operators.base import StatefulOperator, StateNamespaces
from volley_dagster.operators.dedup import (
    Deduplicated,
    Deduplication,
    ResolvedUniqueRecords,
    dedup_namespaces,
)
from volley_dagster.operators.dedup_state import DEDUP_NAMESPACES
from volley_dagster.operators.join import JOIN_NAMESPACES, IntervalJoin, ResolvedJoin
from volley_dagster.operators.join_rows import RowCodec
from volley_dagster.operators.process import ResolvedProcessor
from volley_dagster.operators.ttl import StateTtl, with_ttl_namespaces
from volley_dagster.operators.window import WindowedAggregate, Windowing, Windows
from volley_dagster.operators.window_state import WINDOW_NAMESPACES


def recorded_namespaces(layout: JsonObject) -> StateNamespaces:
    """The namespaces of the operator that wrote a checkpoint root, from the layout it
    recorded (``pipeline.json``): for tools that have no pipeline (``volley rescale``)."""
    if "unique_records" in layout:
        return StateNamespaces(DEDUP_NAMESPACES)
    if "join" in layout:
        return JOIN_NAMESPACES
    if "process" in layout:
        return ResolvedProcessor.recorded(layout).namespaces
    if "windowing" in layout:
        namespaces = WINDOW_NAMESPACES
    else:
        namespaces = with_ttl_namespaces(layout["namespace"], StateTtl.recorded(layout["ttl"]) if "ttl" in layout else None)
    return dedup_namespaces(namespaces) if "dedup" in layout else namespaces


def recorded_operator(layout: JsonObject) -> StatefulOperator:
    """The operator that wrote a checkpoint root, rebuilt from the layout it recorded
    (``pipeline.json``), so that tools with no pipeline (``volley state``) decode its
    state exactly as the engine wrote it."""
    if "unique_records" in layout:
        return ResolvedUniqueRecords(Deduplication.recorded(layout["dedup"]))
    if "join" in layout:
        join = IntervalJoin.recorded(layout)
        return ResolvedJoin(join, RowCodec((), ()), RowCodec((), ()), ((), ()))
    if "process" in layout:
        return ResolvedProcessor.recorded(layout)
    kinds: dict[str, type[acc.Accumulator]] = {
        c.__name__: c for c in (acc.Count, acc.Sum, acc.Min, acc.Max, acc.Mean, acc.First, acc.Last)
    }
    try:
        accumulators = tuple((a["name"], kinds[a["type"]](a["column"])) for a in layout["accumulators"])
    except KeyError as exc:
        raise StateLayoutError(f"the recorded aggregate names an accumulator this engine does not know ({exc}); "
                               f"recorded: {layout.get('accumulators')}") from None
    aggregate = Aggregate(accumulators, layout["namespace"], StateTtl.recorded(layout["ttl"]) if "ttl" in layout else None)
    operator: StatefulOperator
    if "windowing" not in layout:
        operator = aggregate.recorded(layout)
    else:
        w = layout["windowing"]
        windowing = Windowing(Windows(**w["windows"]), w["time_column"], w["out_of_orderness_us"], w["lateness_us"])
        operator = WindowedAggregate(windowing, aggregate).recorded(layout)
    return Deduplicated(operator, Deduplication.recorded(layout["dedup"])) if "dedup" in layout else operator


def without_dedup(operator: StatefulOperator) -> StatefulOperator:
    """The aggregate or window a deduplication feeds (the operator itself without one)."""
    return operator.inner if isinstance(operator, Deduplicated) else operator
