"""What the Dagster UI shows per epoch: plottable numbers on the right asset."""

import inspect
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa
from dagster import (
    AssetKey,
    CodeReferencesMetadataValue,
    LocalFileCodeReference,
    MetadataValue,
    TableColumn,
    TableSchema,
)

from volley_dagster import ConfigError, EpochResult, EpochRunner, Pipeline
from volley_dagster.dagster.keys import PipelineKeys
from volley_dagster.deploy import Deployment
from volley_dagster.operators.event_time import describe_event_time
from volley_dagster.sinks import Sink, SinkCommitResult
from volley_dagster.sources.offsets import Backlog

# What Dagster shows on an asset: a MetadataValue, or a raw value it wraps (free-form, by its nature)
DagsterMetadata = dict[str, Any]


def sink_location(sink: Sink) -> DagsterMetadata:
    """Where the table lives, under Dagster's metadata conventions."""
    location = sink.location()
    shown = {"dagster/uri": location.uri, "dagster/table_name": location.table_name, "mode": location.mode,
             # the column a Dagster IO manager filters an epoch's partition on (``TableSink.epoch_column``)
             "partition_expr": location.epoch_column}
    return {k: v for k, v in shown.items() if v is not None}


def column_schema(table: pa.Schema) -> TableSchema:
    return TableSchema(columns=[TableColumn(f.name, str(f.type)) for f in table])


PREVIEW_ROWS = 5


def table_preview(output: pa.Table, rows: int = PREVIEW_ROWS, what: str = "in this epoch") -> MetadataValue:
    """The first rows of ``output`` (an epoch's is sorted by key), as a Markdown table."""
    shown = output.slice(0, rows).to_pylist()
    head = "| " + " | ".join(output.column_names) + " |\n|" + "---|" * output.num_columns + "\n"
    body = "".join("| " + " | ".join(_cell(row[c]) for c in output.column_names) + " |\n" for row in shown)
    more = f"\n{output.num_rows - len(shown):,} more rows {what}" if output.num_rows > len(shown) else ""
    return MetadataValue.md(head + body + more if shown else f"no rows {what}")


def state_preview(runner: EpochRunner, epoch: int, by: str, rows: int = PREVIEW_ROWS) -> MetadataValue:
    """The state's top keys at ``epoch`` by the output column ``by``, read by Spark tasks."""
    from pyspark.sql import functions as F

    state = runner.state_tables().at(epoch)
    if by not in state.columns:
        raise ConfigError(f"state_preview_by={by!r} is not a column of {runner.pipeline.name!r}'s state; "
                          f"its columns are {state.columns}")
    top = state.orderBy(F.desc_nulls_last(by)).limit(rows).toArrow()
    return table_preview(top, rows, what=f"in the state at epoch {epoch}")


def _cell(value: Any) -> str:
    text = f"{value:.6g}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|")


def source_backlogs(backlog: Backlog) -> dict[Optional[str], Backlog]:
    """``backlog`` (the pipeline's, as ``runner.backlog()`` gives it) per source: the
    parts of several sources read as one, else the one (None)."""
    parts: dict[Optional[str], Backlog] = {None: backlog}
    if backlog.parts:
        parts = {name: waiting for name, waiting in backlog.parts.items()}
    return parts


def source_observation(runner: EpochRunner, backlog: Backlog, now: float, part: Optional[str] = None) -> DagsterMetadata:
    """What waits to be committed in the source (``part``: one of several, with its own
    ``backlog``), as numbers that plot: observed on each sensor tick that sees data landed."""
    committed, cut = runner.committed_epoch(), runner.log.last_cut()
    log = runner.pipeline.source_log
    in_cut_epochs = sum(log.range_of(part, runner.log.offsets(e)).records for e in range(committed + 1, cut + 1))
    return {
        "records_waiting": MetadataValue.int(backlog.records),  # not yet in an epoch
        "records_uncommitted": MetadataValue.int(backlog.records + in_cut_epochs),
        "files_waiting": MetadataValue.int(backlog.files),
        "oldest_waiting_file_age_s": MetadataValue.float(round(backlog.oldest_age_s(now), 3)),
        "epochs_waiting": MetadataValue.int(cut - committed),  # cut, not yet committed
        "last_cut_epoch": MetadataValue.int(cut),
        **{f"records_waiting_partition_{name}": MetadataValue.int(n) for name, n in sorted(backlog.per_partition.items())},
    }


def event_time_value(micros: int) -> MetadataValue:
    """A timestamp, which the UI shows in the viewer's zone; one a datetime cannot hold
    (a wild record moved the watermark there) as its text, so showing it never fails."""
    try:
        return MetadataValue.timestamp(datetime.fromtimestamp(micros / 1e6, tz=timezone.utc))
    except (OverflowError, ValueError, OSError):
        return MetadataValue.text(describe_event_time(micros))


