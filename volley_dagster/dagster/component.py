"""A ``dg`` component: a team's dg project adds its pipelines from YAML
(``defs/<name>/defs.yaml``), each named by its ``Deployment`` or a function that
returns one, with the settings of the resources they share::

    type: volley_dagster.dagster.component.VolleyPipelines
    attributes:
      deployments: [my_project.pipelines:payments_deployment]
      checkpoints_root: /data/volley/state
      warehouse: /data/volley/tables

``dg scaffold defs volley_dagster.dagster.component.VolleyPipelines payments`` writes
that file with every attribute explained, and a pipeline to edit beside it
(``VolleyPipelinesScaffolder``). Relative paths are relative to the project's root. One
component holds a project's pipelines: they share its ``volley_`` resources. (No ``from
__future__ import annotations`` here: Dagster reads the fields' types at runtime to build
the YAML model.)"""

import importlib
import os
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Optional

from dagster import Definitions
from dagster.components import (
    Component,
    ComponentLoadContext,
    ResolutionContext,
    Resolvable,
    Resolver,
    Scaffolder,
    ScaffoldRequest,
    scaffold_with,
)

from volley_dagster.dagster.location import build_definitions
from volley_dagster.dagster.resources import CheckpointResource, SparkResource, TablesResource
from volley_dagster.deploy import Deployment
from volley_dagster.errors import ConfigError

COMPONENT_TYPE = "volley_dagster.dagster.component.VolleyPipelines"

# ``{{ env.NAME }}`` and ``{{ env("NAME") }}`` in a YAML value
_ENV_REFERENCE = re.compile(r"""env\s*(?:\.\s*([A-Za-z_]\w*)|\(\s*["']([^"']+)["'])""")


def _resolved(context: ResolutionContext, raw: Any, optional: bool = False) -> Any:
    """``raw`` with its templates resolved. Dagster gives None for ``{{ env.NAME }}`` when
    NAME is unset, and pastes ``None`` into a longer string: either is an error here that
    names the variable (a field left out keeps its default; ``optional``: a value that
    is wholly an unset variable means unset)."""
    if isinstance(raw, (list, tuple)):
        return [_resolved(context.at_path(i), v, optional) for i, v in enumerate(raw)]
    if isinstance(raw, dict):
        return {k: _resolved(context.at_path(k), v, optional) for k, v in raw.items()}
    if not isinstance(raw, str):
        return raw
    value = context.resolve_value(raw)
    unset = [a or b for a, b in _ENV_REFERENCE.findall(raw) if (a or b) not in os.environ]
    if value is None and not optional or (unset and isinstance(value, str) and "None" in value):
        where = ".".join(str(p) for p in context.path) or "a value"
        if unset:
            raise ConfigError(f"{where}: environment variable {', '.join(unset)} is not set "
                              f"({raw.strip()!r} gives {value!r}): set it where the code location runs")
        raise ConfigError(f"{where}: {raw.strip()!r} gives no value")
    return value


def _required(kind: Any, description: str) -> Resolver:
    return Resolver(lambda context, raw: _resolved(context, raw), model_field_type=kind, description=description,
                    inject_before_resolve=False)


def _optional(kind: Any, description: str) -> Resolver:
    return Resolver(lambda context, raw: _resolved(context, raw, optional=True), model_field_type=kind,
                    description=description, inject_before_resolve=False)


class VolleyPipelinesScaffolder(Scaffolder):
    """``dg scaffold defs volley_dagster.dagster.component.VolleyPipelines <name>``: a
    ``defs.yaml`` with every attribute, each explained (the optional ones commented out,
    at their defaults), and ``pipeline.py`` beside it: a pipeline named after the folder
    that the YAML names, reading Parquet files from ``data/<name>/events`` under the
    project's root, with its sensor on. It loads as written; edit the pipeline."""

    def scaffold(self, request: ScaffoldRequest) -> None:
        folder = request.target_path.parent if request.append else request.target_path
        name = _identifier(folder.name)
        module_file = folder / "pipeline.py"
        if module_file.exists():
            raise ConfigError(f"{module_file} exists: scaffold the pipeline into a folder of its own")
        module = _module_of(module_file, request.project_root)
        up = len(folder.relative_to(request.project_root).parts) if request.project_root is not None and \
            folder.is_relative_to(request.project_root) else 0
        module_file.write_text(pipeline_template(name, up))
        reference = f"{module}:{name}_deployment"
        if request.scaffold_format == "python":
            (folder / "component.py").write_text(component_py_template(reference))
            return
        text = defs_yaml_template(reference)
        if request.append:
            with open(request.target_path, "a") as f:
                f.write("---\n" + text)
        else:
            (folder / "defs.yaml").write_text(text)


