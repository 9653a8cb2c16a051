"""Runs a pipeline to the end in its own process, for kill -9 tests:
``python -m tests.engine.crash_worker BASE MAX_RECORDS KEEP [payments|payments_json|payments_enriched|channels|refunds|windows|windows_delta|ttl|dedup|unique|velocity|minute_totals|hourly_refunds|payments_kafka]``
(``minute_totals`` reads the Delta table ``BASE/tables/delta/merchant_minutes``)
(``payments_kafka`` reads the topic ``VOLLEY_TEST_KAFKA_TOPIC`` at ``VOLLEY_TEST_KAFKA``;
``VOLLEY_TEST_LEASE_TTL`` sets the runner's lease ttl in seconds).

``python -m tests.engine.crash_worker --spare`` starts Spark first, prints ``ready``,
then reads one JSON line ``{"args": [...], "env": {...}}`` from stdin and runs as
above with that environment (given to Spark's Python workers too): a test takes a
spare whose Spark is already up (``SpareCrashWorkers``), and it dies as any worker."""

import json
import os
import sys
from functools import partial
from pathlib import Path

from tests.dedup_reference import dedup_pipeline, unique_pipeline
from tests.helpers import (
    channels,
    enriched_payments,
    minute_totals,
    payments,
    payments_on_kafka,
    velocity_pipeline,
)
from tests.ttl_reference import ttl_pipeline
from tests.window_reference import crash_window_pipeline, staged_window_pipeline
from volley_dagster import EpochRunner
from volley_dagster.demo.merchant_refunds import hourly_refunds_pipeline
from volley_dagster.demo.payments import local_tables
from volley_dagster.demo.refunds import refunds_pipeline
from volley_dagster.settings import RunSettings
from volley_dagster.spark.session import get_or_create_spark


def main(argv: list[str]) -> int:
    spark = get_or_create_spark(master="local[2]", conf={"spark.sql.shuffle.partitions": "4"})
    if argv[:1] == ["--spare"]:
        print("ready", flush=True)
        line = sys.stdin.readline()
        if not line:
            return 0  # the test session ended without needing this spare
        request = json.loads(line)
        os.environ.update(request["env"])
        spark.sparkContext.environment.update(request["env"])  # the Python workers' environment
        argv = request["args"]
    base, max_records, keep = Path(argv[0]), int(argv[1]), int(argv[2])
    kind = argv[3] if len(argv) > 3 else "payments"
    build = {"payments": payments, "payments_enriched": enriched_payments, "payments_json": partial(payments, fmt="json"), "windows": crash_window_pipeline,
             "windows_delta": staged_window_pipeline,
             "channels": lambda events, out, tables: channels(events.parent),
             "refunds": lambda events, out, tables: refunds_pipeline(events, local_tables(tables)), "ttl": ttl_pipeline, "dedup": dedup_pipeline, "unique": unique_pipeline,
             "velocity": lambda events, out, tables: velocity_pipeline(events, tables=tables),
             "minute_totals": lambda events, out, tables: minute_totals(tables / "delta" / "merchant_minutes", out),
             "hourly_refunds": lambda events, out, tables: hourly_refunds_pipeline(events, local_tables(tables)),
             "payments_kafka": partial(payments_on_kafka, bootstrap_servers=os.environ.get("VOLLEY_TEST_KAFKA", ""),
                                       topic=os.environ.get("VOLLEY_TEST_KAFKA_TOPIC", ""))}[kind]
    ttl = {"lease_ttl_s": float(os.environ["VOLLEY_TEST_LEASE_TTL"])} if os.environ.get("VOLLEY_TEST_LEASE_TTL") else {}
    settings = RunSettings(max_records_per_epoch=max_records, keep_epochs=keep, **ttl)
    runner = EpochRunner(build(base / "events", base / "out", tables=base / "tables"), base / "state", settings, spark=spark)
    for result in runner.run_available():
        print("committed", result.epoch, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
