"""How ``Pipeline``'s builder makes a chain of stateful operators (``volley_dagster/chain.py``),
without Spark: a step after a stateful operator starts the next stage, which reads its
output; what a stage after another cannot read is refused by name; each stage is
handed the watermark of the one before, less how far its rows may trail it; stateless
steps written after the last operator keep their old meaning."""

from __future__ import annotations

import warnings

import pytest

from volley_dagster import FileLog, ParquetSink, Pipeline, count, max_, session, sliding, sum_, tumbling
from volley_dagster.errors import ConfigError
from volley_dagster.operators.event_time import EventTime, duration_us

MINUTE = duration_us("1 minute", "minute")


def _joined(tmp_path) -> Pipeline:
    return (Pipeline("chain").sources({"orders": FileLog(tmp_path / "o"), "payments": FileLog(tmp_path / "p")})
            .join(left="orders", right="payments", on="order_id", left_time="ordered_at", right_time="paid_at",
                  between=("-5 minutes", "+20 minutes")))


def test_a_step_after_a_stateful_operator_starts_the_next_stage_and_the_sinks_take_the_last(tmp_path):
    sink = ParquetSink(tmp_path / "out")
    pipeline = (_joined(tmp_path).with_shards(3)
                .where("amount > 0").key_by("merchant_id").window(tumbling("1 hour"), on="paid_at")
                .aggregate(orders=count(), paid=sum_("amount"))
                .key_by("merchant_id").aggregate(busiest=max_("orders"))
                .sink(sink).with_shards(2))
    first, second, third = pipeline.stages()
    assert (first.operator_name, second.operator_name, third.operator_name) == (
        "join(...)", "window(...).aggregate(...)", "aggregate(...)")
    assert [s.layout.num_shards for s in (first, second, third)] == [3, 3, 2]  # a stage starts with the one before's
    assert [s.sinks for s in pipeline.stages()] == [(), (), (sink,)]
    assert len(second.transforms) == 1 and not first.transforms  # the where reads the join's rows
    assert pipeline.source_log is first.source_given  # epochs are cut from the first stage's log
    pipeline.settled()
    # a window waits for its aggregate, a deduplication for the operator it feeds: same stage
    same = Pipeline("one").source(FileLog(tmp_path)).deduplicate(on="id", within="1 hour", event_time="ts") \
        .key_by("k").window(tumbling("1 minute"), on="ts").aggregate(n=count())
    assert len(same.stages()) == 1


def test_what_a_later_stage_cannot_read_is_refused_by_name(tmp_path):
    log = FileLog(tmp_path)
    totals = Pipeline("totals").source(log).key_by("k").aggregate(n=count())
    with pytest.raises(ConfigError, match=r"stage 2, reads the output of aggregate\(\.\.\.\), which updates"):
        totals.key_by("k").window(tumbling("1 minute"), on="ts").aggregate(m=count()).settled()
    with pytest.raises(ConfigError, match=r"join\(\.\.\.\) after deduplicate\(\.\.\.\) reads that operator's rows, "
                                          "one stream: give sides_from="):
        Pipeline("d").source(log).deduplicate(on="id", within="1 hour", event_time="ts").join(
            left="orders", right="payments", on="order_id", left_time="ordered_at", right_time="paid_at",
            between=("0 seconds", "1 minute"))
    with pytest.raises(ConfigError, match=r"join\(sides_from='source'\) is for a chain's later stage"):
        Pipeline("d").sources({"orders": FileLog(tmp_path / "o"), "payments": log}).join(
            left="orders", right="payments", on="order_id", left_time="ordered_at", right_time="paid_at",
            between=("0 seconds", "1 minute"), sides_from="source")
    sessions = Pipeline("s").source(log).key_by("k").window(session("5 minutes"), on="ts").aggregate(n=count())
    with pytest.raises(ConfigError, match="only 'window_end' can carry the watermark on"):
        sessions.key_by("k").window(tumbling("1 hour"), on="window_start").aggregate(m=max_("n")).settled()
    sessions.key_by("k").window(tumbling("1 hour"), on="window_end").aggregate(m=max_("n")).settled()
    with pytest.raises(ConfigError, match=r"stage 2, is incomplete: add key_by"):
        sessions.where("n > 1").window(tumbling("1 hour"), on="window_end").aggregate(m=max_("n")).settled()
    # a stateful step called on a stage itself configures it, as it always did (a deploy changes accumulators)
    changed = sessions.aggregate(m=max_("n"))
    assert len(changed.stages()) == 1 and [name for name, _ in changed.operator.accumulators] == ["m"]


