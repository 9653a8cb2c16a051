"""Property: ``deduplicate`` (on an int id, a string id, or an int id and a nullable
string column) before a running aggregate, run through the engine over a random
stream with re-sends, cut at random (``streams.py``), equals ``DedupReference`` of
``tests/dedup_reference.py`` on the same epochs: each epoch's output rows, duplicates
and late copies (counts, and which records by file, offset and reason), dead letters
and watermark; at the end ``read_state()``, the Delta upsert table and how many keys
were remembered. An epoch that crashes is run again by a new runner, to the same
result. Far-future records are dead letters (``max_event_time_skew``); the side-output
job runs only in an epoch that has some. Both ways the probe runs: with the duplicates
written out, in a job of its own; without, in the state stage's job, where the shard
tasks forget by the latest event time the probes tell them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.dedup_reference import DedupReference, dedup_pipeline
from tests.properties.streams import (
    EXAMPLES,
    ID,
    SKEW,
    SOURCE,
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
from tests.ttl_reference import same_values
from volley_dagster import EpochRunner
from volley_dagster.operators.event_time import duration_us
from volley_dagster.sinks.delta import DeltaSink

KEYS = {"int": (ID,), "str": (ID,), "two_columns": (ID, SOURCE)}


@pytest.mark.parametrize("write_duplicates", [True, False], ids=["probe_job", "probe_in_stage"])
@profile(default_examples=2)
@given(data=st.data())
def test_deduplication_equals_the_reference(spark, tmp_path_factory, write_duplicates, data):
    EXAMPLES["dedup"] += 1
    on = data.draw(st.sampled_from(sorted(KEYS)), label="on")
    within = data.draw(st.sampled_from(["30 seconds", "1 minute"]), label="within")
    within_us = duration_us(within, "within")
    stream = data.draw(streams("int", id_kind="str" if on == "str" else "int", new_amounts=True,
                               sources=on == "two_columns", null_ids=True), label="stream")
    plan = data.draw(plans(len(stream.records)), label="plan")
    base = tmp_path_factory.mktemp("dedup")
    log = materialise(stream, start_us())

    def make_runner() -> EpochRunner:
        pipeline = dedup_pipeline(base / "events", None, on=KEYS[on], within=within, skew=SKEW, name="dedup",
                                  write_duplicates=write_duplicates)
        return EpochRunner(pipeline.sink(DeltaSink(base / "delta", mode="upsert")).on_bad_records("dead_letter"),
                           base / "state", spark=spark)

    runner, epochs = run_plan(make_runner, base / "events", log, plan, base / "delta")
    reference = DedupReference(on=KEYS[on], within_us=within_us)
    skew_us = duration_us(SKEW, "skew")
    for e in epochs:
        n = e.result.epoch
        expected, dropped, late = reference.run_rows(e.records, e.cut_at_us + skew_us)
        assert e.result.records_in == e.records.num_rows
        same_values(e.result.output, expected, ["events", "total"])
        assert (e.result.figures["duplicates"], e.result.figures["dedup_late"]) == (len(dropped) - len(late), len(late))
        reasons = ["late" if row in late else "duplicate" for row in dropped]
        written = [(*at, why) for at, why in zip(where(e.records, dropped), reasons, strict=True)]
        assert e.duplicates == (written if write_duplicates else []), f"epoch {n}: the duplicates side output"
        dead = reference.dead_letters[-1]
        assert e.dead == set(where(e.records, dead)), f"epoch {n}: dead letters"
        assert e.result.dead_letters == len(dead)
        # the probe's job observed the watermark and the bad records: a job of its own
        # finds them only when there are some
        assert (e.result.durations["side_output"] > 0) == bool(dead), f"epoch {n}: side-output job"
        assert e.result.watermark == reference.watermark, f"epoch {n}: watermark"
        assert write_duplicates or e.result.durations["pre_step"] == 0, f"epoch {n}: a probe job of its own ran"
    ran = [e for e in epochs if e.records.num_rows]
    assert not write_duplicates or not ran or any(e.result.durations["pre_step"] > 0 for e in ran)
    same_values(runner.read_state(), reference.totals, ["events", "total"])
    same_values(delta_sink(runner).read(), reference.totals, ["events", "total"])
    figures = [s.operator.figures for e in epochs for s in e.result.shards.values()]
    assert sum(f.get("dedup_keys_remembered", 0) for f in figures) == reference.remembered_total
    one_commit_each(runner, epochs)
