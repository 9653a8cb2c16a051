"""Property: windows (tumbling, sliding or session) with a watermark delay, allowed
lateness and (or not) a ``max_event_time_skew``, run through the engine over a random
stream cut at random (``streams.py``), equal ``reference_epochs`` of ``tests/window_reference.py`` on the
same epochs: the windows each epoch fires, its late records and dead letters (by file
and offset), its watermark, the windows still open at the end (``read_state()``),
and the Delta append table (every fired window once). An epoch that crashes is run
again by a new runner, to the same result."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from tests.properties.streams import (
    DEEP,
    EXAMPLES,
    SKEW,
    delta_sink,
    materialise,
    one_commit_each,
    plans,
    profile,
    run_plan,
    start_us,
    streams,
)
from tests.window_reference import reference_epochs, window_pipeline, window_rows
from volley_dagster import EpochRunner, session, sliding, tumbling
from volley_dagster.operators.event_time import duration_us
from volley_dagster.operators.window import Windows
from volley_dagster.sinks.delta import DeltaSink

# Sliding windows that the slide divides and one it does not; sessions of a gap shorter
# and longer than the stream's usual step (0-4 s), shorter than its disorder (20 s).
WINDOWS: dict[str, list[Windows]] = {
    "tumbling": [tumbling("10 seconds"), tumbling("30 seconds")],
    "sliding": [sliding("20 seconds", "10 seconds"), sliding("25 seconds", "10 seconds")],
    "session": [session("3 seconds"), session("10 seconds")],
}


@pytest.mark.parametrize("kind", [None] if DEEP else sorted(WINDOWS), ids=lambda kind: kind or "drawn")
@profile(default_examples=2)
@given(data=st.data())
def test_windows_equal_the_reference(spark, tmp_path_factory, kind, data):
    """The default lane runs each kind (its few derandomized examples would mostly draw
    the first); the deep lane draws the kind with the rest of each example."""
    EXAMPLES["windows"] += 1
    stream = data.draw(streams(data.draw(st.sampled_from(["int", "str"]), label="keys")), label="stream")
    plan = data.draw(plans(len(stream.records)), label="plan")
    kind = kind or data.draw(st.sampled_from(sorted(WINDOWS)), label="kind")
    event(f"windows: {kind}")
    windows = data.draw(st.sampled_from(WINDOWS[kind]), label="windows")
    delay, lateness, skew = (data.draw(st.sampled_from(options), label=name) for name, options in (
        ("delay", ["0 seconds", "5 seconds"]),
        ("lateness", ["0 seconds", "3 seconds"]), ("skew", [SKEW, None])))
    base = tmp_path_factory.mktemp("windows")
    log = materialise(stream, start_us())

    def make_runner() -> EpochRunner:
        pipeline = window_pipeline(base / "events", base / "out", windows, delay=delay, lateness=lateness,
                                   skew=skew)
        pipeline = pipeline.sink(DeltaSink(base / "delta", mode="append")).on_bad_records("dead_letter")
        return EpochRunner(pipeline, base / "state", spark=spark)

    runner, epochs = run_plan(make_runner, base / "events", log, plan, base / "delta")
    skew_us = None if skew is None else duration_us(skew, "skew")
    ref = reference_epochs([e.records for e in epochs], windows, duration_us(delay, "delay"),
                           duration_us(lateness, "lateness"), end_of_stream=False,
                           bounds=[None if skew_us is None else e.cut_at_us + skew_us for e in epochs])
    fired: Counter[tuple] = Counter()
    for e in epochs:
        n = e.result.epoch
        assert e.result.records_in == e.records.num_rows
        got = window_rows(e.result.output)
        assert len(got) == e.result.records_out, f"epoch {n}: a window fired twice in one epoch"
        assert got == ref.fired[n], f"epoch {n}: fired windows"
        assert e.late == ref.late[n], f"epoch {n}: late records"
        assert e.result.late_records == len(ref.late[n])
        assert e.dead == ref.dead[n], f"epoch {n}: dead letters"
        assert e.result.dead_letters == len(ref.dead[n])
        assert e.result.watermark == ref.watermark[n], f"epoch {n}: watermark"
        fired.update(got)
    assert window_rows(runner.read_state()) == ref.open
    table = delta_sink(runner).read()
    assert table.num_rows == sum(fired.values()) and window_rows(table) == set(fired)
    assert max(fired.values(), default=1) == 1, "a window was emitted twice"
    one_commit_each(runner, epochs)
