"""``Pipeline.process`` on real Spark, RocksDB and Delta: a team's processor over the
demo's payments, epoch by epoch, against the same processor run record by record by
``tests/process_reference.py``; a processor that raises, named down to the file and
record, committing nothing until the code is fixed; and ``kill -9`` mid-epoch."""

from __future__ import annotations

import json
import signal
import time
from collections import Counter
from dataclasses import replace

import deltalake
import pandas as pd
import pyarrow as pa
import pyarrow.compute  # noqa: F401 - pa.compute
import pyarrow.parquet as pq
import pytest

from tests.engine.test_crash_recovery import KEEP, run_until_killed
from tests.helpers import alert_rows, velocity_pipeline, velocity_reference
from volley_dagster import EpochRunner, FileLog, MemorySink, Pipeline, ProcessorError, StatefulProcessor
from volley_dagster.cli import main
from volley_dagster.demo.events import generate
from volley_dagster.demo.velocity import VelocityAlert
from volley_dagster.errors import ConfigError, StateLayoutError, is_retryable
from volley_dagster.settings import RunSettings

FILES, PER_FILE, KEYS = 4, 400, 30


def test_a_processor_equals_the_reference_epoch_by_epoch_and_ends_with_every_timer_fired(spark, tmp_path, capsys):
    files = generate(tmp_path / "events", FILES, PER_FILE, KEYS, events_per_second=20, disorder_s=8)
    runner = EpochRunner(velocity_pipeline(tmp_path / "events", tmp_path / "alerts"), tmp_path / "state",
                         RunSettings(max_records_per_epoch=PER_FILE, keep_epochs=FILES + 2), spark=spark)
    results = runner.run_available()
    reference, expected, late = velocity_reference([tmp_path / "events" / f for f in files])
    assert [r.epoch for r in results] == list(range(1, FILES + 1))
    assert sum(r.late_records for r in results) == late
    held = sum(len(rows) for rows in reference.state().values())
    timers = sum(len(t) for t in reference.timers().values())
    assert _shown(runner) == {"recent": held, "timer": timers} and held > 0
    assert results[-1].figures["process_state_rows"] == held
    assert results[-1].figures["process_timers_pending"] == timers
    assert sum(r.figures["process_timers_fired"] for r in results) > 0
    _changes_are_a_diff_of_the_state(runner, FILES - 1, FILES)
    _the_state_commands_show_and_export_it(runner, tmp_path, capsys)
    final = runner.flush()[-1]  # the stream's end fires every timer: each card's recent payments age out
    assert final.end_of_stream and runner.read_state().num_rows == 0
    assert final.figures["process_timers_pending"] == 0
    assert len(expected) > 20, "the data should raise alerts"
    assert alert_rows(deltalake.DeltaTable(str(tmp_path / "alerts")).to_pyarrow_table()) == sorted(expected)


def _changes_are_a_diff_of_the_state(runner: EpochRunner, before: int, after: int) -> None:
    """``volley state diff``'s feed between two epochs: one row per (card, variable, entry)
    added, changed or removed, as a diff of ``read_state`` at each says."""
    tables = runner.state_tables()
    assert tables.keys() == ["card", "variable", "entry"]
    old, new = ({(r["card"], r["variable"], r["entry"]): r["value"] for r in runner.read_state(e).to_pylist()}
                for e in (before, after))
    expected = Counter({"added": len(new.keys() - old.keys()), "removed": len(old.keys() - new.keys()),
                        "changed": sum(old[k] != new[k] for k in old.keys() & new.keys())})
    got = Counter(row["change"] for row in tables.changes(before, after).select("change").collect())
    assert got == +expected and sum(got.values()) > 0


