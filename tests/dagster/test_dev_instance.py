"""``./dev dagster`` respects the user's instance: an existing ``dagster.yaml`` it did
not write is never overwritten; it says what the pipelines need and stops."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dev_dagster_never_overwrites_a_users_dagster_yaml(tmp_path: Path) -> None:
    home = tmp_path / "their_instance"
    home.mkdir()
    theirs = "storage:\n  postgres:\n    postgres_url: postgresql://dagster@db/dagster\ntelemetry:\n  enabled: true\n"
    (home / "dagster.yaml").write_text(theirs)
    out = subprocess.run([str(ROOT / "dev"), "dagster"], env={**os.environ, "DAGSTER_HOME": str(home)},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    assert (home / "dagster.yaml").read_text() == theirs
    assert sorted(p.name for p in home.iterdir()) == ["dagster.yaml"]  # nothing else written there either
    assert f"{home / 'dagster.yaml'} is not the one this project installed" in out.stderr
    assert "+run_launcher:" in out.stderr and "-  postgres:" in out.stderr  # what to add, against what they have
