"""The pipeline's pool limit is the instance's, set the way Dagster documents it; the
sensor only reads it, and names the command when it admits more than one run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dagster import DagsterInstance

from volley_dagster.dagster.runs import pool_limit_problem


def instance_in(home: Path, default_limit: int | None) -> DagsterInstance:
    home.mkdir()
    pools = f"concurrency:\n  pools:\n    granularity: run\n    default_limit: {default_limit}\n" if default_limit else ""
    (home / "dagster.yaml").write_text(pools + "telemetry:\n  enabled: false\n")
    return DagsterInstance.from_config(str(home))


def concurrency_set(home: Path, pool: str, limit: int) -> None:
    subprocess.run([sys.executable, "-m", "dagster", "instance", "concurrency", "set", pool, str(limit)],
                   env={**os.environ, "DAGSTER_HOME": str(home)}, check=True, capture_output=True, timeout=120)


def test_a_default_limit_of_one_is_enough_and_nothing_is_written(tmp_path: Path) -> None:
    with instance_in(tmp_path / "home", 1) as instance:
        assert pool_limit_problem(instance, "payments") is None
        assert "volley_payments" not in instance.event_log_storage.get_concurrency_keys()  # only read


def test_a_pool_without_a_limit_is_named_with_the_command_until_it_is_set(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with instance_in(home, None) as instance:
        problem = pool_limit_problem(instance, "payments")
        assert problem is not None and "any number of runs" in problem
        assert "dagster instance concurrency set volley_payments 1" in problem
        concurrency_set(home, "volley_payments", 3)
        assert "admits 3 runs" in (pool_limit_problem(instance, "payments") or "")
        concurrency_set(home, "volley_payments", 1)
        assert pool_limit_problem(instance, "payments") is None
