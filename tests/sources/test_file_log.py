"""Cutting the log into ranges, and decoding segments record by record."""

from __future__ import annotations

import io
import os
import threading
import time
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from harness.processes import free_port
from tests.conftest import BUCKET
from volley_dagster.demo.events import generate
from volley_dagster.errors import SourceChangedError, SourceError, SourceUnavailableError, is_retryable
from volley_dagster.sources import formats
from volley_dagster.sources.base import NativeParquetFile, Source
from volley_dagster.sources.file_log import FULL_LISTING_EVERY, FileLog
from volley_dagster.sources.offsets import Backlog, EpochRange, Position, fair_shares


def test_cuts_follow_on_and_respect_the_budget(tmp_path):
    generate(tmp_path, 3, 100, 10)
    log = FileLog(tmp_path)
    first = log.cut(1, {}, 150)
    assert [(s.file, s.start, s.end) for s in first.segments] == [
        ("events-000000.parquet", 0, 100), ("events-000001.parquet", 0, 50)]
    assert first.end[""] == Position("events-000001.parquet", 1, 50)
    second = log.cut(2, first.end, 1000)
    assert [(s.file, s.start, s.end) for s in second.segments] == [
        ("events-000001.parquet", 50, 100), ("events-000002.parquet", 0, 100)]
    assert log.cut(3, second.end, 1000).records == 0
    assert log.available_records(second.end) == 0
    assert EpochRange.from_dict(second.to_dict()) == second


def test_the_backlog_counts_waiting_records_and_files_and_the_oldest_files_age(tmp_path):
    generate(tmp_path, 3, 100, 10)
    for i, age in enumerate((300, 200, 100)):  # written 5, 3 1/3 and 1 2/3 minutes ago
        path = tmp_path / f"events-{i:06d}.parquet"
        os.utime(path, (path.stat().st_atime, time.time() - age))
    log = FileLog(tmp_path)
    everything = log.backlog({})
    assert (everything.records, everything.files) == (300, 3)
    assert 299 <= everything.oldest_age_s(time.time()) <= 310
    first = log.cut(1, {}, 150)  # the first file and half the second
    rest = log.backlog(first.end)
    assert (rest.records, rest.files) == (150, 2) and 199 <= rest.oldest_age_s(time.time()) <= 210
    assert log.backlog(log.cut(2, first.end, None).end) == Backlog(0, 0, None)
    assert Backlog().oldest_age_s(time.time()) == 0.0


def test_a_file_log_is_a_source_whose_snapshot_changes_when_a_file_lands(tmp_path):
    generate(tmp_path, 2, 10, 5)
    log = FileLog(tmp_path)
    assert isinstance(log, Source)
    before = log.snapshot()
    assert before.metadata == {"format": "parquet", "files": 2, "latest_files": {"(root)": "events-000001.parquet"}}
    assert log.snapshot().version == before.version  # nothing landed: the same data version
    generate(tmp_path, 1, 10, 5, first_file=2)
    after = log.snapshot()
    assert after.version != before.version and after.metadata["files"] == 3


def test_partitions_share_the_budget_fairly():
    assert fair_shares({"a": 10, "b": 1000, "c": 1000}, 210) == {"a": 10, "b": 100, "c": 100}
    assert fair_shares({"a": 0, "b": 5}, 100) == {"a": 0, "b": 5}
    assert fair_shares({"a": 7, "b": 9}, None) == {"a": 7, "b": 9}
    assert sum(fair_shares({"a": 50, "b": 50, "c": 50}, 100).values()) <= 100


def test_ignores_temp_and_foreign_files_but_refuses_deep_nesting(tmp_path):
    generate(tmp_path, 1, 10, 5)
    (tmp_path / "_SUCCESS").write_text("")
    (tmp_path / ".events-000009.parquet.tmp").write_text("in progress")
    (tmp_path / "README.txt").write_text("not data")
    assert FileLog(tmp_path).cut(1, {}, None).records == 10
    (tmp_path / "a" / "b").mkdir(parents=True)
    pq.write_table(pa.table({"x": [1]}), tmp_path / "a" / "b" / "f.parquet")
    with pytest.raises(SourceError, match="one partition folder deep"):
        FileLog(tmp_path).partitions()


