"""Runs a pipeline to the end in its own process, for kill -9 tests:
``python -m tests.engine.crash_worker BASE MAX_RECORDS KEEP [payments|payments_json|payments_enriched|windows|ttl|dedup|unique|payments_kafka]``
(``payments_kafka`` reads the topic ``VOLLEY_TEST_KAFKA_TOPIC`` at ``VOLLEY_TEST_KAFKA``)."""

import os
import sys
from functools import partial
from pathlib import Path

from tests.dedup_reference import dedup_pipeline, unique_pipeline
from tests.helpers import enriched_payments, payments, payments_on_kafka
from tests.ttl_reference import ttl_pipeline
from tests.window_reference import crash_window_pipeline
from volley_dagster import EpochRunner
from volley_dagster.spark.session import get_or_create_spark

if __name__ == "__main__":
    base, max_records, keep = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    kind = sys.argv[4] if len(sys.argv) > 4 else "payments"
    build = {"payments": payments, "payments_enriched": enriched_payments, "payments_json": partial(payments, fmt="json"), "windows": crash_window_pipeline,
             "ttl": ttl_pipeline, "dedup": dedup_pipeline, "unique": unique_pipeline,
             "payments_kafka": partial(payments_on_kafka, bootstrap_servers=os.environ.get("VOLLEY_TEST_KAFKA", ""),
                                       topic=os.environ.get("VOLLEY_TEST_KAFKA_TOPIC", ""))}[kind]
    spark = get_or_create_spark(master="local[2]", conf={"spark.sql.shuffle.partitions": "4"})
    runner = EpochRunner(build(base / "events", base / "out", tables=base / "tables"), base / "state", spark=spark,
                         max_records_per_epoch=max_records, keep_epochs=keep)
    for result in runner.run_available():
        print("committed", result.epoch, flush=True)
