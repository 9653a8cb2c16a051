"""Several sources in one epoch: one recorded range of every source, shared fairly,
read back exactly, each source checking and reading its own part. No Spark."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from volley_dagster.demo.events import generate
from volley_dagster.errors import (
    ConfigError,
    SourceChangedError,
    SourceError,
    SourceNotReadyError,
    SourceUnavailableError,
)
from volley_dagster.sources.file_log import FileLog
from volley_dagster.sources.multi import MultiSource
from volley_dagster.sources.offsets import EpochRange, Position


def two_logs(tmp_path, web_files: int = 3, store_files: int = 1) -> MultiSource:
    generate(tmp_path / "web", web_files, 100, 10)
    generate(tmp_path / "store", store_files, 100, 10, seed=8)
    return MultiSource({"web": FileLog(tmp_path / "web"), "store": FileLog(tmp_path / "store")}, source_column="channel")


def test_each_cut_records_a_range_of_every_source_shared_fairly(tmp_path):
    sources = two_logs(tmp_path)
    first = sources.cut(1, {}, 250)  # web has 300 waiting, store 100: store takes all, web the rest
    by_source = {name: sources.range_of(name, first) for name in ("web", "store")}
    assert (by_source["web"].records, by_source["store"].records) == (150, 100)
    assert [s.id for s in first.segments] == list(range(len(first.segments)))  # positions tell every segment apart
    assert first.end == {"web/": Position("events-000001.parquet", 1, 50), "store/": Position("events-000000.parquet", 0, 100)}
    assert EpochRange.from_dict(first.to_dict()) == first  # offsets.json holds both
    second = sources.cut(2, first.end, 1_000)
    assert sources.range_of("web", second).records == 150 and sources.range_of("store", second).records == 0
    assert sources.cut(3, second.end, 1_000).records == 0
    generate(tmp_path / "store", 1, 100, 10, first_file=1, seed=8)  # one source moves on alone
    third = sources.cut(3, second.end, 1_000)
    assert {s.partition for s in third.segments} == {"store/"} and third.records == 100
    assert sources.backlog(second.end).records == 100 and sources.backlog(second.end).parts["web"].records == 0


def test_a_segment_is_read_by_its_source_in_the_columns_of_all(tmp_path):
    generate(tmp_path / "web", 1, 50, 10)
    pq.write_table(pa.table({"merchant_id": pa.array([1, 2], pa.int64()), "refund": [3.5, 4.5]}),
                   tmp_path / "refunds.parquet")
    (tmp_path / "store").mkdir()
    (tmp_path / "refunds.parquet").rename(tmp_path / "store" / "refunds-000000.parquet")
    sources = MultiSource({"web": FileLog(tmp_path / "web"), "store": FileLog(tmp_path / "store")},
                          source_column="channel")
    schema = sources.schema()
    assert schema.names[-2:] == ["refund", "channel"] and "amount" in schema.names
    rng = sources.cut(1, {}, None)
    store = next(s for s in rng.segments if s.partition == "store/")
    table = sources.read_segment(store, schema, 1)
    assert table.column_names[:len(schema)] == schema.names
    assert table.column("refund").to_pylist() == [3.5, 4.5] and table.column("amount").null_count == 2
    assert set(table.column("channel").to_pylist()) == {"store"}
    positions = table.column("_volley_pos").to_pylist()
    assert rng.where_in_log(pa.array(positions))[1].to_pylist() == ["refunds-000000.parquet"] * 2
    web = sources.read_segment(next(s for s in rng.segments if s.partition == "web/"), schema, 1)
    assert pc.all(pc.is_null(web.column("refund"))).as_py() and web.num_rows == 50


def test_a_changed_file_in_one_source_is_named_by_that_source(tmp_path):
    sources = two_logs(tmp_path)
    rng = sources.cut(1, {}, None)
    pq.write_table(pq.read_table(tmp_path / "store" / "events-000000.parquet").slice(0, 10),
                   tmp_path / "store" / "events-000000.parquet")
    with pytest.raises(SourceChangedError, match="store/events-000000.parquet"):
        sources.verify(rng)


def test_sources_that_cannot_be_read_as_one_are_refused_by_name(tmp_path):
    generate(tmp_path / "web", 1, 10, 5)
    (tmp_path / "store").mkdir()
    pq.write_table(pa.table({"amount": ["ten"]}), tmp_path / "store" / "x-000000.parquet")
    both = MultiSource({"web": FileLog(tmp_path / "web"), "store": FileLog(tmp_path / "store")})
    with pytest.raises(ConfigError, match="'amount' is double in source 'web' and string in source 'store'"):
        both.schema()
    with pytest.raises(ConfigError, match="two or more"):
        MultiSource({"web": FileLog(tmp_path / "web")})
    with pytest.raises(ConfigError, match="source name 'we/b'"):
        MultiSource({"we/b": FileLog(tmp_path / "web"), "store": FileLog(tmp_path / "store")})
    with pytest.raises(ConfigError, match="source_column 'amount' is already a column of source 'web'"):
        MultiSource({"web": FileLog(tmp_path / "web"), "other": FileLog(tmp_path / "web")}, "amount").schema()
    with pytest.raises(SourceError, match="names no source"):
        both.cut(2, {"": Position("events-000000.parquet", 0, 10)}, None)  # a single source's positions


def test_a_source_with_no_files_yet_holds_the_cut_until_its_first_file_lands(tmp_path):
    """Review M1: a source with no files (and no schema=) has no columns yet; the pipeline
    cuts nothing until it has, then reads both from their starts (the error, were a run
    to meet it, is transient: retried, never a stop)."""
    generate(tmp_path / "web", 2, 100, 10)
    (tmp_path / "store").mkdir()
    sources = MultiSource({"web": FileLog(tmp_path / "web"), "store": FileLog(tmp_path / "store")})
    assert sources.waiting_for() == ["store"]
    with pytest.raises(SourceNotReadyError, match="no parquet files yet") as no_schema:
        sources.schema()
    assert isinstance(no_schema.value, SourceUnavailableError)
    empty = sources.cut(1, {}, 1_000)
    assert empty.records == 0 and not empty.segments
    assert sources.backlog(empty.end).parts["web"].records == 200  # what waits still shows
    generate(tmp_path / "store", 1, 100, 10, seed=8)
    first = sources.cut(1, empty.end, 1_000)
    assert (sources.range_of("web", first).records, sources.range_of("store", first).records) == (200, 100)
    assert "amount" in sources.schema().names


def test_a_column_one_source_lacks_is_nullable_in_the_merged_schema(tmp_path):
    """Review M2: a column declared non-nullable (Parquet ``required``) in one source and
    absent from the other is nullable in the merged schema, which the other's rows fill
    with nulls; one non-nullable in every source stays so."""
    for name, table in (("a", pa.table({"k": pa.array([1], pa.int64()), "amount": pa.array([5], pa.int64())},
                                       schema=pa.schema([pa.field("k", pa.int64(), nullable=False),
                                                         pa.field("amount", pa.int64(), nullable=False)]))),
                        ("b", pa.table({"k": pa.array([2], pa.int64())},
                                       schema=pa.schema([pa.field("k", pa.int64(), nullable=False)])))):
        (tmp_path / name).mkdir()
        pq.write_table(table, tmp_path / name / "events-000000.parquet")
    sources = MultiSource({"a": FileLog(tmp_path / "a"), "b": FileLog(tmp_path / "b")})
    schema = sources.schema()
    assert schema.field("amount").nullable and not schema.field("k").nullable
    rng = sources.cut(1, {}, None)
    b = sources.read_segment(next(s for s in rng.segments if s.partition == "b/"), schema, 1)
    assert b.column("amount").to_pylist() == [None]


def test_a_source_added_to_a_running_pipeline_is_read_from_its_start(tmp_path):
    """Review M3, as the docs now say: a source added after epochs were cut is read from
    its start, within the cut's fair share; a source removed is refused by name."""
    generate(tmp_path / "web", 2, 100, 10)
    generate(tmp_path / "store", 2, 100, 10, seed=8)
    first = FileLog(tmp_path / "web").cut(1, {}, None)
    positions = {f"web/{p}": pos for p, pos in first.end.items()}
    both = MultiSource({"web": FileLog(tmp_path / "web"), "store": FileLog(tmp_path / "store")})
    second = both.cut(2, positions, 150)
    assert both.range_of("store", second).records == 150 and both.range_of("web", second).records == 0
    assert both.range_of("store", second).segments[0].start == 0
    with pytest.raises(SourceError, match="names no source of"):
        MultiSource({"store": FileLog(tmp_path / "store"), "mall": FileLog(tmp_path / "web")}).cut(3, second.end, 10)