def test_removed_file_that_was_read_is_refused(tmp_path):
    generate(tmp_path, 2, 10, 5)
    log = FileLog(tmp_path)
    rng = log.cut(1, {}, None)
    (tmp_path / "events-000001.parquet").unlink()
    with pytest.raises(SourceError, match="no longer has 'events-000001.parquet'"):
        log.cut(2, rng.end, None)


def json_bytes(lines):
    return "".join(line + "\n" for line in lines).encode()


SCHEMA = pa.schema([("k", pa.string()), ("v", pa.int64())])


def test_json_decoding_bisects_to_the_bad_lines():
    lines = [f'{{"k": "a", "v": {i}}}' for i in range(1000)]
    lines[10] = "garbage"
    lines[777] = '{"k": "a", "v": "not a number"}'
    out = formats.decode_segment("json", json_bytes(lines), 0, 1000, SCHEMA, position_base=0)
    assert out.num_rows == 1000
    bad = out.filter(out.column("_volley_error").is_valid())
    assert sorted(bad.column("_volley_pos").to_pylist()) == [10, 777]
    good = out.filter(out.column("_volley_error").is_null())
    assert sorted(good.column("v").to_pylist()) == [i for i in range(1000) if i not in (10, 777)]


def test_json_segment_reads_exactly_its_lines_and_counts_an_unterminated_last_line():
    data = json_bytes([f'{{"k": "a", "v": {i}}}' for i in range(10)])[:-1]
    assert formats.count_records("json", data, whole_lines_only=False) == 10  # a file no longer written to
    assert formats.count_records("json", data) == 9  # the newest file: its last line may still grow
    out = formats.decode_segment("json", data, 3, 10, SCHEMA, position_base=5 << 40)
    assert out.column("v").to_pylist() == list(range(3, 10))
    assert (np.array(out.column("_volley_pos").to_pylist()) - (5 << 40)).tolist() == list(range(3, 10))


def test_parquet_segment_spanning_row_groups():
    buf = io.BytesIO()
    pq.write_table(pa.table({"k": ["x"] * 100, "v": list(range(100))}), buf, row_group_size=30)
    out = formats.decode_segment("parquet", buf.getvalue(), 25, 65, SCHEMA, position_base=0)
    assert out.column("v").to_pylist() == list(range(25, 65))
    assert out.column("_volley_pos").to_pylist() == list(range(25, 65))


def rewrite_same_size(path, old: bytes, new: bytes) -> None:
    """A writer that publishes a file again, whole and at the same size (a re-run after a
    crash that produced other values): a new inode, a new mtime, the same length."""
    data = path.read_bytes()
    assert len(old) == len(new) and old in data
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data.replace(old, new, 1))
    tmp.replace(path)


def test_a_file_rewritten_at_the_same_size_is_refused_by_name(tmp_path):
    pq.write_table(pa.table({"k": ["a"] * 10, "v": list(range(10, 20))}), tmp_path / "events-000000.parquet")
    log = FileLog(tmp_path, format="parquet")
    rng = log.cut(7, {}, None)
    log.verify(rng)  # unchanged: fine
    rewrite_same_size(tmp_path / "events-000000.parquet", b"PAR1", b"PAR1")  # the same bytes, published again
    with pytest.raises(SourceChangedError, match=r"epoch 7: source file \S+/events-000000\.parquet changed after the "
                                                 r"epoch was cut \(rewritten at the same size: version "):
        log.verify(rng)
    with pytest.raises(SourceChangedError, match=r"events-000000\.parquet was rewritten after it was listed"):
        log.read_segment(rng.segments[0], log.schema(), 7)  # what a read task does, without the driver's check


