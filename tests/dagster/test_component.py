"""A team's ``dg`` project adds a pipeline from a component YAML: the project (laid out
as ``dg scaffold project`` makes one: ``[tool.dg]`` in pyproject.toml, ``src/<module>/defs/``)
loads through Dagster's own ``load_from_defs_folder``, and runs an epoch."""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path

from dagster import AssetKey, DagsterInstance, build_sensor_context

from tests.helpers import assert_state_equal, log_records, reference_state
from volley_dagster.checkpoint.epoch_log import epoch_key
from volley_dagster.demo.events import generate

KEYS = 200


def scaffold_team_project(root: Path, events: Path) -> Path:
    package = root / "src" / "team_project"
    (package / "defs" / "payments").mkdir(parents=True)
    (root / "pyproject.toml").write_text(textwrap.dedent("""\
        [project]
        name = "team_project"
        version = "0.1.0"

        [tool.dg]
        directory_type = "project"

        [tool.dg.project]
        root_module = "team_project"
    """))
    (package / "__init__.py").write_text("")
    (package / "defs" / "__init__.py").write_text("")
    (package / "definitions.py").write_text(textwrap.dedent("""\
        from pathlib import Path

        import dagster as dg


        @dg.definitions
        def defs():
            return dg.load_from_defs_folder(path_within_project=Path(__file__).parent)
    """))
    (package / "pipelines.py").write_text(textwrap.dedent(f"""\
        from dataclasses import replace

        from volley_dagster.demo.payments import payments_deployment


        def payments():
            return replace(payments_deployment({str(events)!r}), min_records=1, max_wait_s=None)
    """))
    (package / "defs" / "payments" / "defs.yaml").write_text(textwrap.dedent("""\
        type: volley_dagster.dagster.component.VolleyPipelines
        attributes:
          deployments: [team_project.pipelines:payments]
          checkpoints_root: data/state
          warehouse: data/tables
          max_records_per_epoch: 2000
    """))
    return package


def test_a_dg_project_adds_a_pipeline_from_a_component_yaml_and_runs_an_epoch(spark, tmp_path, monkeypatch):
    root = tmp_path / "team_project"
    scaffold_team_project(root, tmp_path / "events")
    monkeypatch.syspath_prepend(str(root / "src"))
    for name in [m for m in sys.modules if m == "team_project" or m.startswith("team_project.")]:
        del sys.modules[name]
    defs = importlib.import_module("team_project.definitions").defs()
    assert {"payments_epochs_job", "payments_rescale_job"} <= {job.name for job in defs.jobs or []}
    assert defs.resources is not None and defs.resources["volley_checkpoints"].root == str(root / "data" / "state")

    generate(tmp_path / "events", 2, 1_000, KEYS)
    home = tmp_path / "dagster_home"
    home.mkdir()
    with DagsterInstance.from_config(str(home)) as instance:
        with build_sensor_context(instance=instance, resources=defs.resources, definitions=defs) as ctx:
            result = defs.resolve_sensor_def("payments_new_data")(ctx)
        for req in result.dynamic_partitions_requests or []:
            instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))
        assert [r.partition_key for r in result.run_requests] == [epoch_key(1)]
        run = defs.resolve_job_def("payments_epochs_job").execute_in_process(instance=instance,
                                                                              partition_key=epoch_key(1))
        assert run.success
        materialized = instance.get_latest_materialization_event(AssetKey(["payments", "state"]))
        assert materialized is not None and materialized.asset_materialization.partition == epoch_key(1)

    from deltalake import DeltaTable

    expected = reference_state(log_records(2, 1_000, KEYS))[["merchant_id", "total", "events"]]
    balances = DeltaTable(str(root / "data" / "tables" / "delta" / "merchant_balances")).to_pyarrow_table()
    assert_state_equal(balances.select(list(expected.columns)), expected)


def test_a_deployment_named_wrongly_is_refused_naming_it() -> None:
    import pytest

    from volley_dagster.dagster.component import load_deployment
    from volley_dagster.errors import ConfigError

    with pytest.raises(ConfigError, match="'payments_deployment': name it as 'package.module:name'"):
        load_deployment("payments_deployment")
    with pytest.raises(ConfigError, match="'volley_dagster.demo.payments:nothing'.*AttributeError"):
        load_deployment("volley_dagster.demo.payments:nothing")
    with pytest.raises(ConfigError, match="returned a Pipeline, not a volley_dagster Deployment"):
        load_deployment("tests.dagster.test_component:_a_pipeline")


def _a_pipeline():
    from volley_dagster.demo.payments import local_tables, payments_pipeline

    return payments_pipeline("/nonexistent/events", local_tables("/nonexistent/tables"))
