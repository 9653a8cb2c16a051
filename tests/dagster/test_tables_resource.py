"""The tables resource builds the Iceberg catalog as pyiceberg loads one: from the
properties the user gives (any catalog type), on SQLite and on a real PostgreSQL."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyiceberg.catalog import load_catalog

from harness.postgres import Postgres
from tests.sinks.commit_worker import epoch_output
from tests.sinks.helpers import ROWS, ctx
from volley_dagster.dagster.resources import S3Resource, TablesResource
from volley_dagster.sinks.iceberg import IcebergSink

TABLE = "volley.changes"


def commit_through_the_resource(tmp_path: Path, uri: str) -> None:
    props = {"type": "sql", "uri": uri, "warehouse": (tmp_path / "warehouse").as_uri()}
    settings = TablesResource(warehouse=str(tmp_path / "tables"), iceberg_catalog_properties=props).settings()
    assert settings.iceberg_catalog == props  # as given: nothing of the embedded default mixed in
    assert settings.iceberg_catalog is not None
    for epoch in (1, 2):
        assert IcebergSink(TABLE, settings.iceberg_catalog).commit(epoch_output(epoch, ROWS), ctx(epoch)).rows == ROWS
    table = load_catalog("volley", **props).load_table(TABLE)  # the user's own view of their catalog
    assert table.properties["volley.payments.iceberg.epoch"] == "2"
    assert table.scan().to_arrow().num_rows == 2 * ROWS


def test_an_iceberg_catalog_from_properties_on_sqlite(tmp_path: Path) -> None:
    commit_through_the_resource(tmp_path, f"sqlite:///{tmp_path / 'catalog.db'}")


def test_an_iceberg_catalog_from_properties_on_postgresql(tmp_path: Path, postgres: Postgres) -> None:
    commit_through_the_resource(tmp_path, postgres.sqlalchemy_uri(postgres.create_database("tables_resource")))


def test_any_catalog_type_reaches_pyiceberg_unchanged_and_s3_settings_only_fill_in(tmp_path: Path) -> None:
    """A REST catalog's properties go to ``load_catalog`` as given; the S3 endpoint's
    properties fill in what the user did not set, never replace it."""
    rest = {"type": "rest", "uri": "https://catalog.example/api", "warehouse": "analytics", "s3.region": "eu-west-1"}
    s3 = S3Resource(endpoint_url="http://127.0.0.1:9", access_key_id="k", secret_access_key="s", region="us-east-1")
    catalog = TablesResource(warehouse="s3://bucket/tables", iceberg_catalog_properties=rest, s3=s3).settings().iceberg_catalog
    assert catalog is not None
    assert {k: catalog[k] for k in rest} == rest
    assert catalog["s3.endpoint"] == "http://127.0.0.1:9"


def test_two_ways_to_name_the_catalog_or_none_for_an_s3_warehouse_are_refused() -> None:
    both = TablesResource(warehouse="/w", iceberg_catalog_uri="sqlite:////tmp/c.db",
                          iceberg_catalog_properties={"type": "sql", "uri": "sqlite:////tmp/c.db"})
    with pytest.raises(ValueError, match="not both"):
        both.settings()
    with pytest.raises(ValueError, match="SQLite catalog file must be local"):
        TablesResource(warehouse="s3://bucket/tables").settings()
