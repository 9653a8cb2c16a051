"""The wheel of this checkout, built as a user's ``uv build`` would from a copy of the
sources (the checkout gets no ``build/``), for the tests that install or read it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def uv() -> Path:
    """uv beside this interpreter: ./dev installs it; fails loudly, never skips, without it."""
    path = Path(sys.executable).with_name("uv")
    assert path.exists(), f"uv is not in the venv ({path}): ./dev installs it; the wheel is built with it"
    return path


def build_wheel(tmp_path: Path) -> Path:
    source = tmp_path / "src"
    source.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "volley_dagster", source / "volley_dagster",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    built = subprocess.run([str(uv()), "build", "--wheel", "--quiet", "--out-dir", str(tmp_path / "dist"), str(source)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("volley_dagster-*.whl")
    return wheel