def _identifier(name: str) -> str:
    ident = re.sub(r"\W", "_", name)
    return ident if ident and not ident[0].isdigit() else f"p_{ident}"


def _module_of(path: Path, project_root: Optional[Path]) -> str:
    """The module name of ``path`` in the project (its ``src/`` layout or its root)."""
    for base in ([project_root / "src", project_root] if project_root is not None else []):
        if path.is_relative_to(base):
            return ".".join(path.relative_to(base).with_suffix("").parts)
    return path.stem


def defs_yaml_template(reference: str) -> str:
    return textwrap.dedent(f"""\
        # volley-dagster pipelines: each is an asset group (source -> state -> tables), one
        # partition per epoch; its sensor cuts epochs when data lands and runs them in order.
        # A path is relative to the project's root unless absolute; a value may read the
        # environment ("{{{{ env.VOLLEY_STATE }}}}": an unset variable fails the load, naming it).
        # The runs need Java 17 or later (Spark 4), and the instance the settings that
        # `volley dagster-instance` prints.
        type: {COMPONENT_TYPE}

        attributes:
          # Each a Deployment, or a function returning one, as "package.module:name".
          deployments:
            - {reference}

          # Each pipeline's epoch log and state snapshots, under <root>/<pipeline>: a local or
          # shared POSIX path that every run reaches.
          checkpoints_root: data/volley/state

          # The sinks' tables: Delta under <warehouse>/delta; Iceberg in its catalog.
          warehouse: data/volley/tables

          # Optional, at their defaults:
          # max_records_per_epoch: 1000000    # records one epoch reads at most
          # keep_epochs: 3                    # epochs whose state snapshots are kept
          # snapshot_store_uri: s3://bucket/volley/snapshots   # every snapshot on S3 too
          # iceberg_catalog_properties: {{type: rest, uri: "https://catalog.example"}}  # any pyiceberg
          #                                   # catalog (default: SQLite under <warehouse>/iceberg)
          # spark_master: spark://spark-master:7077    # a standalone cluster,
          # spark_remote: sc://spark-connect:15002     # or a Spark Connect server;
          # warm_spark: true                  # with neither: a local Spark Connect server the runs share
          # spark_config: {{spark.executor.memory: 4g}}   # any spark.* key
        """)


def pipeline_template(name: str, up: int) -> str:
    root = f"Path(__file__).resolve().parents[{up}]" if up else "Path(__file__).resolve().parent"
    return textwrap.dedent(f'''\
        """The {name} pipeline, scaffolded by `dg scaffold defs {COMPONENT_TYPE} {name}`:
        edit it. It keeps a running total per key of the Parquet files that land in
        data/{name}/events (each subfolder a partition, read in name order) and upserts it
        to a Delta table, one commit per epoch."""

        from pathlib import Path

        from volley_dagster import DeltaSink, FileLog, Pipeline, count, sum_
        from volley_dagster.dagster import Deployment, TableSettings

        EVENTS = {root} / "data" / "{name}" / "events"


        def {name}_pipeline(tables: TableSettings) -> Pipeline:
            return (
                Pipeline("{name}")  # the asset group, asset keys, partitions and pool go by this name
                .source(FileLog(EVENTS, format="parquet"))
                .key_by("key")  # the column the state is kept by
                .aggregate(total=sum_("amount"), events=count())
                .sink(DeltaSink(f"{{tables.warehouse}}/delta/{name}_totals", name="totals", mode="upsert",
                                storage_options=tables.delta_storage_options,
                                on_foreign_lineage=tables.on_foreign_lineage))
            )


        def {name}_deployment() -> Deployment:
            return Deployment(
                name="{name}",
                build={name}_pipeline,
                min_records=1,  # cut an epoch as soon as a record waits (with max_wait_s: once N wait)
                sensor_running=True,  # the sensor starts with the code location (off: start it in the UI)
            )
        ''')


def component_py_template(reference: str) -> str:
    return textwrap.dedent(f'''\
        import dagster as dg

        from volley_dagster.dagster.component import VolleyPipelines


        @dg.component_instance
        def load(context: dg.ComponentLoadContext) -> VolleyPipelines:
            return VolleyPipelines(deployments=["{reference}"], checkpoints_root="data/volley/state",
                                   warehouse="data/volley/tables")
        ''')


