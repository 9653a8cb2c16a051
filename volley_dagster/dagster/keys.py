"""The asset keys of one pipeline, in one place: the assets, the events the runs and
the sensor report, and the checks all name them from here, so the deployment's key
prefix reaches every one."""

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

from dagster import AssetKey

from volley_dagster.deploy import Deployment
from volley_dagster.io.paths import TableIdentity
from volley_dagster.pipeline import Pipeline
from volley_dagster.sinks import Sink
from volley_dagster.sources.base import Source


def sink_kind(sink: Sink) -> str:
    return sink.location().kind


def source_kinds(source: Source) -> set[str]:
    """The Dagster kinds of a source asset: ``kafka``, or a file log's format (``parquet``,
    ``json``), with ``s3`` when it is on S3."""
    described = source.describe()
    if described.get("type") != "file_log":
        return {_kind(described.get("type", "source"))}
    return {_kind(described["format"])} | ({"s3"} if source.uri.startswith("s3://") else set())


def _kind(name: object) -> str:
    """A kind as Dagster's tag keys take it (a custom source may name its type freely)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", str(name)) or "source"


@dataclass(frozen=True)
class PipelineKeys:
    """``[*prefix, pipeline, part]`` for each part: source, state, one per sink table,
    one per dimension table, the state export."""

    pipeline: str
    prefix: tuple[str, ...] = ()

    @classmethod
    def of(cls, deployment: Deployment) -> "PipelineKeys":
        return cls(deployment.name, tuple(deployment.assets.key_prefix))

    def _key(self, part: str) -> AssetKey:
        return AssetKey([*self.prefix, self.pipeline, part])

    @property
    def source(self) -> AssetKey:
        return self._key("source")

    def source_part(self, name: str | None) -> AssetKey:
        """One of several named sources (``Pipeline.sources``); None: the only one."""
        return self.source if name is None else self._key(f"source_{name}")

    @property
    def state(self) -> AssetKey:
        return self._key("state")

    @property
    def export(self) -> AssetKey:
        return self._key("state_export")

    def sink(self, sink: Sink) -> AssetKey:
        return self._key(f"{sink_kind(sink)}_{sink.name}")

    def dimension(self, table: str) -> AssetKey:
        """A dimension table an enrichment joins: upstream of the state, written by others."""
        return self._key(f"dimension_{table}")


def upstream_sources(pipeline: Pipeline, tables: Mapping[TableIdentity, AssetKey]) -> dict[Optional[str], AssetKey]:
    """The pipeline's sources that read another pipeline's table in the same definitions,
    each with that table's asset: it is the source's asset, so lineage runs on from the
    upstream pipeline's table to this pipeline's state."""
    found: dict[Optional[str], AssetKey] = {}
    for part, source in pipeline.source_log.parts().items():
        read = source.upstream_table()
        if read is not None and read in tables:
            found[part] = tables[read]
    return found
