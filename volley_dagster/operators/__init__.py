"""Stateful operators: what a shard's state holds and how epochs fold into it."""

from __future__ import annotations

from typing import Any

from volley_dagster.operators.base import StateNamespaces
from volley_dagster.operators.window_state import WINDOW_NAMESPACES


def recorded_namespaces(layout: dict[str, Any]) -> StateNamespaces:
    """The namespaces of the operator that wrote a checkpoint root, from the layout it
    recorded (``pipeline.json``): for tools that have no pipeline (``volley rescale``)."""
    return WINDOW_NAMESPACES if "windowing" in layout else StateNamespaces((layout["namespace"],))
