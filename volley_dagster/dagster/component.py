"""A ``dg`` component: a team's dg project adds its pipelines from YAML
(``defs/<name>/defs.yaml``), each named by the function that returns its
``Deployment``, with the settings of the resources they share::

    type: volley_dagster.dagster.component.VolleyPipelines
    attributes:
      deployments: [my_project.pipelines:payments_deployment]
      checkpoints_root: /data/volley/state
      warehouse: /data/volley/tables

Relative paths are relative to the project's root. One component holds a project's
pipelines: they share its ``volley_`` resources. (No ``from __future__ import
annotations`` here: Dagster reads the fields' types at runtime to build the YAML model.)"""

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from dagster import Definitions
from dagster.components import Component, ComponentLoadContext, Resolvable

from volley_dagster.dagster.location import build_definitions
from volley_dagster.dagster.resources import CheckpointResource, SparkResource, TablesResource
from volley_dagster.deploy import Deployment
from volley_dagster.errors import ConfigError


@dataclass
class VolleyPipelines(Component, Resolvable):
    deployments: list[str]  # "package.module:function", each returning a Deployment
    checkpoints_root: str
    warehouse: str
    iceberg_catalog_properties: dict[str, str] = field(default_factory=dict)
    snapshot_store_uri: Optional[str] = None
    max_records_per_epoch: int = 1_000_000
    keep_epochs: int = 3
    spark_master: Optional[str] = None
    spark_remote: Optional[str] = None
    spark_config: dict[str, str] = field(default_factory=dict)
    warm_spark: bool = True

    def build_defs(self, context: ComponentLoadContext) -> Definitions:
        root = Path(context.project_root)
        return build_definitions(
            [load_deployment(ref) for ref in self.deployments],
            checkpoints=CheckpointResource(root=_under(root, self.checkpoints_root), keep_epochs=self.keep_epochs,
                                           max_records_per_epoch=self.max_records_per_epoch,
                                           snapshot_store_uri=self.snapshot_store_uri),
            tables=TablesResource(warehouse=_under(root, self.warehouse),
                                  iceberg_catalog_properties=self.iceberg_catalog_properties),
            spark=SparkResource(master=self.spark_master, remote=self.spark_remote, spark_config=self.spark_config,
                                warm=self.warm_spark),
            executor=None,  # the project's
        )


def load_deployment(ref: str) -> Deployment:
    """The ``Deployment`` that ``package.module:function`` returns."""
    module_name, sep, name = ref.partition(":")
    if not sep or not module_name or not name:
        raise ConfigError(f"deployment {ref!r}: name it as 'package.module:function'")
    try:
        builder = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"deployment {ref!r}: {type(exc).__name__}: {exc}") from exc
    deployment = builder()
    if not isinstance(deployment, Deployment):
        raise ConfigError(f"deployment {ref!r} returned a {type(deployment).__name__}, not a volley_dagster Deployment")
    return deployment


def _under(root: Path, path: str) -> str:
    return path if "://" in path or Path(path).is_absolute() else str(root / path)
