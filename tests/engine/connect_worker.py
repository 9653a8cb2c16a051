"""Runs epochs over Spark Connect in its own process (PySpark switches a whole
process into Connect mode): ``python -m tests.engine.connect_worker URL BASE [SESSION_ID]``
(with a session id: attached to that server-side session, as Dagster runs on the warm Spark are).
Prints one JSON line: records per epoch, the error a task-side failure raised, an
enriched epoch's join counts, and each epoch's watermark and late records of a window
pipeline over ``BASE/events-w`` (its latest event time observed in the side-output job)."""

import json
import sys
from pathlib import Path

from deltalake import write_deltalake

from tests.helpers import enriched_payments, merchants_table, payments
from tests.window_reference import window_pipeline
from volley_dagster import EpochRunner, VolleyError, tumbling
from volley_dagster.attempt import EpochAttempt
from volley_dagster.demo.events import generate
from volley_dagster.settings import RunSettings
from volley_dagster.spark.stage import run_stage
from volley_dagster.spark.warm import warm_session

if __name__ == "__main__":
    url, base = sys.argv[1], Path(sys.argv[2])
    spark = warm_session(url, sys.argv[3] if len(sys.argv) > 3 else None)
    runner = EpochRunner(payments(base / "events", base / "out"), base / "state", RunSettings(max_records_per_epoch=2_000), spark=spark)
    records = [r.records_in for r in runner.run_available()]
    # an enrichment over Connect: its counts come back with the epoch's job (a Spark Observation)
    write_deltalake(base / "merchants", merchants_table(200, 0))
    enriched = EpochRunner(enriched_payments(base / "events", base / "out-enriched"), base / "state-enriched", RunSettings(max_records_per_epoch=2_000), spark=spark).run_available(max_epochs=1)
    windows = EpochRunner(window_pipeline(base / "events-w", base / "out-w", tumbling("10 seconds"), delay="5 seconds",
                                          lateness="0 seconds"), base / "state-w", RunSettings(max_records_per_epoch=300), spark=spark).run_available()
    generate(base / "events", 1, 500, 200, first_file=2)
    rng = runner.cut_next()
    assert rng is not None
    path = base / "events" / "events-000002.parquet"
    with runner.lease() as lease:
        start = runner.log.start_of(rng.epoch, {})
        plan, merge = EpochAttempt(spark, runner.pipeline, rng, start, runner.log, runner.settings, lease).plan()
        path.write_bytes(path.read_bytes() + b"x")  # rewritten after the driver's checks
        try:
            run_stage(spark, runner.pipeline, rng, plan, merge)
            error = None
        except VolleyError as exc:
            error = f"{type(exc).__name__}: {exc}"
    print(json.dumps({"records": records, "error": error, "enriched": enriched[0].enrichments["merchants"].to_dict(),
                      "windows": [{"epoch": r.epoch, "watermark": r.watermark, "late": r.late_records} for r in windows]}))
