"""The ``dg`` component as a team meets it, through Dagster's own APIs (what ``dg``
calls in the project's environment): ``dg list components`` shows its docstring,
``dg scaffold defs volley_dagster.dagster.component.VolleyPipelines payments`` writes a
commented ``defs.yaml`` naming every attribute and a pipeline beside it, and the
project loads as written (``dg check defs``); an unset ``{{ env.X }}`` fails naming X;
a deployment is named by the object or by a function returning it. No Spark."""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import sys
import textwrap
from pathlib import Path
from typing import Iterator

import pytest
import yaml
from dagster import AssetKey, DefaultSensorStatus
from dagster.components.core.package_entry import discover_entry_point_package_objects
from dagster.components.core.snapshot import get_package_entry_snap
from dagster.components.testing import DefsFolderSandbox, create_defs_folder_sandbox

from volley_dagster.dagster.component import COMPONENT_TYPE, VolleyPipelines, load_deployment
from volley_dagster.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
UNSET = "VOLLEY_TEST_NEVER_SET"
FIELDS = [f.name for f in dataclasses.fields(VolleyPipelines)]


@pytest.fixture
def sandbox() -> Iterator[DefsFolderSandbox]:
    os.environ.pop(UNSET, None)
    forget_team_project()  # another test's project of this name, imported in this process
    try:
        with create_defs_folder_sandbox(project_name="team_project") as sandbox:
            yield sandbox
    finally:
        forget_team_project()


def forget_team_project() -> None:
    """Drop ``team_project``'s modules, so the next sandbox's are imported from its own folder."""
    for name in [m for m in sys.modules if m == "team_project" or m.startswith("team_project.")]:
        del sys.modules[name]
    importlib.invalidate_caches()


def scaffolded(sandbox: DefsFolderSandbox, name: str = "payments", scaffold_format: str = "yaml") -> Path:
    """What ``dg scaffold defs <type> <name>`` writes (``scaffold_object``, as dg runs it)."""
    return sandbox.scaffold_component(component_cls=VolleyPipelines, defs_path=name,
                                      scaffold_format=scaffold_format)  # type: ignore[arg-type]


def with_attributes(path: Path, **attributes: object) -> None:
    spec = yaml.safe_load((path / "defs.yaml").read_text())
    spec["attributes"].update(attributes)
    (path / "defs.yaml").write_text(yaml.safe_dump(spec))


def load_error(sandbox: DefsFolderSandbox, path: Path) -> str:
    with pytest.raises(Exception) as caught:
        with sandbox.load_component_and_build_defs(defs_path=path):
            pass
    chain, exc = [], caught.value
    while exc is not None:
        chain.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return "\n".join(chain)


def test_dg_lists_it_with_its_docstring_and_its_attributes_described() -> None:
    (key, obj), = [(k, o) for k, o in discover_entry_point_package_objects().items() if k.to_typename() == COMPONENT_TYPE]
    snap = get_package_entry_snap(key, obj)
    assert snap.summary and snap.summary.startswith("volley-dagster pipelines: exactly-once, stateful stream")
    for name in FIELDS:
        assert f"    {name}:" in (snap.description or "") or f"; {name}:" in (snap.description or ""), name
    schema = VolleyPipelines.model().model_json_schema()
    assert all(schema["properties"][name].get("description") for name in FIELDS)
    assert schema["required"] == ["deployments", "checkpoints_root", "warehouse"]


def test_scaffold_writes_a_commented_template_that_loads_as_written(sandbox: DefsFolderSandbox) -> None:
    path = scaffolded(sandbox)
    assert sorted(p.name for p in path.iterdir()) == ["defs.yaml", "pipeline.py"]
    text = (path / "defs.yaml").read_text()
    assert "attributes: {}" not in text and text.count("\n#") + text.count("  #") >= 15
    spec = yaml.safe_load(text)
    assert spec == {"type": COMPONENT_TYPE, "attributes": {
        "deployments": ["team_project.defs.payments.pipeline:payments_deployment"],
        "checkpoints_root": "data/volley/state", "warehouse": "data/volley/tables"}}
    named = set(re.findall(r"^  #? ?(\w+):", text, re.M))
    assert set(FIELDS) <= named, set(FIELDS) - named  # every attribute, the optional ones commented out
    optional = {key: yaml.safe_load(value) for key, value in re.findall(r"^  # (\w+): (.+?)(?:\s{2,}#.*)?$", text, re.M)}
    assert set(optional) == set(FIELDS) - set(spec["attributes"])
    VolleyPipelines.model().model_validate({**spec["attributes"], **optional})  # uncommented, they are valid too
    assert "Java 17" in text and "volley dagster-instance" in text

    with sandbox.load_component_and_build_defs(defs_path=path) as (component, defs):
        assert isinstance(component, VolleyPipelines)
        graph = defs.resolve_asset_graph()
        assert {k.to_user_string() for k in graph.get_all_asset_keys()} == {
            "payments/source", "payments/state", "payments/delta_totals", "payments/state_export"}
        assert graph.get(AssetKey(["payments", "source"])).metadata["dagster/uri"] == str(
            sandbox.project_root / "data" / "payments" / "events")
        sensor = defs.resolve_sensor_def("payments_new_data")
        assert sensor.default_status == DefaultSensorStatus.RUNNING  # runs when files land
        assert defs.resources["volley_checkpoints"].root == str(sandbox.project_root / "data" / "volley" / "state")


