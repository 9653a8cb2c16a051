"""Property: ``enrich`` (inner or left, on an int or a string key) with a Delta
dimension table, then the running aggregate into a Delta upsert table, run through the
engine over a random stream cut at random (``streams.py``), equals ``EnrichReference``
of ``tests/enrich_reference.py`` on the same epochs. The table holds one row per key
for some of the stream's keys (others missing, maybe a key the stream lacks and a row
with a null key; fee rates null or NaN now and then), and is rewritten at random
moments: before a cut, between a cut and its run, between a crashed attempt and its
retry. Each epoch must read the version pinned at its cut, on every attempt.

Expect per epoch its output rows, the enrichment's figures (version, records,
unmatched, dropped), the records aggregated and the dead letters (a null key the left
join keeps); at the end ``read_state()`` and the Delta table. Where the table is never
rewritten the result must not depend on the cuts: a second cut ends with equal tables."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
from deltalake import write_deltalake
from hypothesis import event, given
from hypothesis import strategies as st
from pyspark.sql import SparkSession

from tests.enrich_reference import DIMENSION, EnrichReference, enrich_pipeline
from tests.properties.streams import (
    EXAMPLES,
    KEY,
    MOMENTS,
    Epoch,
    Plan,
    Stream,
    by_key,
    delta_sink,
    key_pools,
    materialise,
    one_commit_each,
    plans,
    profile,
    run_plan,
    start_us,
    streams,
    where,
)
from tests.ttl_reference import VALUES, same_values
from volley_dagster import EpochRunner
from volley_dagster.sinks.delta import DeltaSink

CHECKED = VALUES + ["region"]
FEE_RATES = [0.0, 0.01, 0.02, 0.5, 1.0, 2.5, None, float("nan")]
Rewrite = tuple[int, str]  # (epoch, moment): the next version replaces the table then


@st.composite
def dimensions(draw: st.DrawFn, stream: Stream) -> pa.Table:
    """One version of the merchants table: one row for some of the stream's keys,
    maybe for keys it lacks, maybe one with a null key (which matches nothing)."""
    seen = sorted({r.key for r in stream.records if r.key is not None}, key=repr)
    keys: list[object] = draw(st.lists(st.sampled_from(seen), unique=True)) if seen else []
    keys += [k for k in draw(key_pools(stream.key_kind)) if k not in seen][:2]
    if draw(st.sampled_from(["no null key"] * 3 + ["null key"])) == "null key":
        keys.append(None)
    return pa.table({
        KEY: pa.array(keys, pa.int64() if stream.key_kind == "int" else pa.string()),
        "fee_rate": pa.array([draw(st.sampled_from(FEE_RATES)) for _ in keys], pa.float64()),
        "region": pa.array([draw(st.sampled_from([0, 1, 2, 3, None])) for _ in keys], pa.int64()),
    })


def pinned(rewrites: list[Rewrite], epoch: int) -> int:
    """The table's Delta version when ``epoch`` was cut: the rewrites before its cut."""
    return sum(e < epoch or (e == epoch and moment == "before_cut") for e, moment in rewrites)


def run_enriched(spark: SparkSession, base: Path, how: str, log: pa.Table, plan: Plan, versions: list[pa.Table],
                 rewrites: list[Rewrite]) -> tuple[EpochRunner, list[Epoch]]:
    """``plan`` through ``enrich_pipeline``, the table rewritten with the next version at each rewrite."""
    write_deltalake(base / DIMENSION, versions[0])
    later = iter(versions[1:])

    def at(moment: str, epoch: int) -> None:
        for _ in range(rewrites.count((epoch, moment))):
            write_deltalake(base / DIMENSION, next(later), mode="overwrite")

    def make_runner() -> EpochRunner:
        pipeline = enrich_pipeline(base / "events", base / DIMENSION, how)
        return EpochRunner(pipeline.sink(DeltaSink(base / "delta", mode="upsert")).on_bad_records("dead_letter"),
                           base / "state", spark=spark)

    return run_plan(make_runner, base / "events", log, plan, base / "delta", at)


@profile(default_examples=2)
@given(data=st.data())
def test_enrichment_equals_the_reference(spark, tmp_path_factory, data):
    EXAMPLES["enrich"] += 1
    how = data.draw(st.sampled_from(["inner", "left"]), label="how")
    stream = data.draw(streams(data.draw(st.sampled_from(["int", "str"]), label="keys")), label="stream")
    plan = data.draw(plans(len(stream.records)), label="plan")
    # the simplest example (the first one Hypothesis runs) rewrites the table while the
    # crashed epoch waits for its retry
    rewritten = data.draw(st.sampled_from([True, False]), label="rewritten")
    versions = data.draw(st.lists(dimensions(stream), min_size=1 + rewritten, max_size=3 if rewritten else 1),
                         label="versions")
    crashed = [] if plan.crash is None else [(plan.crash[0], "after_crash")]
    moments = crashed + [(epoch, moment) for epoch in range(1, len(plan.epochs) + 1) for moment in MOMENTS[:2]]
    rewrites = sorted(data.draw(st.lists(st.sampled_from(moments), min_size=len(versions) - 1,
                                         max_size=len(versions) - 1), label="rewrites"),
                      key=lambda r: (r[0], MOMENTS.index(r[1])))
    event(f"how: {how}, rewrites: {', '.join(moment for _, moment in rewrites) or 'none'}")
    log = materialise(stream, start_us())

    runner, epochs = run_enriched(spark, tmp_path_factory.mktemp("enrich"), how, log, plan, versions, rewrites)
    reference = EnrichReference(how)
    for e in epochs:
        n = e.result.epoch
        version = pinned(rewrites, n)
        expected, figures = reference.run_rows(e.records, versions[version])
        assert e.result.records_in == e.records.num_rows
        assert {name: read.to_dict() for name, read in e.result.enrichments.items()} == {
            DIMENSION: {"kind": "delta", "version": str(version), "how": how, "on": [KEY], **figures}
        }, f"epoch {n}: the enrichment's figures"
        same_values(e.result.output, expected, CHECKED)
        dead = reference.dead_letters[-1]
        assert e.dead == set(where(e.records, dead)), f"epoch {n}: dead letters"
        assert e.result.dead_letters == len(dead)
        assert e.result.records_aggregated == figures["records"] - figures["dropped"] - len(dead)
    state, table = runner.read_state(), delta_sink(runner).read()
    same_values(state, reference.state, CHECKED)
    same_values(table, reference.state, CHECKED)
    one_commit_each(runner, epochs)
    if len(versions) == 1:  # the table never changed: another cut of the stream ends the same
        again, _ = run_enriched(spark, tmp_path_factory.mktemp("enrich"), how, log,
                                data.draw(plans(len(stream.records), crash=False), label="second plan"), versions, [])
        same_values(again.read_state(), by_key(state), CHECKED)
        same_values(delta_sink(again).read(), by_key(table), CHECKED)
