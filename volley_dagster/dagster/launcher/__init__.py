"""Dagster instance plug-ins for volley-dagster deployments (``dagster.yaml``)."""

from typing import Any

__all__ = ["WarmRunLauncher"]


def __getattr__(name: str) -> Any:
    # lazy, so that ``python -m volley_dagster.dagster.launcher.fork_server`` does not import itself twice
    if name == "WarmRunLauncher":
        from volley_dagster.dagster.launcher.run_launcher import WarmRunLauncher

        return WarmRunLauncher
    raise AttributeError(name)
