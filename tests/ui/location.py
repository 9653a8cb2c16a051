"""The demo code location over a test's directory (``VOLLEY_TEST_BASE``). Its sensor
is stopped, so that only the test launches runs, unless ``VOLLEY_TEST_SENSOR`` is
set: then it runs as in production, ticking every few seconds and cutting an epoch
as soon as any record waits. Runs use a local Spark each, unless ``VOLLEY_TEST_WARM``
is set: then the warm Spark, as ``./dev dagster`` does by default.
``VOLLEY_TEST_SNAPSHOT_STORE`` (``s3://...``, with ``VOLLEY_TEST_S3_ENDPOINT``,
``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY``) keeps the snapshots on S3 too;
``VOLLEY_TEST_BACKOFF`` (``first_s,max_s,retries_in_run``) scales the recovery
backoff, unset: the shipped defaults. ``VOLLEY_TEST_SPARK_MASTER`` (a standalone
master's URL, with ``VOLLEY_TEST_SPARK_CONFIG``, JSON ``spark.*`` keys such as the
driver's address) runs every run on that cluster instead. ``VOLLEY_TEST_CHAIN`` serves
the refunds join over ``streams/`` and the refunds per merchant per hour fed by its
Iceberg table instead of the payments pipeline; ``VOLLEY_TEST_CHAIN=one``, the same
flow as one pipeline of both operators (``hourly_refunds``)."""

import json
import os
from dataclasses import replace
from pathlib import Path

from dagster import in_process_executor

from volley_dagster.dagster.location import build_definitions
from volley_dagster.dagster.resources import CheckpointResource, S3Resource, SparkResource, TablesResource
from volley_dagster.demo.merchant_refunds import hourly_refunds_pipeline, merchant_refunds_deployment
from volley_dagster.demo.payments import demo_deployment, payments_deployment
from volley_dagster.demo.refunds import refunds_deployment
from volley_dagster.recovery import Backoff

BASE = Path(os.environ["VOLLEY_TEST_BASE"])
SENSOR = bool(os.environ.get("VOLLEY_TEST_SENSOR"))
WARM = bool(os.environ.get("VOLLEY_TEST_WARM"))
MASTER = os.environ.get("VOLLEY_TEST_SPARK_MASTER")

CHAIN = os.environ.get("VOLLEY_TEST_CHAIN", "")
if CHAIN == "one":  # the same flow as one pipeline of two stateful operators
    deployments = [demo_deployment("hourly_refunds", lambda t: hourly_refunds_pipeline(BASE / "streams", t))]
elif CHAIN:
    deployments = [refunds_deployment(BASE / "streams"), merchant_refunds_deployment()]
else:
    deployments = [payments_deployment(BASE / "events")]
deployments = [replace(d, sensor_running=SENSOR) for d in deployments]
if SENSOR:
    deployments = [replace(d, min_records=1, max_wait_s=None, sensor_interval_s=2) for d in deployments]
if os.environ.get("VOLLEY_TEST_BACKOFF"):
    first_s, max_s, retries_in_run = os.environ["VOLLEY_TEST_BACKOFF"].split(",")
    backoff = Backoff(float(first_s), float(max_s), retries_in_run=int(retries_in_run))
    deployments = [replace(d, backoff=backoff) for d in deployments]
STORE = os.environ.get("VOLLEY_TEST_SNAPSHOT_STORE")
S3 = S3Resource(endpoint_url=os.environ["VOLLEY_TEST_S3_ENDPOINT"], access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
                secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"]) if STORE else None

if MASTER:
    SPARK = SparkResource(master=MASTER, spark_config=json.loads(os.environ.get("VOLLEY_TEST_SPARK_CONFIG", "{}")))
else:
    SPARK = SparkResource() if WARM else SparkResource(master="local[2]")

defs = build_definitions(
    deployments,
    checkpoints=CheckpointResource(root=str(BASE / "state"), max_records_per_epoch=1_500, snapshot_store_uri=STORE,
                                   s3=S3),
    tables=TablesResource(warehouse=str(BASE / "tables")),
    spark=SPARK,
    executor=in_process_executor,  # as definitions.py
)