def _the_state_commands_show_and_export_it(runner: EpochRunner, tmp_path, capsys) -> None:
    """``volley state show`` prints the processor's rows and timers, ``volley state
    export`` writes every one of them to Delta."""
    root = str(runner.log.root)
    capsys.readouterr()
    assert main(["state", "show", root, "--limit", "3"]) == 0
    shown = capsys.readouterr().out
    assert "variable" in shown and "recent" in shown and f"{runner.read_state().num_rows:,} rows" in shown
    assert main(["state", "export", root, "--to", f"delta:{tmp_path / 'exported'}"]) == 0
    exported = deltalake.DeltaTable(str(tmp_path / "exported")).to_pyarrow_table()
    mine = runner.read_state()
    assert sorted(zip(*(exported.column(c).to_pylist() for c in ("card", "variable", "entry", "value")), strict=True)) \
        == sorted(zip(*(mine.column(c).to_pylist() for c in ("card", "variable", "entry", "value")), strict=True))


def _shown(runner: EpochRunner) -> dict[str, int]:
    """``read_state``'s rows per variable (a key's pending timers: ``timer``)."""
    variables = runner.read_state().column("variable").to_pylist()
    return {name: variables.count(name) for name in set(variables)}


class Faulty(VelocityAlert):
    """Raises on one payment's amount, as a processor with a bug does."""

    def __init__(self, bad_amount: float | None) -> None:
        super().__init__(10_000, 3)
        self.bad_amount = bad_amount

    def handleInputRows(self, key, rows, timerValues):
        for frame in rows:
            if self.bad_amount is not None and (frame["amount"] == self.bad_amount).any():
                raise ValueError(f"cannot score amount {self.bad_amount}")
            yield from super().handleInputRows(key, iter([frame]), timerValues)


def test_an_exception_in_the_processor_fails_the_epoch_by_file_and_record_and_the_fixed_code_commits_it(
        spark, tmp_path):
    files = generate(tmp_path / "events", 2, PER_FILE, KEYS, events_per_second=20, disorder_s=8)
    second = pq.read_table(tmp_path / "events" / files[1])
    offset = 123
    bad = second.column("amount")[offset].as_py()
    assert second.column("amount").to_pylist().count(bad) == 1, "the chosen amount must name one record"
    settings = RunSettings(max_records_per_epoch=PER_FILE)
    faulty = velocity_pipeline(tmp_path / "events", tmp_path / "alerts", processor=Faulty(bad))
    runner = EpochRunner(faulty, tmp_path / "state", settings, spark=spark)
    assert runner.run_next().epoch == 1
    version = deltalake.DeltaTable(str(tmp_path / "alerts")).version()
    with pytest.raises(ProcessorError) as failed:
        runner.run_next()
    message = str(failed.value)
    card = second.column("merchant_id")[offset].as_py() % 17
    assert f"processor 'Faulty' failed in handleInputRows on key {card}, epoch 2" in message
    assert f"handling {files[1]} record {offset}: ValueError" in message
    assert f"ValueError: cannot score amount {bad}" in message
    assert "raise ValueError(f\"cannot score amount" in message, "the processor's traceback should reach the driver"
    assert "process_state.py" not in message, "the engine's frames are left out"
    assert not is_retryable(failed.value)
    assert runner.committed_epoch() == 1
    assert deltalake.DeltaTable(str(tmp_path / "alerts")).version() == version  # nothing of epoch 2
    fixed = velocity_pipeline(tmp_path / "events", tmp_path / "alerts", processor=Faulty(None))
    assert EpochRunner(fixed, tmp_path / "state", settings, spark=spark).run_next().epoch == 2


