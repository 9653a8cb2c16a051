"""What a Dagster user reads in the UI and ``dg list defs``: every check and the epochs
job say what they are, the source asset has a kind as the others do, and the
``instance_settings`` check names what the instance lacks of the settings the
pipeline's guarantees rest on. The sensor reports it (on a real ``DagsterInstance``:
a bare one, then one with ``volley dagster-instance``'s settings); the UI's Execute
evaluates it; the epochs job's runs leave it out. No Spark: nothing here runs an epoch."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Iterator

import pytest
from dagster import (
    AssetCheckEvaluation,
    AssetCheckKey,
    AssetKey,
    AssetSelection,
    DagsterInstance,
    Definitions,
    build_sensor_context,
    define_asset_job,
)

from volley_dagster.dagster import (
    CheckpointResource,
    SparkResource,
    TablesResource,
    build_definitions,
    instance_settings_yaml,
)
from volley_dagster.dagster.epochs import BLOCKING_CHECKS, CHECK_DESCRIPTIONS, INSTANCE_CHECK
from volley_dagster.demo.payments import payments_deployment
from volley_dagster.errors import ConfigError

STATE = AssetKey(["payments", "state"])
INSTANCE_KEY = AssetCheckKey(STATE, INSTANCE_CHECK)


def payments_defs(base: Path) -> Definitions:
    (base / "events").mkdir(parents=True, exist_ok=True)
    return build_definitions([replace(payments_deployment(base / "events"), sensor_running=False)],
                             checkpoints=CheckpointResource(root=str(base / "state")),
                             tables=TablesResource(warehouse=str(base / "tables")), spark=SparkResource())


@pytest.fixture
def defs(tmp_path: Path) -> Definitions:
    return payments_defs(tmp_path)


def instance_in(home: Path, dagster_yaml: str | None = None) -> DagsterInstance:
    home.mkdir()
    if dagster_yaml is not None:
        (home / "dagster.yaml").write_text(dagster_yaml)
    return DagsterInstance.from_config(str(home))


@pytest.fixture
def bare(tmp_path: Path) -> Iterator[DagsterInstance]:
    with instance_in(tmp_path / "bare") as instance:
        yield instance


def tick(defs: Definitions, instance: DagsterInstance, cursor: str | None = None):
    with build_sensor_context(instance=instance, cursor=cursor, resources=defs.resources, definitions=defs) as ctx:
        return defs.resolve_sensor_def("payments_new_data")(ctx)


def instance_evaluations(result) -> list[AssetCheckEvaluation]:
    return [e for e in result.asset_events if isinstance(e, AssetCheckEvaluation) and e.check_name == INSTANCE_CHECK]


def test_every_check_and_the_epochs_job_say_what_they_are_and_the_source_has_a_kind(defs: Definitions) -> None:
    graph = defs.resolve_asset_graph()
    specs = {key: graph.get_check_spec(key) for key in graph.asset_check_keys}
    assert len(specs) == 3 + 4 * 2 + 1  # the state's, each of the two tables', and the instance's
    for key, spec in specs.items():
        assert spec.description and len(spec.description) > 40, key
        assert spec.description.startswith("Blocking.") == (key.name in BLOCKING_CHECKS), key
    assert set(CHECK_DESCRIPTIONS) == {key.name for key in specs} - {INSTANCE_CHECK}
    assert graph.get(AssetKey(["payments", "source"])).kinds == {"parquet"}
    assert all(graph.get(key).kinds for key in graph.get_all_asset_keys())
    job = defs.resolve_job_def("payments_epochs_job")
    assert job.description and "dg launch --job payments_epochs_job --partition" in job.description


def test_the_epochs_job_runs_the_pipelines_checks_but_not_the_instance_check(defs: Definitions) -> None:
    job = defs.resolve_job_def("payments_epochs_job")
    checks = job.asset_layer.asset_graph.asset_check_keys
    assert INSTANCE_KEY not in checks and len(checks) == 3 + 4 * 2
    assert [node.name for node in job.graph.node_defs] == ["payments_epochs"]


def test_the_sensor_reports_what_a_bare_instance_lacks_once_and_then_that_it_has_it(tmp_path: Path, defs, bare):
    first = tick(defs, bare)
    (failed,) = instance_evaluations(first)
    assert failed.asset_key == STATE and not failed.passed
    assert "pool volley_payments admits any number of runs" in failed.description
    assert "run retries are off" in failed.description and "run monitoring is off" in failed.description
    assert failed.metadata["missing"].value == 3
    assert first.skip_reason is not None  # nothing waits: the tick still skips, saying why
    assert instance_evaluations(tick(defs, bare, first.cursor)) == []  # the same: not again
    with instance_in(tmp_path / "set", instance_settings_yaml()) as settled:
        fixed = tick(defs, settled, first.cursor)
        (passed,) = instance_evaluations(fixed)
        assert passed.passed and "pool limit of one run" in passed.description
        assert instance_evaluations(tick(defs, settled, fixed.cursor)) == []
        assert instance_evaluations(tick(defs, settled)) == []  # an instance that always had everything: silent


def test_a_tick_that_cannot_read_its_source_still_reports_the_instance(tmp_path: Path, bare) -> None:
    defs = payments_defs(tmp_path / "pipeline")
    (tmp_path / "pipeline" / "events").rmdir()
    result = tick(defs, bare)
    assert "cannot cut epochs of 'payments'" in result.skip_reason.skip_message
    (failed,) = instance_evaluations(result)
    assert not failed.passed
    assert instance_evaluations(tick(defs, bare, result.cursor)) == []


def test_the_check_evaluates_when_executed(defs: Definitions, bare) -> None:
    with_job = Definitions.merge(defs, Definitions(jobs=[define_asset_job("instance_check",
                                                                          AssetSelection.checks(INSTANCE_KEY))]))
    result = with_job.resolve_job_def("instance_check").execute_in_process(instance=bare)
    (evaluation,) = result.get_asset_check_evaluations()
    assert evaluation.check_name == INSTANCE_CHECK and not evaluation.passed
    assert "run retries are off" in (evaluation.description or "")


def test_a_function_given_for_a_deployment_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"deployments\[0\] is a function, not a volley_dagster.dagster.Deployment "
                                          r"\(call the function that returns it\)"):
        build_definitions([payments_deployment], checkpoints=CheckpointResource(root=str(tmp_path)),  # type: ignore[list-item]
                          tables=TablesResource(warehouse=str(tmp_path)), spark=SparkResource())
