"""The Dagster integration, as a library a team's project merges in: ``build_definitions``
turns pipeline ``Deployment``s into assets, checks, sensors, schedules, jobs and
``volley_``-prefixed resources (``location.py``); the resources (``resources.py``); the
instance's run launcher (``launcher/``). The engine (``volley_dagster``) never imports it."""

from volley_dagster.dagster.location import build_definitions
from volley_dagster.dagster.resources import CheckpointResource, S3Resource, SparkResource, TablesResource

__all__ = ["CheckpointResource", "S3Resource", "SparkResource", "TablesResource", "build_definitions"]