@pytest.mark.parametrize(("point", "shard", "committed"), [
    ("shard_after_snapshot", 1, 2),
    *(pytest.param(point, None, 2, marks=pytest.mark.deep) for point in ("after_snapshot", "after_sink_delta",
                                                                        "after_sinks")),
    pytest.param("during_retention", None, 3, marks=pytest.mark.deep),
])
def test_kill_9_mid_epoch_and_resume_equals_the_reference(spark, tmp_path, point, shard, committed):
    """A processor's state, timers and emitted rows after a kill -9 and a resume by a
    new runner are those of the record-by-record reference: the Delta and Iceberg
    tables hold every alert exactly once."""
    names = generate(tmp_path / "events", FILES, PER_FILE, KEYS, events_per_second=20, disorder_s=8)
    crashed = run_until_killed(tmp_path, point, 3, shard, kind="velocity", max_records=PER_FILE)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-3000:]
    pipeline = velocity_pipeline(tmp_path / "events", tables=tmp_path / "tables")
    runner = EpochRunner(pipeline, tmp_path / "state", RunSettings(max_records_per_epoch=PER_FILE, keep_epochs=KEEP),
                         spark=spark)
    assert runner.committed_epoch() == committed
    assert [r.epoch for r in runner.run_available()] == list(range(committed + 1, FILES + 1))
    reference, expected, _ = velocity_reference([tmp_path / "events" / n for n in names])
    assert _shown(runner) == {"recent": sum(len(rows) for rows in reference.state().values()),
                              "timer": sum(len(t) for t in reference.timers().values())}
    sinks = {s.name: s for s in pipeline.sinks}
    for name in ("delta", "iceberg"):
        assert alert_rows(sinks[name].read()) == sorted(expected), name
        assert sinks[name].committed_epoch("velocity") == FILES


def test_update_mode_upserts_each_cards_last_alert(spark, tmp_path):
    """``output_mode="update"`` into a Delta upsert by card: the table holds each card's
    latest alert, the last the reference emits for it over every epoch."""
    from volley_dagster import DeltaSink

    files = generate(tmp_path / "events", 2, PER_FILE, KEYS, events_per_second=20, disorder_s=8)
    appended = velocity_pipeline(tmp_path / "events", tmp_path / "alerts")
    assert appended.processing is not None
    pipeline = replace(appended, sinks=(), processing=replace(appended.processing, output_mode="update")).sink(
        DeltaSink(str(tmp_path / "latest"), name="latest", mode="upsert"))
    with pytest.raises(ConfigError, match="sink 'latest' upserts, but process"):
        replace(pipeline, processing=appended.processing).stateful_operator()
    EpochRunner(pipeline, tmp_path / "state", RunSettings(max_records_per_epoch=PER_FILE), spark=spark).run_available()
    _, expected, _ = velocity_reference([tmp_path / "events" / f for f in files])
    latest = {row[0]: row for row in expected}
    assert alert_rows(deltalake.DeltaTable(str(tmp_path / "latest")).to_pyarrow_table()) == sorted(latest.values())


class VelocityCounted(VelocityAlert):
    """``VelocityAlert`` and a count of each card's payments: a variable a later deploy adds."""

    def init(self, handle):
        super().init(handle)
        self.seen = handle.getValueState("seen", "bigint")

    def handleInputRows(self, key, rows, timerValues):
        frames = list(rows)
        self.seen.update((self.seen.get() or (0,))[0] + sum(len(f) for f in frames))
        yield from super().handleInputRows(key, iter(frames), timerValues)


class VelocityRetyped(VelocityAlert):
    def init(self, handle):
        self.handle = handle
        self.recent = handle.getListState("recent", "at_ms bigint, amount float")


