"""The recovery rules (``volley_dagster/recovery.py``) on their own: no Spark, no Dagster."""

from __future__ import annotations

import pytest

from volley_dagster.recovery import Backoff, FailedRun, decide

BACKOFF = Backoff(first_s=10.0, max_s=300.0, alert_after=5)


def failures(n: int, ended_at: float = 1_000.0, permanent: str | None = None) -> list[FailedRun]:
    newest = FailedRun("run-0", ended_at, permanent)
    return [newest] + [FailedRun(f"run-{i}", ended_at - 60 * i) for i in range(1, n)]


def test_delays_double_up_to_the_cap_with_a_jitter_that_every_evaluation_agrees_on():
    for k in range(1, 40):
        step = min(300.0, 10.0 * 2 ** (k - 1))
        delay = BACKOFF.delay_s(k, salt="payments")
        assert 0.5 * step <= delay <= step
        assert delay == BACKOFF.delay_s(k, salt="payments")  # the same on every tick, sensor or schedule
    assert BACKOFF.delay_s(0) == 0.0
    spread = {round(BACKOFF.delay_s(3, salt=f"pipeline-{i}"), 6) for i in range(20)}
    assert len(spread) > 10  # pipelines that failed together do not retry together
    assert BACKOFF.delay_s(10_000) <= 300.0  # no overflow, however long the outage


def test_no_failure_since_the_last_commit_requests_at_once():
    decision = decide([], now=0.0, backoff=BACKOFF, first_epoch=7, last_epoch=9)
    assert decision.request and not decision.stopped and not decision.alert and decision.failures == 0


def test_a_transient_failure_waits_its_backoff_then_requests_and_never_gives_up():
    for n in (1, 2, 6, 500):
        due = 1_000.0 + BACKOFF.delay_s(n, "p")
        waiting = decide(failures(n), now=due - 0.01, backoff=BACKOFF, first_epoch=3, last_epoch=4, salt="p")
        assert not waiting.request and not waiting.stopped and waiting.next_at == pytest.approx(due)
        assert "backing off, next request of epochs 3..4" in waiting.reason
        ready = decide(failures(n), now=due, backoff=BACKOFF, first_epoch=3, last_epoch=4, salt="p")
        assert ready.request and ready.failures == n
        assert ready.alert == (n >= BACKOFF.alert_after)  # red from alert_after on, retries go on


def test_a_permanent_failure_stops_and_says_what_to_do():
    decision = decide(failures(2, permanent="StateLayoutError: written by another pipeline"), now=1e9,
                      backoff=BACKOFF, first_epoch=3, last_epoch=5)
    assert decision.stopped and not decision.request and decision.alert and decision.next_at is None
    assert "failed permanently in run run-0: StateLayoutError" in decision.reason
    assert "launch a backfill of epochs 3..5" in decision.reason
    # only the newest run decides: a later transient failure puts the pipeline back on backoff
    again = [FailedRun("run-new", 2_000.0)] + failures(2, permanent="StateLayoutError")
    assert not decide(again, now=2_000.0, backoff=BACKOFF, first_epoch=3, last_epoch=5).stopped


def test_bad_settings_are_refused_naming_them():
    with pytest.raises(ValueError, match="first_s <= max_s"):
        Backoff(first_s=10, max_s=5)
    with pytest.raises(ValueError, match="alert_after"):
        Backoff(alert_after=0)