def test_each_stage_is_handed_the_watermark_before_less_how_far_its_rows_may_trail(tmp_path):
    joined = _joined(tmp_path)
    assert joined.handed_delay_us("paid_at") == 20 * MINUTE  # the interval's widest side
    windows = (Pipeline("w").source(FileLog(tmp_path)).key_by("k")
               .window(sliding("10 minutes", "5 minutes"), on="ts", allowed_lateness="2 minutes").aggregate(n=count()))
    assert windows.handed_delay_us("window_end") == 2 * MINUTE
    assert windows.handed_delay_us("window_start") == 12 * MINUTE
    later = windows.key_by("k").window(tumbling("1 hour"), on="window_end", max_out_of_orderness="1 minute") \
        .aggregate(m=max_("n"))
    clock = later.with_watermark_handed(100 * MINUTE).clock
    assert isinstance(clock, EventTime) and clock.handed
    # the epoch's own event times do not move it; the stage's own slack comes off what it is handed
    assert clock.advance(None, 500 * MINUTE) == 99 * MINUTE
    assert clock.advance(120 * MINUTE, None) == 120 * MINUTE  # never back
    assert later.with_watermark_handed(None).clock.advance(7, 500 * MINUTE) == 7  # nothing handed yet: it stays
    assert later.layout == later.with_watermark_handed(5).layout  # not part of what the root records


def test_stateless_steps_after_the_last_operator_still_apply_before_it(tmp_path):
    """As before chains: a deploy derives a changed pipeline with ``pipeline.with_column(...)``."""
    sink = ParquetSink(tmp_path / "out")
    built = Pipeline("p").source(FileLog(tmp_path)).aggregate(n=count()).sink(sink).where("k > 0").key_by("k")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        settled = built.settled()
    assert settled.upstream is None and len(settled.transforms) == 1 and settled.operator_given is not None
    assert settled.key_given == "k" and settled.sinks == (sink,) and built.sinks == (sink,)  # Dagster sees them


def test_a_sink_given_before_a_later_stage_is_refused_by_name(tmp_path):
    joined = _joined(tmp_path).sink(ParquetSink(tmp_path / "out"))
    with pytest.raises(ConfigError, match=r"sink 'parquet' is given before a later stateful operator"):
        joined.key_by("merchant_id").aggregate(n=count()).settled()
    joined.with_column("x", "1").settled()  # a transform alone after it: applied before the join, as always


def test_the_source_is_the_first_stages_wherever_it_is_given(tmp_path):
    a, b = FileLog(tmp_path / "a"), FileLog(tmp_path / "b")
    late = Pipeline("p").key_by("k").aggregate(n=count()).with_column("x", "1").source(a).settled()
    assert late.source_given is a and late.upstream is None
    chain = (Pipeline("c").source(a).key_by("k").window(tumbling("1 minute"), on="ts").aggregate(n=count())
             .key_by("k").aggregate(m=max_("n")).source(b))
    assert chain.stages()[0].source_given is b and chain.source_log is b and chain.stages()[1].source_given is None


def test_a_stage_keeps_its_s3_snapshots_in_a_folder_of_its_own():
    """Each stage's retention prunes what its own store holds: never another stage's."""
    from volley_dagster.chain import stage_settings
    from volley_dagster.checkpoint.s3_snapshots import S3SnapshotStore
    from volley_dagster.settings import RunSettings

    settings = RunSettings(snapshot_store=S3SnapshotStore("s3://bucket/snapshots/pipeline", max_workers=3))
    first, second = (stage_settings(settings, k).snapshot_store for k in (0, 1))
    assert first is not None and second is not None
    assert (first.uri, second.uri) == ("s3://bucket/snapshots/pipeline/stages/0", "s3://bucket/snapshots/pipeline/stages/1")
    assert first.max_workers == 3 and stage_settings(RunSettings(snapshot_store=None), 0).snapshot_store is None
