"""An S3 outage longer than the old retry budget (4 runs), under the real ``dagster dev``: the
snapshot store is down while files keep landing, then comes back. Nobody acts; the
pipeline resumes within one backoff step of S3 answering again, and the tables hold
every record once. The backoff is scaled down (0.5 s doubling to 4 s, no retries
inside a run) so that the test stays short; ``bench/outage.py`` runs the same
scenario with the shipped defaults and a 10-minute outage."""

from __future__ import annotations

import pytest

from harness.outage import KEYS, PER_FILE, run_outage, runner_for
from tests.helpers import assert_state_equal, log_records, reference_state
from volley_dagster.verify import check_sink

MAX_S = 4.0
OLD_BUDGET_RUNS = 4  # what recovery allowed before the backoff: a first run and 3 re-requests, then a person
RUN_S = 30.0  # a run's launch and its epochs on the warm Spark, with margin for a loaded machine


# deep: 2-3 min; the default lane covers its parts: an S3 outage failing the epoch and a re-run resuming
# (tests/engine/test_s3_checkpoints.py), transient failures requested again until the epoch commits
# (tests/dagster/test_recovery.py), and kill -9 healing under dagster dev (tests/ui/test_self_healing.py)
@pytest.mark.deep
def test_an_s3_outage_longer_than_the_old_budget_heals_without_anyone(tmp_path):
    report = run_outage(tmp_path, land_every_s=12.0, backoff=f"0.5,{MAX_S},0", until_failed_runs=OLD_BUDGET_RUNS + 1,
                        max_outage_s=240, heal_within_s=240)
    print(report.describe())
    assert report.failed_runs > OLD_BUDGET_RUNS  # the old recovery had stopped for good after its fourth
    assert report.first_commit_after_s <= MAX_S + RUN_S  # within one backoff step, plus the run itself
    runner = runner_for(tmp_path)
    records = log_records(report.files, PER_FILE, KEYS)
    assert sum(runner.result(e).records_in for e in range(1, runner.committed_epoch() + 1)) == records.num_rows
    expected = reference_state(records)[["merchant_id", "total", "events", "avg_amount", "largest", "last_seen"]]
    assert_state_equal(runner.read_state(), expected)
    delta, iceberg = runner.pipeline.sinks
    assert_state_equal(delta.read().select(list(expected.columns)), expected)
    for sink in (delta, iceberg):  # each epoch once: no duplicate after all those failed runs
        outcomes = check_sink(runner, sink)
        assert all(o.passed for o in outcomes), [(o.name, o.description) for o in outcomes]