def code_references(deployment: Deployment) -> dict[str, CodeReferencesMetadataValue]:
    """Where the pipeline is built (the user's ``Deployment.build``), for the UI's code link."""
    try:
        lines, first = inspect.getsourcelines(deployment.build)
        path = inspect.getsourcefile(deployment.build)
    except (OSError, TypeError):
        return {}
    if path is None:
        return {}
    return {"dagster/code_references": CodeReferencesMetadataValue(
        code_references=[LocalFileCodeReference(file_path=str(Path(path).resolve()), line_number=first,
                                                label=f"{deployment.name} pipeline")])}


def epoch_metadata(keys: PipelineKeys, pipeline: Pipeline, result: EpochResult,
                   row_counts: Optional[dict[str, Optional[int]]] = None) -> dict[AssetKey, DagsterMetadata]:
    """``row_counts``: each sink's table size after the epoch (``dagster/row_count``)."""
    row_counts = row_counts or {}
    d = result.durations
    state: DagsterMetadata = {
        "epoch": MetadataValue.int(result.epoch),
        "noop_already_committed": MetadataValue.bool(result.already_committed),
        "offset_range": MetadataValue.json(result.range),
        "records_in": MetadataValue.int(result.records_in),
        "records_aggregated": MetadataValue.int(result.records_aggregated),
        "records_out": MetadataValue.int(result.records_out),
        "dead_letters": MetadataValue.int(result.dead_letters),
        "keys_touched": MetadataValue.int(result.keys_touched),
        "shards": MetadataValue.int(len(result.shards)),  # rescales change it between epochs
        # how shards read state: "resident" (memory), "scan", "multi_get", "carried_forward"
        "state_reads": MetadataValue.json(dict(Counter(s.read_mode or "-" for s in result.shards.values()))),
        "new_keys": MetadataValue.int(result.new_keys),
        "state_bytes": MetadataValue.int(result.state_bytes),
        "state_bytes_written": MetadataValue.int(result.state_bytes_written),
        "snapshot_path": MetadataValue.path(f"snapshots/{result.epoch:010d}"),
        "records_per_second": MetadataValue.float(float(result.records_per_second)),
        **{f"seconds_{phase}": MetadataValue.float(float(v)) for phase, v in d.items()},
    }
    if result.watermark is not None:  # event time: windows, event-time TTL
        state["watermark"] = event_time_value(result.watermark)
        state["late_records"] = MetadataValue.int(result.late_records)
    for name, mark in sorted(result.input_watermarks.items()):  # a join: each side's; the join's is the least
        state[f"watermark_{name}"] = event_time_value(mark)
    # the operator's own: keys_expired (state TTL), duplicates and dedup_late, windows_fired, ...
    state.update({name: MetadataValue.int(n) for name, n in sorted(result.figures.items())})
    if result.duplicates_path is not None:  # the records the operator dropped, and why
        state["duplicates_path"] = MetadataValue.path(result.duplicates_path)
    for name, read in result.enrichments.items():  # the version each dimension table was read at
        state[f"{name}_version"] = MetadataValue.text(read.version)
        state[f"{name}_unmatched"] = MetadataValue.int(read.unmatched)
        state[f"{name}_dropped"] = MetadataValue.int(read.dropped)
    out = {keys.state: state}
    for sink in pipeline.sinks:
        commit = result.sinks.get(sink.name, SinkCommitResult(skipped=False))
        md: DagsterMetadata = {
            "epoch": MetadataValue.int(result.epoch),
            "noop_already_committed": MetadataValue.bool(bool(result.already_committed or commit.skipped)),
            "dagster/partition_row_count": MetadataValue.int(commit.rows or 0),  # the epoch's rows
            "seconds_commit": MetadataValue.float(commit.seconds or 0.0),
            "lineage": MetadataValue.text(commit.lineage or ""),  # the id of the checkpoint lineage that wrote it
            "sink_epoch": MetadataValue.int(commit.sink_epoch if commit.sink_epoch is not None else result.epoch),
            **sink_location(sink),
        }
        if commit.position.version is not None:
            md["delta_table_version"] = MetadataValue.int(commit.position.version)
        if commit.position.snapshot_id is not None:
            md["iceberg_snapshot_id"] = MetadataValue.text(str(commit.position.snapshot_id))
        if result.output is not None:
            md["dagster/column_schema"] = column_schema(result.output.schema)
            md["preview"] = table_preview(result.output)
        if (rows := row_counts.get(sink.name)) is not None:
            md["dagster/row_count"] = MetadataValue.int(rows)
        out[keys.sink(sink)] = md
    return out