def test_a_rescale_and_a_migration_that_adds_then_drops_a_variable_keep_the_processor_exact(spark, tmp_path):
    files = generate(tmp_path / "events", FILES, PER_FILE, KEYS, events_per_second=20, disorder_s=8)
    settings = RunSettings(max_records_per_epoch=PER_FILE, keep_epochs=FILES + 2)
    runner = EpochRunner(velocity_pipeline(tmp_path / "events", tmp_path / "alerts"), tmp_path / "state", settings,
                         spark=spark)
    assert [r.epoch for r in runner.run_available(max_epochs=2)] == [1, 2]
    assert runner.rescale(5).new_shards == 5
    assert [r.epoch for r in runner.run_available(max_epochs=1)] == [3]

    counted = velocity_pipeline(tmp_path / "events", tmp_path / "alerts", processor=VelocityCounted(10_000, 3))
    with pytest.raises(StateLayoutError, match="migrate"):
        EpochRunner(counted, tmp_path / "state", settings, spark=spark).run_next()
    retyped = velocity_pipeline(tmp_path / "events", tmp_path / "alerts", processor=VelocityRetyped(10_000, 3))
    with pytest.raises(StateLayoutError, match=r"state variable 'recent' changed from list<at_ms bigint, amount "
                                               r"double> to list<at_ms bigint, amount float>"):
        runner.migrate(retyped)
    assert runner.migrate(counted).changes == ["state variable 'seen' added (every key starts without it)"]
    last = runner.run_available()
    assert [r.epoch for r in last] == [4]
    four = pq.read_table(tmp_path / "events" / files[-1]).column("merchant_id").to_pylist()
    assert _shown(runner)["seen"] == len({m % 17 for m in four})  # the cards epoch 4 saw, from an empty start
    seen = runner.read_state().filter(pa.compute.equal(pa.compute.field("variable"), "seen"))
    assert sum(json.loads(v)[0] for v in seen.column("value").to_pylist()) == len(four) - last[0].late_records

    assert runner.migrate(velocity_pipeline(tmp_path / "events", tmp_path / "alerts")).changes == [
        "state variable 'seen' dropped"]
    reference, expected, _ = velocity_reference([tmp_path / "events" / f for f in files])
    assert _shown(runner) == {"recent": sum(len(rows) for rows in reference.state().values()),
                              "timer": sum(len(t) for t in reference.timers().values())}
    assert alert_rows(deltalake.DeltaTable(str(tmp_path / "alerts")).to_pyarrow_table()) == sorted(expected)
    final = runner.flush()[-1]  # the counts the dropped variable left are gone with it
    assert final.figures["process_state_rows"] == 0 and runner.read_state().num_rows == 0


class Counts(StatefulProcessor):
    """Each key's records so far, in value state that expires ``ttl_ms`` after its last update."""

    def __init__(self, ttl_ms: int) -> None:
        self.ttl_ms = ttl_ms

    def init(self, handle):
        self.count = handle.getValueState("count", "bigint", ttlDurationMs=self.ttl_ms)

    def handleInputRows(self, key, rows, timerValues):
        n = (self.count.get() or (0,))[0] + sum(len(frame) for frame in rows)
        self.count.update(n)
        yield pd.DataFrame({"n": [n]})


def test_a_state_ttl_counts_from_each_epochs_recorded_cut_time(spark, tmp_path):
    """``ttlDurationMs`` on the processing time each epoch's cut recorded: a day keeps
    every count, a millisecond lets epoch 2 start every key afresh; ``volley state``
    shows when each row expires."""
    files = generate(tmp_path / "events", 2, PER_FILE, KEYS, events_per_second=20, disorder_s=8)
    per_epoch = [Counter(pq.read_table(tmp_path / "events" / f).column("merchant_id").to_pylist()) for f in files]
    for ttl_ms, expected in ((86_400_000, per_epoch[0] + per_epoch[1]), (1, per_epoch[1])):
        pipeline = (Pipeline(f"counts{ttl_ms}").source(FileLog(tmp_path / "events")).key_by("merchant_id")
                    .process(Counts(ttl_ms), output_schema="n bigint")
                    .sink(MemorySink(name="out")))
        runner = EpochRunner(pipeline, tmp_path / f"state{ttl_ms}", RunSettings(max_records_per_epoch=PER_FILE),
                             spark=spark)
        for _ in files:
            time.sleep(0.01)  # the next cut's wall clock is past a 1 ms TTL
            result = runner.run(runner.cut_next().epoch)  # type: ignore[union-attr]
        assert dict(zip(result.output.column("merchant_id").to_pylist(), result.output.column("n").to_pylist(),
                        strict=True)) == dict(expected), f"ttl {ttl_ms} ms"
        state = runner.read_state()
        cut_at = runner.log.offsets(2).cut_at_us
        assert set(state.column("expires_at").cast(pa.int64()).to_pylist()) == {cut_at // 1000 * 1000 + ttl_ms * 1000}
