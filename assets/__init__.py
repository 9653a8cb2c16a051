"""The demo's pipelines (this repository's own code location, ``definitions.py``):
running payments totals and per-minute windows over the events ``volley generate``
appends under ``$VOLLEY_DEMO_DIR/events``, and payments joined with their refunds over
the two logs it appends under ``$VOLLEY_DEMO_DIR/streams``, and the refunds per merchant per
hour read from that join's Iceberg table (a pipeline fed by another). Each becomes its
assets through the library's ``volley_dagster.dagster.build_definitions``."""

import os
from pathlib import Path

from volley_dagster.demo.merchant_refunds import merchant_refunds_deployment
from volley_dagster.demo.payments import merchant_minutes_deployment, payments_deployment
from volley_dagster.demo.refunds import refunds_deployment
from volley_dagster.deploy import Deployment

DEMO = Path(os.environ.get("VOLLEY_DEMO_DIR", "demo")).absolute()


def demo_deployments() -> list[Deployment]:
    return [payments_deployment(DEMO / "events"), merchant_minutes_deployment(DEMO / "events"),
            refunds_deployment(DEMO / "streams"), merchant_refunds_deployment()]
