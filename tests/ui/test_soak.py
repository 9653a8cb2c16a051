"""Issue 76, point 6, in the deep lane: three minutes of the soak (``harness/soak.py``):
the demo's three pipelines under a real ``dagster dev`` with a random fault every 20-40
seconds (a run worker, the daemon or the whole ``dagster dev`` killed with ``kill -9``,
the warm Spark's workers killed, S3 down, a run cancelled), nobody acting. Every table
must then equal the oracle's, and no run may have been launched by a person.
``./dev bench soak --minutes 60`` is the hour."""

from __future__ import annotations

import pytest

from harness.soak import run_soak


@pytest.mark.deep
def test_three_minutes_of_random_faults_heal_to_the_oracle(tmp_path):
    report = run_soak(tmp_path / "soak", minutes=3, seed=7, land_every_s=4, fault_every_s=(20, 40),
                      outage_s=(10, 30), heal_within_s=600)
    assert sum(report.faults.values()) >= 3, report.describe()
    assert report.human_actions == 0 and report.runs.get("SUCCESS", 0) > 0, report.describe()
    assert all(v.passed for v in report.verdicts), report.describe()
    assert {v.pipeline for v in report.verdicts} == {"payments", "merchant_minutes", "refunds"}
