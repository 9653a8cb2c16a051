"""The instance settings ship with the package: ``volley dagster-instance`` prints the
``dagster.yaml`` sections a deployment needs, and ``--merge`` writes them into an
existing one keeping every other key (and the comments outside the sections it
rewrites). The result is an instance Dagster loads (``DagsterInstance.from_config``)
with nothing missing (``runs.instance_problems``); this repository's ``dagster.yaml``
holds the same settings."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from dagster import DagsterInstance

from volley_dagster.cli import main
from volley_dagster.dagster import instance_settings, instance_settings_yaml, merge_instance_settings
from volley_dagster.dagster.instance import merged_settings
from volley_dagster.dagster.runs import instance_problems
from volley_dagster.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def instance_at(home: Path, dagster_yaml: str | None) -> DagsterInstance:
    home.mkdir(exist_ok=True)
    if dagster_yaml is not None:
        (home / "dagster.yaml").write_text(dagster_yaml)
    return DagsterInstance.from_config(str(home))


@pytest.mark.parametrize("warm", [False, True])
def test_the_printed_yaml_is_the_settings_each_section_explained(warm: bool) -> None:
    text = instance_settings_yaml(warm_launcher=warm)
    assert yaml.safe_load(text) == instance_settings(warm_launcher=warm)
    assert list(yaml.safe_load(text)) == ["run_launcher"] * warm + ["run_coordinator", "concurrency", "run_monitoring",
                                                                    "run_retries"]
    lines = text.splitlines()
    for key in yaml.safe_load(text):
        assert lines[lines.index(f"{key}:") - 1].startswith("# "), f"{key} has no comment above it"


@pytest.mark.parametrize("warm", [False, True])
def test_the_repositorys_dagster_yaml_holds_the_settings(warm: bool) -> None:
    ours = yaml.safe_load((ROOT / "dagster.yaml").read_text())
    merged, changes = merged_settings(ours, warm_launcher=warm)
    assert changes == [] and merged == ours


def test_an_instance_with_the_printed_settings_lacks_nothing_and_a_bare_one_is_told_what(tmp_path: Path) -> None:
    with instance_at(tmp_path / "set", instance_settings_yaml()) as instance:
        assert instance_problems(instance, "payments") == []
        assert instance.run_retries_enabled and instance.run_monitoring_enabled
    with instance_at(tmp_path / "bare", None) as instance:
        problems = instance_problems(instance, "payments")
    assert len(problems) == 3, problems
    pool, retries, monitoring = problems
    assert "pool volley_payments admits any number of runs" in pool
    assert retries.startswith("run retries are off") and "volley dagster-instance --merge" in retries
    assert monitoring.startswith("run monitoring is off")


def test_the_run_coordinator_that_launches_at_once_is_named(tmp_path: Path) -> None:
    immediate = "run_coordinator:\n  module: dagster.core.run_coordinator\n  class: DefaultRunCoordinator\n"
    with instance_at(tmp_path / "home", immediate + "concurrency:\n  pools:\n    default_limit: 1\n") as instance:
        (problem, *_) = instance_problems(instance, "payments")
    assert problem.startswith("the run coordinator is SyncInMemoryRunCoordinator, which launches every run at once")


THEIRS = textwrap.dedent("""\
    # our team's instance
    storage:
      sqlite:
        base_dir: {base}
    run_coordinator:
      module: dagster.core.run_coordinator
      class: QueuedRunCoordinator
      config:
        max_concurrent_runs: 7
        dequeue_interval_seconds: 5
    # we turned retries off once
    run_retries:
      enabled: false
    # no telemetry here
    telemetry:
      enabled: false
    """)


def test_merge_writes_the_settings_into_a_teams_dagster_yaml_keeping_the_rest(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    path = home / "dagster.yaml"
    path.write_text(THEIRS.format(base=tmp_path / "storage"))
    changes = merge_instance_settings(path)
    assert "run_retries.enabled: false -> true" in changes
    assert "run_coordinator.config.dequeue_interval_seconds: 5 -> 1" in changes
    assert any(c.startswith("max_concurrent_runs: moved to concurrency.runs") for c in changes)
    assert {"concurrency: added", "run_monitoring: added"} <= set(changes)
    text = path.read_text()
    merged = yaml.safe_load(text)
    assert merged["storage"] == {"sqlite": {"base_dir": str(tmp_path / "storage")}}
    assert merged["telemetry"] == {"enabled": False} and "# no telemetry here" in text and "# our team's instance" in text
    assert "# we turned retries off once" not in text  # the rewritten section's own comment goes with it
    assert merged["concurrency"] == {"pools": {"granularity": "run", "default_limit": 1},
                                     "runs": {"max_concurrent_runs": 7}}  # where Dagster reads it beside pools
    assert "max_concurrent_runs" not in merged["run_coordinator"]["config"]
    with DagsterInstance.from_config(str(home)) as instance:  # Dagster takes it
        assert instance_problems(instance, "payments") == []
        assert instance.get_concurrency_config().run_queue_config.max_concurrent_runs == 7
    assert merge_instance_settings(path) == [] and path.read_text() == text  # a second merge changes nothing


def test_merge_replaces_a_coordinator_of_another_class_and_creates_a_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "dagster.yaml"
    path.write_text("run_coordinator:\n  module: dagster.core.run_coordinator\n  class: DefaultRunCoordinator\n"
                    "  config: {}\n")
    assert merge_instance_settings(path)[0] == "run_coordinator: DefaultRunCoordinator -> QueuedRunCoordinator"
    assert yaml.safe_load(path.read_text()) == instance_settings()
    created = tmp_path / "new" / "dagster.yaml"
    merge_instance_settings(created, warm_launcher=True)
    assert yaml.safe_load(created.read_text()) == instance_settings(warm_launcher=True)


def test_merge_refuses_what_is_not_a_dagster_yaml(tmp_path: Path) -> None:
    path = tmp_path / "dagster.yaml"
    path.write_text("- a\n- list\n")
    with pytest.raises(ConfigError, match="holds a list, not the mapping a dagster.yaml is"):
        merge_instance_settings(path)
    path.write_text("run_retries: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        merge_instance_settings(path)
    assert path.read_text() == "run_retries: [unclosed\n"


def test_the_command_prints_and_merges(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dagster-instance"]) == 0
    assert capsys.readouterr().out == instance_settings_yaml()
    assert main(["dagster-instance", "--warm-launcher"]) == 0
    assert "class: WarmRunLauncher" in capsys.readouterr().out
    path = tmp_path / "dagster.yaml"
    path.write_text("telemetry:\n  enabled: false\n")
    assert main(["dagster-instance", "--merge", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{path}: run_retries: added" in out and "restart the Dagster daemon" in out
    assert main(["dagster-instance", "--merge", str(path)]) == 0
    assert "has every setting already; nothing changed" in capsys.readouterr().out
    path.write_text("[1, 2]\n")
    assert main(["dagster-instance", "--merge", str(path)]) == 1
    assert "volley dagster-instance:" in capsys.readouterr().err


def test_the_settings_load_without_dagster_or_spark() -> None:
    """The command starts in about a second: the settings' module imports neither (the
    package's public names load when first used)."""
    code = ("import sys, volley_dagster.dagster.instance as i; i.instance_settings_yaml(); "
            "print([m for m in ('dagster', 'pyspark') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120).stdout
    assert out.strip() == "[]", out