@scaffold_with(VolleyPipelinesScaffolder)
@dataclass
class VolleyPipelines(Component, Resolvable):
    """volley-dagster pipelines: exactly-once, stateful stream processing on PySpark, each
    pipeline an asset group (source, keyed state, one asset per sink table) partitioned
    by epoch, with its checks, its sensor (cuts an epoch when data lands) and its jobs.

    Attributes:
        deployments: each a ``volley_dagster.dagster.Deployment``, or a function returning
            one, as ``package.module:name``.
        checkpoints_root: where each pipeline keeps its epoch log and state snapshots
            (``<root>/<pipeline>``): a POSIX path every run reaches.
        warehouse: where the sinks' tables go (Delta under ``<warehouse>/delta``).
        iceberg_catalog_properties: any pyiceberg catalog (default: SQLite under the warehouse).
        snapshot_store_uri: ``s3://bucket/prefix``: every state snapshot on S3 too.
        max_records_per_epoch: the records one epoch reads at most (1,000,000).
        keep_epochs: the epochs whose state snapshots are kept (3).
        spark_master: a standalone master URL; spark_remote: a Spark Connect URL.
        spark_config: any ``spark.*`` key.
        warm_spark: with neither URL, one local Spark Connect server the runs share (true).

    Relative paths are relative to the project's root. A value may read the environment
    (``{{ env.NAME }}``); an unset variable fails the load naming it (where the whole value
    of an optional attribute is one, it means unset). Runs need Java 17+."""

    deployments: Annotated[list[str], _required(
        list[str], "Each a volley_dagster.dagster.Deployment, or a function returning one, as "
                   "'package.module:name'.")]
    checkpoints_root: Annotated[str, _required(
        str, "Where each pipeline keeps its epoch log and state snapshots (<root>/<pipeline>): a local or shared "
             "POSIX path every run reaches; relative to the project's root unless absolute.")]
    warehouse: Annotated[str, _required(
        str, "Where the sinks' tables go (Delta under <warehouse>/delta); a path relative to the project's root, or "
             "a URI.")]
    iceberg_catalog_properties: Annotated[dict[str, str], _required(
        dict[str, str], "Any catalog pyiceberg loads (type: rest, sql, glue, hive; uri, warehouse, ...). Default: "
                        "a SQLite catalog under <warehouse>/iceberg.")] = field(default_factory=dict)
    snapshot_store_uri: Annotated[Optional[str], _optional(
        Optional[str], "s3://bucket/prefix: every state snapshot on S3 too, for executors that do not share the "
                       "checkpoint root's disk.")] = None
    max_records_per_epoch: Annotated[int, _required(int, "The records one epoch reads at most.")] = 1_000_000
    keep_epochs: Annotated[int, _required(int, "The epochs whose state snapshots are kept.")] = 3
    spark_master: Annotated[Optional[str], _optional(
        Optional[str], "A standalone master URL (spark://host:7077).")] = None
    spark_remote: Annotated[Optional[str], _optional(
        Optional[str], "A Spark Connect URL (sc://host:15002).")] = None
    spark_config: Annotated[dict[str, str], _required(
        dict[str, str], "Any spark.* key, over the engine's defaults.")] = field(default_factory=dict)
    warm_spark: Annotated[bool, _required(
        bool, "With neither spark_master nor spark_remote: one supervised local Spark Connect server the runs "
              "share (false: a local Spark per run).")] = True

    def build_defs(self, context: ComponentLoadContext) -> Definitions:
        root = Path(context.project_root)
        if not self.deployments:
            raise ConfigError("deployments: name at least one, as 'package.module:name'")
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
    """The ``Deployment`` that ``package.module:name`` names: the object itself, or what
    the function of that name returns when called with no arguments."""
    module_name, sep, name = ref.partition(":")
    if not sep or not module_name or not name:
        raise ConfigError(f"deployment {ref!r}: name it as 'package.module:name' (a Deployment, or a function "
                          "returning one)")
    try:
        target = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"deployment {ref!r}: {type(exc).__name__}: {exc}") from exc
    if isinstance(target, Deployment):
        return target
    if not callable(target):
        raise ConfigError(f"deployment {ref!r} is a {type(target).__name__}, not a volley_dagster Deployment or a "
                          "function returning one")
    try:
        deployment = target()
    except TypeError as exc:
        if _takes_arguments(target):
            raise ConfigError(f"deployment {ref!r}: the function must take no arguments ({exc}); wrap it in one "
                              "that does") from exc
        raise
    if not isinstance(deployment, Deployment):
        raise ConfigError(f"deployment {ref!r} returned a {type(deployment).__name__}, not a volley_dagster Deployment")
    return deployment


def _takes_arguments(function: Any) -> bool:
    import inspect

    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
               for p in parameters)


def _under(root: Path, path: str) -> str:
    return path if "://" in path or Path(path).is_absolute() else str(root / path)
