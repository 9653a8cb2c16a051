"""Property: two chains of stateful operators in one pipeline (``volley_dagster/chain.py``),
run through the engine over random streams cut at random into epochs, one epoch crashed
(in either stage: after the first stage's snapshots, after the last stage's Delta commit,
or after the first stage's sinks) and run again by a new runner, equal the references
composed, epoch by epoch:

- windows (tumbling, sliding or session, with a delay and lateness) then, per key, the
  busiest window and how many fired: ``tests/window_reference.py``'s fired windows, each
  epoch's folded into a running maximum and count;
- the interval join (any ``how``, a random interval) then, per key, how many rows it
  emitted and the right side's sum: ``tests/join_reference.py``'s rows, summed.

The first stage's late records and dead letters are its figures in the epoch's
manifest (``stage1_*``), and the Delta table holds each epoch once."""

from __future__ import annotations

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from tests.join_reference import JoinReference
from tests.properties.streams import (
    EXAMPLES,
    materialise,
    one_commit_each,
    plans,
    profile,
    run_plan,
    start_us,
    streams,
)
from tests.properties.test_join_model import draw_case, run_case
from tests.properties.test_window_model import WINDOWS
from tests.window_reference import KEY, reference_epochs, window_pipeline
from volley_dagster import EpochRunner, FileLog, Pipeline, count, max_, sum_
from volley_dagster.operators.event_time import duration_us
from volley_dagster.sinks.delta import DeltaSink


@pytest.mark.parametrize("kind", ["tumbling", "session"])
@profile(default_examples=1)
@given(data=st.data())
def test_windows_then_each_keys_busiest_window_equal_the_references_composed(spark, tmp_path_factory, kind, data):
    EXAMPLES["chain windows"] += 1
    stream = data.draw(streams(data.draw(st.sampled_from(["int", "str"]), label="keys")), label="stream")
    plan = data.draw(plans(len(stream.records)), label="plan")
    windows = data.draw(st.sampled_from(WINDOWS[kind]), label="windows")
    delay, lateness = (data.draw(st.sampled_from(options), label=name) for name, options in (
        ("delay", ["0 seconds", "5 seconds"]), ("lateness", ["0 seconds", "3 seconds"])))
    base = tmp_path_factory.mktemp("chain_windows")
    log = materialise(stream, start_us())

    def make_runner() -> EpochRunner:
        pipeline = (window_pipeline(base / "events", base / "out", windows, delay=delay, lateness=lateness,
                                    parquet=False)
                    .key_by(KEY).aggregate(busiest=max_("events"), fired=count())
                    .sink(DeltaSink(base / "delta", mode="append")).on_bad_records("dead_letter").with_shards(3))
        return EpochRunner(pipeline, base / "state", spark=spark)

    runner, epochs = run_plan(make_runner, base / "events", log, plan, base / "delta")
    ref = reference_epochs([e.records for e in epochs], windows, duration_us(delay, "delay"),
                           duration_us(lateness, "lateness"), end_of_stream=False)
    totals: dict[object, tuple[int, int]] = {}
    for e in epochs:
        n = e.result.epoch
        assert e.result.records_in == e.records.num_rows
        touched = {}
        for row in ref.fired[n]:
            key, events = row[0], row[3]
            busiest, fired = totals.get(key, (0, 0))
            totals[key] = touched[key] = (max(busiest, events), fired + 1)
        got = {r[KEY]: (r["busiest"], r["fired"]) for r in e.result.output.to_pylist()}
        assert got == touched, f"epoch {n}"
        assert e.result.figures["stage1_records_out"] == len(ref.fired[n])
        assert e.result.figures["stage1_late_records"] == len(ref.late[n]), f"epoch {n}: late records"
        assert e.result.figures["stage1_dead_letters"] == len(ref.dead[n]), f"epoch {n}: dead letters"
        assert e.result.figures.get("stage1_watermark") == ref.watermark[n]
    state = {r[KEY]: (r["busiest"], r["fired"]) for r in runner.read_state().to_pylist()}
    assert state == totals
    one_commit_each(runner, epochs)
    if totals:
        event("windows fired")


@profile(default_examples=2)
@given(data=st.data())
def test_the_join_then_each_keys_rows_and_sum_equal_the_references_composed(spark, tmp_path_factory, data):
    EXAMPLES["chain join"] += 1
    case = draw_case(data)
    base, start = tmp_path_factory.mktemp("chain_join"), start_us()

    def make_runner() -> EpochRunner:
        pipeline = (case.join(Pipeline("join").sources({"left": FileLog(base / "left"),
                                                          "right": FileLog(base / "right")}))
                    .with_shards(2)
                    .key_by("k").aggregate(rows=count(), right_sum=sum_("rv"))
                    .sink(DeltaSink(base / "delta", name="delta", mode="append")).on_bad_records("dead_letter")
                    .with_shards(3))
        return EpochRunner(pipeline, base / "state", spark=spark)

    reference = JoinReference(case.lower, case.upper, case.how, case.delay)
    totals: dict[object, tuple[int, float | None]] = {}
    for number, (records, result) in enumerate(run_case(case, base, start, make_runner), start=1):
        valid = case.valid(records, start)
        pairs, outer, late = reference.run(valid)
        touched = {}
        for key, _left, right in pairs | outer:
            rows, right_sum = totals.get(key, (0, None))
            right_sum = right_sum if right is None else (right if right_sum is None else right_sum + right)
            totals[key] = touched[key] = (rows + 1, right_sum)
        got = {r["k"]: (r["rows"], r["right_sum"]) for r in result.output.to_pylist()}
        assert got == touched, f"epoch {number}"
        assert result.figures["stage1_records_out"] == len(pairs | outer)
        assert result.figures["stage1_late_records"] == len(late)
        assert result.figures["stage1_dead_letters"] == len(records) - len(valid)
        assert result.figures.get("stage1_watermark") == reference.watermark
    history = DeltaSink(base / "delta", name="delta").epoch_history("join")
    assert sorted(history) == list(range(1, len(case.epochs) + 1))  # each epoch committed once, the crashed one too
