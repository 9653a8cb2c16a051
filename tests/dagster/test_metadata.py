"""What the UI shows per epoch survives what records can hold: an event time past
year 9999 or before year 1 (one bad record moves the watermark there) is shown as
its number, not an exception that fails the run after its epoch committed."""

from __future__ import annotations

from dagster import TimestampMetadataValue

from volley_dagster import EpochResult
from volley_dagster.dagster.keys import PipelineKeys
from volley_dagster.dagster.metadata import epoch_metadata
from volley_dagster.demo.payments import local_tables, merchant_minutes_pipeline
from volley_dagster.operators.event_time import describe_event_time


def test_watermarks_beyond_what_datetime_holds_are_shown_as_numbers(tmp_path):
    pipeline = merchant_minutes_pipeline(tmp_path / "events", local_tables(tmp_path / "tables"))
    assert describe_event_time(1_767_225_600_000_000) == "2026-01-01T00:00:00+00:00"
    keys = PipelineKeys(pipeline.name)
    for micros in (1_767_225_600_000_000, 10**18, -(10**17)):  # 2026, and years about 33658 and -1199
        result = EpochResult(pipeline="merchant_minutes", epoch=4, range={}, records_in=1, records_aggregated=1,
                             dead_letters=0, records_out=0, keys_touched=1, new_keys=0, state_bytes=0,
                             state_bytes_written=0, shards={}, sinks={}, durations={"total": 1.0}, watermark=micros)
        shown = epoch_metadata(keys, pipeline, result)[keys.state]["watermark"]
        if micros == 1_767_225_600_000_000:  # a timestamp the UI shows in the viewer's zone
            assert isinstance(shown, TimestampMetadataValue) and shown.value == 1_767_225_600.0
        else:
            assert shown.value == f"{micros} microseconds since 1970-01-01T00:00:00+00:00"