def test_the_team_page_shows_what_the_scaffold_writes(sandbox: DefsFolderSandbox) -> None:
    """docs/your-project.md's YAML and pipeline.py, in the default lane (the deep lane
    follows the whole page from the wheel: tests/adoption/test_your_project.py)."""
    from tests.test_docs import parse_page

    path = scaffolded(sandbox)
    page = {b.name: b.text for b in parse_page(ROOT / "docs" / "your-project.md")}
    assert page["your-project.md#A project and a pipeline/yaml"] == (path / "defs.yaml").read_text()
    shown = page["your-project.md#A project and a pipeline/python"]
    assert shown == "# src/team_project/defs/payments/pipeline.py\n" + (path / "pipeline.py").read_text()
    with sandbox.load_component_and_build_defs(defs_path=path) as (_, defs):
        jobs = {job.name for job in defs.jobs or []}
    named = set(re.findall(r"`(payments_\w+_job)`", "\n".join(page.values()) + (ROOT / "docs" / "your-project.md")
                           .read_text()))
    assert named and named <= jobs, named - jobs  # every job the page names exists


def test_scaffold_in_python_writes_a_component_that_loads(sandbox: DefsFolderSandbox) -> None:
    path = scaffolded(sandbox, "refunds", scaffold_format="python")
    assert sorted(p.name for p in path.iterdir()) == ["component.py", "pipeline.py"]
    with sandbox.build_all_defs() as defs:
        assert {job.name for job in defs.jobs or []} >= {"refunds_epochs_job"}


@pytest.mark.parametrize("attributes, named", [
    ({"checkpoints_root": f"{{{{ env.{UNSET} }}}}"}, "attributes.checkpoints_root"),
    ({"warehouse": f"{{{{ env.{UNSET} }}}}/tables"}, "attributes.warehouse"),  # Dagster would paste "None/tables"
    ({"deployments": [f"{{{{ env.{UNSET} }}}}"]}, "attributes.deployments.0"),
    ({"spark_config": {"spark.executor.memory": f"{{{{ env.{UNSET} }}}}"}}, "attributes.spark_config.spark.executor.memory"),
    ({"max_records_per_epoch": f"{{{{ env.{UNSET} }}}}"}, "attributes.max_records_per_epoch"),
    ({"snapshot_store_uri": f"s3://{{{{ env.{UNSET} }}}}/snapshots"}, "attributes.snapshot_store_uri"),
])
def test_an_unset_environment_variable_fails_the_load_naming_it(sandbox, attributes, named) -> None:
    path = scaffolded(sandbox)
    with_attributes(path, **attributes)
    error = load_error(sandbox, path)
    assert f"{named}: environment variable {UNSET} is not set" in error, error
    assert "NoneType" not in error


def test_an_optional_attribute_that_is_wholly_an_unset_variable_is_unset_and_a_set_one_is_read(sandbox, monkeypatch):
    path = scaffolded(sandbox)
    with_attributes(path, spark_master=f"{{{{ env.{UNSET} }}}}", checkpoints_root="{{ env.VOLLEY_TEST_ROOT }}/state")
    monkeypatch.setenv("VOLLEY_TEST_ROOT", "/srv/volley")
    with sandbox.load_component_and_build_defs(defs_path=path) as (component, defs):
        assert component.spark_master is None and component.checkpoints_root == "/srv/volley/state"
        assert defs.resources["volley_checkpoints"].root == "/srv/volley/state"


def test_a_deployment_is_named_by_the_object_or_a_function_returning_it(sandbox: DefsFolderSandbox) -> None:
    path = scaffolded(sandbox)
    (path / "objects.py").write_text(textwrap.dedent("""\
        from team_project.defs.payments.pipeline import payments_deployment
        from volley_dagster.demo.payments import local_tables, payments_pipeline

        deployment = payments_deployment()


        def needs_an_argument(events):
            return payments_deployment()


        def a_pipeline():
            return payments_pipeline("/nonexistent", local_tables("/nonexistent"))
        """))
    with_attributes(path, deployments=["team_project.defs.payments.objects:deployment"])
    with sandbox.load_component_and_build_defs(defs_path=path) as (_, defs):
        assert defs.resolve_job_def("payments_epochs_job")
    with sandbox.build_component_tree():  # the project's modules on the path, as dg has them
        module = "team_project.defs.payments.objects"
        assert load_deployment(f"{module}:deployment").name == "payments"
        assert load_deployment("team_project.defs.payments.pipeline:payments_deployment").name == "payments"
        with pytest.raises(ConfigError, match="the function must take no arguments"):
            load_deployment(f"{module}:needs_an_argument")
        with pytest.raises(ConfigError, match="is a str, not a volley_dagster Deployment or a function returning one"):
            load_deployment(f"{module}:__name__")
        with pytest.raises(ConfigError, match="returned a Pipeline, not a volley_dagster Deployment"):
            load_deployment(f"{module}:a_pipeline")
    with pytest.raises(ConfigError, match="name it as 'package.module:name'"):
        load_deployment("payments_deployment")