def test_a_json_lines_file_is_read_to_its_last_whole_line_and_may_grow_but_not_change(tmp_path):
    path = tmp_path / "events-000000.json"
    lines = [f'{{"k": "a", "v": {i}}}' for i in range(10, 20)]
    path.write_bytes(json_bytes(lines[:3]) + lines[3][:7].encode())  # a writer mid-line
    log = FileLog(tmp_path, format="json", schema=SCHEMA)
    first = log.cut(1, {}, None)
    assert first.records == 3 and log.available_records(first.end) == 0  # the partial line waits
    assert log.cut(1, {}, None, final=True).records == 4  # unless the stream ends, or a newer file follows
    path.write_bytes(json_bytes(lines))  # the writer finished, and appended more
    log.verify(first)
    assert log.read_segment(first.segments[0], SCHEMA, 1).column("v").to_pylist() == [10, 11, 12]
    second = log.cut(2, first.end, None)
    assert log.read_segment(second.segments[0], SCHEMA, 2).column("v").to_pylist() == list(range(13, 20))
    rewrite_same_size(path, b'"v": 11', b'"v": 99')  # a line already read, changed
    with pytest.raises(SourceChangedError, match=r"epoch 1: source file \S+/events-000000\.json changed after the "
                                                 r"epoch was cut \(rewritten: its first \d+ bytes, which hold records 0\.\.3"):
        log.read_segment(first.segments[0], SCHEMA, 1)
    path.write_bytes(json_bytes(lines[:2]))
    with pytest.raises(SourceChangedError, match="changed after the epoch was cut"):
        log.verify(first)  # shorter than what the range read


def test_an_object_re_put_at_the_same_size_is_refused_on_s3(seaweedfs):
    prefix = f"s3://{BUCKET}/reput-{uuid.uuid4().hex[:8]}"
    log = FileLog(prefix, format="json", schema=SCHEMA, storage_options=seaweedfs.s3.boto3_options())
    log.storage.write("events-000000.json", json_bytes([f'{{"k": "a", "v": {i}}}' for i in range(10, 20)]))
    rng = log.cut(3, {}, None)
    assert rng.segments[0].version  # the ETag
    log.storage.write("events-000000.json", json_bytes([f'{{"k": "a", "v": {i}}}' for i in range(20, 30)]))
    with pytest.raises(SourceChangedError, match=r"epoch 3: source file s3://\S+/events-000000\.json changed after "
                                                 r"the epoch was cut \(rewritten: its first \d+ bytes"):
        log.read_segment(rng.segments[0], SCHEMA, 3)  # a JSON-lines range pins its bytes: never the new ones


def test_an_s3_outage_while_reading_the_source_is_retried_and_a_missing_bucket_is_not(seaweedfs):
    """Connection refused (the S3 endpoint down) is an outage: retried with backoff. A
    bucket that does not exist is the source's answer: named, permanent."""
    prefix = f"s3://{BUCKET}/outage-{uuid.uuid4().hex[:8]}"
    up = FileLog(prefix, format="json", schema=SCHEMA, storage_options=seaweedfs.s3.boto3_options())
    up.storage.write("events-000000.json", json_bytes([f'{{"k": "a", "v": {i}}}' for i in range(5)]))
    rng = up.cut(1, {}, None)
    down_options = {**seaweedfs.s3.boto3_options(), "endpoint_url": f"http://127.0.0.1:{free_port()}"}  # nothing listens
    down = FileLog(prefix, format="json", schema=SCHEMA, storage_options=down_options)
    for call, what in ((lambda: down.cut(1, {}, None), "cannot list"), (lambda: down.verify(rng), "cannot stat"),
                       (lambda: down.read_segment(rng.segments[0], SCHEMA, 1), "cannot read")):
        with pytest.raises(SourceUnavailableError, match=rf"{what} s3://\S+: S3 is unreachable or overloaded") as err:
            call()
        assert is_retryable(err.value)
    missing = FileLog(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/x", format="json", schema=SCHEMA,
                      storage_options=seaweedfs.s3.boto3_options())
    with pytest.raises(SourceError, match="cannot list s3://no-such-bucket-") as err:
        missing.cut(1, {}, None)
    assert not is_retryable(err.value)


def test_a_file_removed_while_listing_is_skipped_not_fatal(tmp_path):
    generate(tmp_path, 1, 10, 5)
    log = FileLog(tmp_path)
    doomed = [tmp_path / f".doomed-{i}" for i in range(200)]
    for p in doomed:
        p.write_text("x")
    stop = threading.Event()

    def churn() -> None:  # files appear and vanish the whole time the log is listed
        while not stop.is_set():
            for p in doomed:
                p.unlink(missing_ok=True)
            for p in doomed:
                p.write_text("x")

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        for _ in range(50):
            assert log.cut(1, {}, None).records == 10
    finally:
        stop.set()
        thread.join()


