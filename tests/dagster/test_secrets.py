"""Secrets stay out of what Dagster stores and shows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_catalog_uri_reaches_dagster_as_an_env_var_name_only():
    """The Iceberg catalog URI may hold a PostgreSQL password: the code location's
    resource config holds the variable's name, which is what the UI shows."""
    code = ("from definitions import defs; r = defs.resources['volley_tables']; "
            "print(type(r.iceberg_catalog_uri).__name__, r._get_non_default_public_field_values())")
    env = {**os.environ, "VOLLEY_ICEBERG_CATALOG_URI": "postgresql+psycopg2://volley:s3cret@127.0.0.1:5/volley"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("EnvVar ") and "'iceberg_catalog_uri': 'VOLLEY_ICEBERG_CATALOG_URI'" in out.stdout
    assert "s3cret" not in out.stdout
