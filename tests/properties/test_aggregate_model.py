"""Property: the running aggregate (count, sum_, min_, max_, first, last) without a TTL,
with one by epochs and with one on event time, run through the engine over a random
stream cut at random (``streams.py``), equals ``TtlReference`` applied record by record
to the same epochs: each epoch's output rows, dead letters and expired keys, the
watermark, and at the end ``read_state()`` and the Delta upsert table. An epoch that
crashes is run again by a new runner, to the same result. Without a TTL the result
must not depend on the cuts: a second cut of the same stream ends with equal tables."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.properties.streams import (
    EXAMPLES,
    SKEW,
    Epoch,
    by_key,
    delta_sink,
    materialise,
    one_commit_each,
    plans,
    profile,
    run_plan,
    start_us,
    streams,
    where,
)
from tests.ttl_reference import VALUES, TtlReference, same_values, ttl_pipeline
from volley_dagster import EpochRunner
from volley_dagster.operators.event_time import duration_us
from volley_dagster.sinks.delta import DeltaSink


def check_epochs(epochs: list[Epoch], reference: TtlReference, columns: list[str], skew_us: int | None) -> None:
    for e in epochs:
        bound = None if skew_us is None else e.cut_at_us + skew_us
        expected = reference.run_rows(e.records, bound)
        assert e.result.records_in == e.records.num_rows
        same_values(e.result.output, expected, columns)
        dead = reference.dead_letters[-1]
        assert e.dead == set(where(e.records, dead)), f"epoch {e.result.epoch}: dead letters"
        assert e.result.dead_letters == len(dead)
        assert e.result.figures.get("keys_expired", 0) == sum(bool(row["expired"]) for row in expected.values())
        if reference.ttl_us is not None:
            assert e.result.watermark == reference.watermark, f"epoch {e.result.epoch}: watermark"


@pytest.mark.parametrize("ttl", ["none", "epochs", "event_time"])
@profile(default_examples=2)
@given(data=st.data())
def test_running_aggregate_equals_the_reference(spark, tmp_path_factory, ttl, data):
    EXAMPLES[f"aggregate[{ttl}]"] += 1
    stream = data.draw(streams(data.draw(st.sampled_from(["int", "str"]), label="keys")), label="stream")
    plan = data.draw(plans(len(stream.records)), label="plan")
    ttl_epochs = data.draw(st.integers(1, 3), label="ttl_epochs") if ttl == "epochs" else None
    on_time = data.draw(st.fixed_dictionaries({
        "ttl": st.sampled_from(["30 seconds", "2 minutes"]), "delay": st.sampled_from(["0 seconds", "5 seconds"]),
        "skew": st.sampled_from([SKEW, None])}), label="event_time") if ttl == "event_time" else None
    max_expiry_entries = data.draw(st.sampled_from([100_000, 1]), label="max_expiry_entries")
    log = materialise(stream, start_us())

    def run(base, plan):
        def make_runner() -> EpochRunner:
            pipeline = ttl_pipeline(base / "events", None, ttl_epochs=ttl_epochs, every_value=True, name="aggregate",
                                    ttl=on_time and on_time["ttl"], delay=on_time["delay"] if on_time else "0 seconds",
                                    skew=on_time and on_time["skew"], max_expiry_entries=max_expiry_entries)
            return EpochRunner(pipeline.sink(DeltaSink(base / "delta", mode="upsert")).on_bad_records("dead_letter"),
                               base / "state", spark=spark)
        return run_plan(make_runner, base / "events", log, plan, base / "delta")

    runner, epochs = run(tmp_path_factory.mktemp("aggregate"), plan)
    reference = TtlReference(ttl_epochs=ttl_epochs, ttl_us=on_time and duration_us(on_time["ttl"], "ttl"),
                             delay_us=duration_us(on_time["delay"], "delay") if on_time else 0)
    skew_us = duration_us(on_time["skew"], "skew") if on_time and on_time["skew"] else None
    check_epochs(epochs, reference, VALUES + ([] if ttl == "none" else ["expired"]), skew_us)
    state, table = runner.read_state(), delta_sink(runner).read()
    same_values(state, reference.state, VALUES)
    same_values(table, reference.state, VALUES)
    one_commit_each(runner, epochs)
    if ttl == "none":  # another cut of the same stream ends the same
        again, _ = run(tmp_path_factory.mktemp("aggregate"), data.draw(plans(len(stream.records), crash=False),
                                                                        label="second plan"))
        same_values(again.read_state(), by_key(state), VALUES)
        same_values(delta_sink(again).read(), by_key(table), VALUES)