def _two_partitions(log: FileLog, files: int) -> None:
    for part in ("a", "b"):
        for i in range(files):
            buf = io.BytesIO()
            pq.write_table(pa.table({"k": [f"{part}{i}", f"{part}{i}"], "v": [i, i]}), buf)
            log.storage.write(f"{part}/f-{i:04d}.parquet", buf.getvalue())


def _land_before(log: FileLog, part: str, name: str) -> None:
    buf = io.BytesIO()
    pq.write_table(pa.table({"k": ["late"], "v": [0]}), buf)
    log.storage.write(f"{part}/{name}", buf.getvalue())


def test_a_cut_lists_a_partition_from_its_last_file_read_and_still_refuses_a_file_landing_before_it(tmp_path):
    """A log read to file 40 of 50 stats 10 files per listing, not 50, and cuts the same
    range a whole listing cuts; the names before the mark are still counted locally."""
    log = FileLog(tmp_path)
    _two_partitions(log, 50)
    first = log.cut(1, {}, 160)  # 80 records per partition: files 0..39
    assert first.end == {"a": Position("f-0039.parquet", 39, 2), "b": Position("f-0039.parquet", 39, 2)}
    listing = log.storage.list({"a": "f-0039.parquet", "b": "f-0039.parquet"})
    assert [f.path for f in listing.files][:2] == ["a/f-0039.parquet", "a/f-0040.parquet"]
    assert len(listing.files) == 22 and {k: len(v or []) for k, v in listing.earlier.items()} == {"a": 39, "b": 39}
    second = log.cut(2, first.end, None)
    whole = log.cut(FULL_LISTING_EVERY, first.end, None)
    assert second.segments == whole.segments and second.end == whole.end
    assert second.records == 40 and log.backlog(first.end).records == 40 and log.backlog(second.end).records == 0
    _land_before(log, "b", "f-0000a.parquet")
    with pytest.raises(SourceError, match=r"partition 'b' has 1 new file\(s\) sorting before 'f-0049.parquet'"):
        log.cut(3, second.end, None)


def test_on_s3_a_cut_lists_from_the_last_file_read_and_every_full_listing_finds_a_file_landing_before_it(seaweedfs):
    """S3 lists a partition from its mark (StartAfter), which cannot see an earlier
    name: a file landing before it is refused at the next whole listing, named."""
    log = FileLog(f"s3://{BUCKET}/tail-{uuid.uuid4().hex[:8]}", storage_options=seaweedfs.s3.boto3_options())
    _two_partitions(log, 6)
    first = log.cut(1, {}, 8)
    listing = log.storage.list({"a": first.end["a"].file, "b": first.end["b"].file})
    assert [f.path for f in listing.files] == ["a/f-0001.parquet", *[f"a/f-{i:04d}.parquet" for i in range(2, 6)],
                                               "b/f-0001.parquet", *[f"b/f-{i:04d}.parquet" for i in range(2, 6)]]
    assert listing.earlier == {"a": None, "b": None}
    second = log.cut(2, first.end, None)
    assert second.segments == log.cut(FULL_LISTING_EVERY, first.end, None).segments and second.records == 16
    _land_before(log, "a", "f-0000a.parquet")
    assert log.cut(3, second.end, None).records == 0  # not seen from the mark
    with pytest.raises(SourceError, match=r"partition 'a' has 1 new file\(s\) sorting before 'f-0005.parquet'"):
        log.cut(2 * FULL_LISTING_EVERY, second.end, None)
    log.storage.client.delete_object(Bucket=BUCKET, Key=log.storage._key("a/f-0005.parquet"))
    with pytest.raises(SourceError, match=r"partition 'a' (no longer has 'f-0005.parquet'|was read before and has)"):
        log.cut(4, second.end, None)


