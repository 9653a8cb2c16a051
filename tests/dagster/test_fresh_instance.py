"""A new Dagster instance over an old checkpoint root (storage moved to PostgreSQL, a
new ``DAGSTER_HOME``, history wiped): the first tick registers the last
``partitions_kept`` committed epochs and the uncommitted ones, reading the registered
keys once, instead of one lookup per epoch ever cut (9.8 ms each on SQLite: a root
of 6,000 epochs passed the daemon's 60 s evaluation timeout on every tick). A real
SQLite DagsterInstance, the epoch log written directly; no Spark."""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import replace

import pytest
from dagster import AssetMaterialization

from tests.dagster.conftest import build_location
from tests.dagster.synthetic import write_history
from tests.dagster.test_location import tick
from volley_dagster.checkpoint.epoch_log import epoch_key
from volley_dagster.demo.payments import payments_deployment

COMMITTED, CUT, KEPT = 5_000, 5_002, 200
LOOKUPS = 5  # has_dynamic_partition calls a tick may make, at any age of the root


def test_a_new_instance_over_an_old_root_registers_the_kept_window_in_one_short_tick(tmp_path, monkeypatch):
    deployment = replace(payments_deployment(tmp_path / "events"), min_records=1, max_wait_s=None,
                         partitions_kept=KEPT)
    (tmp_path / "events").mkdir()  # the source: nothing waits beyond the last cut
    write_history(tmp_path / "state" / "payments", "payments", COMMITTED, CUT)
    with ExitStack() as stack:
        defs, instance, _ = build_location(deployment, tmp_path, stack)
        lookups = []
        has_partition = instance.has_dynamic_partition

        def counted(name: str, key: str) -> bool:
            lookups.append(key)
            if len(lookups) > LOOKUPS:
                pytest.fail(f"a tick looked up {len(lookups)} partitions one by one, the last {key}")
            return has_partition(name, key)

        monkeypatch.setattr(instance, "has_dynamic_partition", counted)
        started = time.perf_counter()
        first = tick(defs, instance)
        took = time.perf_counter() - started
        window = [epoch_key(e) for e in range(COMMITTED - KEPT + 1, CUT + 1)]
        assert instance.get_dynamic_partitions("payments_epochs") == window
        committed_elsewhere = {e.partition for e in first.asset_events if isinstance(e, AssetMaterialization)}
        assert committed_elsewhere == set(window[:KEPT])  # shown materialized: only the kept committed ones
        assert [(r.tags["dagster/asset_partition_range_start"], r.tags["dagster/asset_partition_range_end"])
                for r in first.run_requests or []] == [(epoch_key(COMMITTED + 1), epoch_key(CUT))]
        assert took < 10, f"the first tick took {took:.1f}s"

        lookups.clear()
        idle = tick(defs, instance, first.cursor)  # nothing new: one lookup, nothing registered again
        assert not idle.dynamic_partitions_requests and len(lookups) <= 2
