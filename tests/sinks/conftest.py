"""Per-test views of the session's SeaweedFS and PostgreSQL (tests/conftest.py):
fresh prefixes, databases and catalogs. Missing server binaries fail the tests
with the install command; nothing is skipped."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from harness.postgres import Postgres
from harness.seaweedfs import SeaweedFS
from tests.conftest import BUCKET
from volley_dagster.io.s3 import S3Endpoint


@pytest.fixture
def s3(seaweedfs: SeaweedFS) -> S3Endpoint:
    return seaweedfs.s3


@pytest.fixture
def s3_prefix(seaweedfs: SeaweedFS) -> str:
    """A fresh prefix in the session's bucket, so tests never share a table."""
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"


@pytest.fixture
def pg_database(postgres: Postgres) -> str:
    """A fresh database for one test's Iceberg catalog: its SQLAlchemy URI."""
    return postgres.sqlalchemy_uri(postgres.create_database(f"cat_{uuid.uuid4().hex[:12]}"))


@pytest.fixture
def iceberg_catalog(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, str]:
    """Catalog properties for ``"<catalog>-<storage>"`` (indirect parametrisation):
    catalog ``sqlite`` or ``postgres``, warehouse ``local`` or ``s3``."""
    catalog, storage = request.param.split("-")
    if catalog == "sqlite":
        props = {"type": "sql", "uri": f"sqlite:///{tmp_path / 'catalog.db'}"}
    else:
        props = {"type": "sql", "uri": request.getfixturevalue("pg_database")}
    if storage == "local":
        props["warehouse"] = (tmp_path / "warehouse").as_uri()
    else:
        server: SeaweedFS = request.getfixturevalue("seaweedfs")
        props["warehouse"] = request.getfixturevalue("s3_prefix") + "/warehouse"
        props.update(server.s3.iceberg_properties())
    return props
