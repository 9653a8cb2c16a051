"""On ``PYTHONPATH`` of the ``dagster dev`` the harness starts (``start_dagster_dev``):
Dagster's backfill daemon waits a fixed 30 s between iterations
(``dagster._daemon.controller.DEFAULT_DAEMON_INTERVAL_SECONDS``; no instance setting
exists), so each backfill a test launches waits up to 30 s to be picked up. With
``HARNESS_DAEMON_INTERVAL_S`` set, the daemon reads that interval instead; nothing else
changes, and no other module is imported until Dagster imports its controller."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType

_MODULE = "dagster._daemon.controller"
_INTERVAL = os.environ.get("HARNESS_DAEMON_INTERVAL_S")


class _PacedController(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            exec_module = spec.loader.exec_module

            def paced(module: ModuleType) -> None:
                exec_module(module)
                module.DEFAULT_DAEMON_INTERVAL_SECONDS = float(_INTERVAL or 30)  # type: ignore[attr-defined]

            spec.loader.exec_module = paced  # type: ignore[method-assign]
        return spec


if _INTERVAL:
    sys.meta_path.insert(0, _PacedController())
