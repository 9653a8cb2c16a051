"""How an epoch reads a local Parquet log with Spark's own scan: every file a segment
takes whole is in one scan (a scan per file cost a task and a plan node each), a segment
of part of a file is a scan of its own with its row bounds pushed in, and every record
keeps its exact position (file, offset) whatever the file is called; a name Spark would
read as a pattern goes to the Python reader, whose tasks share small segments."""

from __future__ import annotations

import re

import pyarrow as pa
import pyarrow.parquet as pq

from volley_dagster import FileLog, columns
from volley_dagster.sources.offsets import EpochRange, Segment
from volley_dagster.spark.read import RECORDS_PER_READ_TASK, read_range, read_tasks

# names Spark writes differently in its file listing and in _metadata.file_path
NAMES = ["00 a b%c.parquet", "01 ü+x.parquet", "02 q#1.parquet", "03 plain.parquet", "04 it's.parquet",
         "05 ~x.parquet", "06 tail.parquet"]
SIZES = [40, 55, 30, 25, 35, 20, 45]


def write_log(root) -> dict[str, pa.Table]:
    root.mkdir()
    files = {}
    for i, (name, size) in enumerate(zip(NAMES, SIZES, strict=True)):
        table = pa.table({"file": pa.array([name] * size), "index": pa.array(range(size), pa.int64()),
                          "value": pa.array([i * 1000 + j for j in range(size)], pa.int64())})
        pq.write_table(table, root / name)
        files[name] = table
    return files


def scans(df) -> int:
    return df._jdf.queryExecution().executedPlan().toString().count("FileScan parquet")


def read_rows(spark, log: FileLog, rng: EpochRange) -> tuple[list[tuple[str, int, int]], int]:
    raw = read_range(spark, log, rng, log.schema()).raw
    rows = raw.select("file", "index", "value", columns.POS).collect()
    placed = []
    for file, index, value, pos in rows:
        seg, offset = rng.segment_of(pos)
        assert (seg.file, offset) == (file, index), f"record {file}:{index} placed at {seg.file}:{offset}"
        placed.append((file, index, value))
    return sorted(placed), scans(raw)


def test_whole_files_are_one_scan_and_every_record_keeps_its_file_and_offset(spark, tmp_path):
    written = write_log(tmp_path / "log")
    log = FileLog(tmp_path / "log")
    after: dict = {}
    seen: list[tuple[str, int, int]] = []
    # 100 records end inside the third file; 130 more start there, take four files whole
    # and end inside the last; the rest is the last file's tail
    for epoch, budget, whole, partial in ((1, 100, 2, 1), (2, 130, 3, 2), (3, 1000, 0, 1)):
        rng = log.cut(epoch, after, budget)
        assert native(log, rng)
        taken = [s for s in rng.segments if s.start == 0 and s.end == written[s.file].num_rows]
        assert (len(taken), len(rng.segments) - len(taken)) == (whole, partial)
        rows, n_scans = read_rows(spark, log, rng)
        expected = sorted((s.file, i, written[s.file].column("value")[i].as_py())
                          for s in rng.segments for i in range(s.start, s.end))
        assert rows == expected, f"epoch {epoch} read other records than its range"
        # the whole files together (when there are two or more), each part alone
        assert n_scans == (1 if whole > 1 else whole) + partial, f"epoch {epoch}: {n_scans} scans"
        seen += rows
        after = rng.end
    assert len(seen) == len(set(seen)) == sum(SIZES)


def test_a_lone_whole_file_is_scanned_without_row_bounds(spark, tmp_path):
    written = write_log(tmp_path / "log")
    log = FileLog(tmp_path / "log")
    rng = log.cut(1, {}, SIZES[0])  # the first file, whole
    assert [(s.start, s.end) for s in rng.segments] == [(0, SIZES[0])]
    rows, n_scans = read_rows(spark, log, rng)
    assert n_scans == 1 and rows == [(NAMES[0], i, written[NAMES[0]].column("value")[i].as_py()) for i in range(SIZES[0])]
    plan = read_range(spark, log, rng, log.schema()).raw._jdf.queryExecution().executedPlan().toString()
    assert re.search(r"\bFilter\b", plan) is None, plan  # every row is the segment's: nothing to filter


def native(log: FileLog, rng: EpochRange) -> bool:
    return log.native_parquet_files(rng, log.schema()) is not None


def test_a_file_named_like_a_pattern_is_read_as_itself_not_as_the_files_it_matches(spark, tmp_path):
    root = tmp_path / "log"
    root.mkdir()
    for name, values in (("b1.parquet", [1, 2]), ("b[1].parquet", [10, 20, 30])):  # Spark's glob b[1] is b1
        pq.write_table(pa.table({"value": pa.array(values, pa.int64())}), root / name)
    log = FileLog(root)
    rng = log.cut(1, {}, None)
    assert [s.file for s in rng.segments] == ["b1.parquet", "b[1].parquet"]
    assert not native(log, rng)  # the Python reader takes every name as it is
    raw = read_range(spark, log, rng, log.schema()).raw
    placed = sorted((rng.segment_of(pos)[0].file, value) for value, pos in raw.select("value", columns.POS).collect())
    assert placed == [("b1.parquet", 1), ("b1.parquet", 2), ("b[1].parquet", 10), ("b[1].parquet", 20),
                      ("b[1].parquet", 30)]


def test_python_read_tasks_share_small_segments_and_keep_one_per_large_one():
    def segments(*records: int) -> tuple[Segment, ...]:
        return tuple(Segment(i, "", f"f{i}.jsonl", 0, n, 1) for i, n in enumerate(records))

    assert read_tasks(segments(*[20_000] * 50)) == -(-50 * 20_000 // RECORDS_PER_READ_TASK)  # 4, not 50
    assert read_tasks(segments(*[1_000_000] * 3)) == 3  # never more than a task per segment
    assert read_tasks(segments(10)) == 1
    assert read_tasks(segments(0, 0, 0)) == 1  # an epoch of empty files still reads (and checks) them