def test_a_parquet_footer_gives_null_counts_and_the_utc_time_range_spark_reads(tmp_path):
    """Per row group, combined over those a range of rows touches (the whole file: exact);
    a timestamp in microseconds whatever its stored unit, and only where Spark reads the
    stored value as it is (UTC-adjusted milli- or microseconds): never local (NTZ) or
    nanosecond times, nor a legacy Spark file's."""
    us = [1_767_225_600_123_456, None, 1_767_225_599_000_001, 1_767_225_700_000_000, 5]
    table = pa.table({
        "key": pa.array([3, None, 1, None, 2], pa.int64()),
        "us": pa.array(us, pa.timestamp("us", tz="UTC")),
        "ms": pa.array([None if v is None else v // 1000 for v in us], pa.timestamp("ms", tz="UTC")),
        "ntz": pa.array(us, pa.timestamp("us")),
        "ns": pa.array([None if v is None else v * 1000 for v in us], pa.timestamp("ns", tz="UTC")),
        "nested": pa.array([{"t": 1}] * 5),
        "text": pa.array(["a", "b", None, "d", "e"]),
    })
    pq.write_table(table, tmp_path / "f.parquet", row_group_size=2)
    with pq.ParquetFile(tmp_path / "f.parquet") as footer:
        file = NativeParquetFile("f.parquet", 5, formats.parquet_statistics(footer))
    assert [(g.start, g.end) for g in file.row_groups] == [(0, 2), (2, 4), (4, 5)]
    stats = file.statistics(0, 5)
    assert set(stats) == {"key", "us", "ms", "ntz", "ns", "text"}  # "nested.t" is not a column
    valid = [v for v in us if v is not None]
    assert (stats["key"].nulls, stats["text"].nulls, stats["us"].nulls) == (2, 1, 1)
    assert (stats["us"].earliest_us, stats["us"].latest_us) == (min(valid), max(valid))
    assert (stats["ms"].earliest_us, stats["ms"].latest_us) == (min(valid) // 1000 * 1000, max(valid) // 1000 * 1000)
    assert (stats["ntz"].nulls, stats["ntz"].earliest_us, stats["ntz"].latest_us) == (1, None, None)
    assert (stats["ns"].earliest_us, stats["ns"].latest_us, stats["key"].latest_us) == (None, None, None)
    # rows 3..4 touch the second and third row groups (rows 2..4): bounds of them, from those groups
    part = file.statistics(3, 5)
    assert (part["key"].nulls, part["us"].nulls, part["us"].earliest_us, part["us"].latest_us) == (1, 0, us[4], us[3])
    assert file.statistics(0, 1)["us"] == file.row_groups[0].columns["us"]
    # a range of rows' times exactly, where the footers only bound them: read
    located = NativeParquetFile(str(tmp_path / "f.parquet"), 5, file.row_groups)
    for start, end in [(0, 5), (0, 1), (1, 3), (2, 3), (3, 5), (4, 5), (1, 2)]:
        rows = [v for v in us[start:end] if v is not None]
        expected = (us[start:end].count(None), min(rows) if rows else None, max(rows) if rows else None)
        got, ms = located.time_statistics("us", start, end), located.time_statistics("ms", start, end)
        assert (got.nulls, got.earliest_us, got.latest_us) == expected, (start, end)
        assert (ms.nulls, ms.latest_us) == (expected[0], None if not rows else expected[2] // 1000 * 1000)
    exact, bound = located.time_statistics("us", 2, 3), file.statistics(2, 3)["us"]  # the group of rows 2..3
    assert (exact.earliest_us, exact.latest_us) == (us[2], us[2]) and bound.latest_us == us[3] > us[2]

    pq.write_table(table, tmp_path / "plain.parquet", write_statistics=False)
    legacy = table.replace_schema_metadata({"org.apache.spark.legacyDateTime": ""})
    pq.write_table(legacy, tmp_path / "legacy.parquet")
    with pq.ParquetFile(tmp_path / "plain.parquet") as plain, pq.ParquetFile(tmp_path / "legacy.parquet") as old:
        plain_stats = NativeParquetFile("plain", 5, formats.parquet_statistics(plain)).statistics(0, 5)
        old_stats = NativeParquetFile("legacy", 5, formats.parquet_statistics(old)).statistics(0, 5)
    assert plain_stats["us"] == plain_stats["key"] and plain_stats["us"].nulls is None
    assert (old_stats["us"].nulls, old_stats["us"].latest_us) == (1, None)
