"""The Dagster integration, as a library a team's project merges in: ``build_definitions``
turns pipeline ``Deployment``s into assets, checks, sensors, schedules, jobs and
``volley_``-prefixed resources (``location.py``); the resources (``resources.py``); the
``dg`` component (``component.py``); the instance settings a deployment needs
(``instance.py``, ``volley dagster-instance``); the instance's run launcher
(``launcher/``). The engine (``volley_dagster``) never imports it.

The public names below load when first used (``lazy_exports``): ``volley
dagster-instance`` prints the instance settings without importing Dagster or Spark."""

from typing import TYPE_CHECKING

from volley_dagster.lazy_exports import lazy_exports

_LAZY: dict[str, tuple[str, ...]] = {
    "volley_dagster.dagster.instance": ("instance_settings", "instance_settings_yaml", "merge_instance_settings"),
    "volley_dagster.dagster.location": ("build_definitions",),
    "volley_dagster.dagster.resources": ("CheckpointResource", "S3Resource", "SparkResource", "TablesResource"),
    "volley_dagster.deploy": ("AssetSettings", "Deployment", "TableSettings"),
}
__getattr__ = lazy_exports(__name__, _LAZY)

if TYPE_CHECKING:
    from volley_dagster.dagster.instance import instance_settings, instance_settings_yaml, merge_instance_settings
    from volley_dagster.dagster.location import build_definitions
    from volley_dagster.dagster.resources import CheckpointResource, S3Resource, SparkResource, TablesResource
    from volley_dagster.deploy import AssetSettings, Deployment, TableSettings

__all__ = [
    "AssetSettings",
    "CheckpointResource",
    "Deployment",
    "S3Resource",
    "SparkResource",
    "TableSettings",
    "TablesResource",
    "build_definitions",
    "instance_settings",
    "instance_settings_yaml",
    "merge_instance_settings",
]
