"""The Python functions Spark runs on executors: reading log segments and
folding a shard's partials into its RocksDB state through the operator.

Both are plain picklable objects holding settings only; everything they touch
is on storage every executor reaches (the log, the checkpoint root).
"""

from __future__ import annotations

import json
import os
import resource
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.compute as pc

from volley_dagster import columns, faults
from volley_dagster.operators.base import ShardStep, StatefulOperator
from volley_dagster.sources.file_log import FileLog
from volley_dagster.sources.offsets import Segment
from volley_dagster.state.options import RocksDBOptions
from volley_dagster.state.store import FileDigests, ShardStore


@dataclass(frozen=True)
class SegmentReader:
    """``mapInArrow`` over ``spark.range(len(segments))``: each id reads one segment."""

    source: FileLog
    segments: tuple[Segment, ...]
    schema: pa.Schema
    epoch: int
    driver_pid: int

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            for seg_id in batch.column(0).to_pylist():
                faults.fault_point("segment_read", self.epoch, pid=self.driver_pid)
                table = self.source.read_segment(self.segments[seg_id], self.schema)
                yield from table.to_batches(max_chunksize=65536)


@dataclass(frozen=True)
class PreviousSnapshot:
    path: str
    files: FileDigests


@dataclass(frozen=True)
class ShardMerge:
    """``applyInArrow`` per shard: restore N-1, fold partials in, flush, snapshot N."""

    step: ShardStep
    key_column: str
    operator: StatefulOperator
    previous: dict[int, PreviousSnapshot]
    snapshot_root: str  # snapshots/<epoch>/
    work_root: str  # work/<epoch>/
    rocksdb: RocksDBOptions
    scan_fraction: float
    verify_checksums: bool
    driver_pid: int

    def __call__(self, table: pa.Table) -> pa.Table:
        shard = table.column(columns.SHARD)[0].as_py()
        valid = pc.is_valid(table.column(columns.KEY))
        data = table.filter(valid)
        # a single-job epoch's null-key records arrive as one partial row per shard;
        # the marker rows (one per shard) are no records
        null_key_rows = pc.and_(pc.invert(valid), pc.is_null(table.column(columns.MARKER)))
        null_keys = int(pc.sum(table.filter(null_key_rows).column(columns.ROWS)).as_py() or 0)
        _reset_peak_rss()
        t0 = time.perf_counter()
        prev = self.previous.get(shard)
        store = ShardStore.restore(
            Path(prev.path) if prev else None,
            prev.files if prev else None,
            Path(self.work_root) / f"shard-{shard:04d}-{uuid.uuid4().hex[:12]}",
            self.rocksdb,
            self.verify_checksums,
        )
        try:
            t1 = time.perf_counter()
            txn = store.transaction(self.scan_fraction)
            outputs, operator_stats = self.operator.apply(txn, data, self.step)
            t2 = time.perf_counter()
            written = txn.flush()
            t3 = time.perf_counter()
            snap = store.snapshot(
                Path(self.snapshot_root) / f"shard-{shard:04d}",
                Path(prev.path) if prev else None,
                prev.files if prev else None,
            )
            t4 = time.perf_counter()
            faults.fault_pause("shard_after_snapshot", self.step.epoch, shard)  # tests: hold the attempt
        finally:
            store.close()
        faults.fault_point("shard_after_snapshot", self.step.epoch, pid=self.driver_pid, shard=shard)
        stats = {
            "shard": shard,
            "snapshot": str(snap.path),
            "files": snap.files,
            "bytes_total": snap.bytes_total,
            "bytes_new": snap.bytes_new,
            **operator_stats,
            "records": int(pc.sum(data.column(columns.ROWS)).as_py() or 0),
            "null_key_records": null_keys,
            "keys_written": written,
            "read_mode": "scan" if txn.scanned else "multi_get",
            "restore_s": t1 - t0,
            "merge_s": t2 - t1,
            "flush_s": t3 - t2,
            "snapshot_s": t4 - t3,
            "peak_rss_mib": _peak_rss_mib(),
            "task_pid": os.getpid(),  # the executor-side process that ran the shard
        }
        return self._output(outputs, stats)

    def _output(self, values: list[pa.Array], stats: dict) -> pa.Table:
        names = [self.key_column] + self.operator.output_names() + [columns.STATS]
        rows = pa.table(values + [pa.nulls(len(values[0]), pa.string())], names=names)
        stats_row = pa.table(
            [pa.nulls(1, arr.type) for arr in values] + [pa.array([json.dumps(stats)], pa.string())], names=names
        )
        return pa.concat_tables([rows, stats_row])


def _reset_peak_rss() -> None:
    """Start this task's peak-RSS measurement (Linux: Python workers are reused across tasks)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass


def _peak_rss_mib() -> float:
    """Peak resident memory of this worker since ``_reset_peak_rss``."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
