"""A pipeline of two sources under Dagster: each source is its own asset feeding the
state, and the sensor observes each with what waits in it. No Spark."""

from __future__ import annotations

from contextlib import ExitStack

from dagster import AssetKey, AssetObservation, build_sensor_context

from tests.dagster.conftest import build_location
from tests.helpers import channels
from volley_dagster.demo.events import generate
from volley_dagster.deploy import Deployment

STATE = AssetKey(["channels", "state"])
SOURCES = {AssetKey(["channels", "source_web"]), AssetKey(["channels", "source_store"])}


def test_every_source_is_an_asset_upstream_of_the_state_and_observed(tmp_path):
    deployment = Deployment(name="channels", build=lambda tables: channels(tmp_path), min_records=10_000)
    generate(tmp_path / "web", 2, 500, 50)
    generate(tmp_path / "store", 1, 300, 50, seed=8)
    with ExitStack() as stack:
        defs, instance, _ = build_location(deployment, tmp_path, stack)
        graph = defs.resolve_asset_graph()
        assert set(graph.get(STATE).parent_keys) == SOURCES  # lineage: both logs feed the epochs
        assert all(graph.get(key).is_external for key in SOURCES)
        with build_sensor_context(instance=instance, resources=defs.resources, definitions=defs) as ctx:
            result = defs.resolve_sensor_def("channels_new_data")(ctx)
    observed = {e.asset_key: e for e in result.asset_events if isinstance(e, AssetObservation)}
    assert set(observed) == SOURCES
    web, store = observed[AssetKey(["channels", "source_web"])], observed[AssetKey(["channels", "source_store"])]
    assert (web.metadata["records_waiting"].value, store.metadata["records_waiting"].value) == (1_000, 300)
    assert web.metadata["files"].value == 2 and web.tags["dagster/data_version"] != store.tags["dagster/data_version"]
