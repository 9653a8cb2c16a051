"""What a company checks before adopting the package: a license (Apache-2.0, the text and
the metadata), classifiers and project URLs, ``py.typed`` and ``__version__``, the extra
holding what the docs read the tables with, and Java 17 stated where the README speaks
to a team's project. The wheel is built (from a copy of the sources, so the checkout
gets no ``build/``) and its contents read."""

from __future__ import annotations

import re
import sys
import zipfile
from email.parser import Parser
from importlib.metadata import metadata, version
from pathlib import Path

import pytest

import volley_dagster
from tests.adoption.wheel import build_wheel

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]


def test_the_license_is_apache_2_in_full_and_in_the_metadata() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text and "APPENDIX: How to apply the Apache License" in text
    assert len(re.findall(r"^\s+\d\. ", text, re.M)) == 9  # the nine sections, 1 to 9
    assert PROJECT["license"] == "Apache-2.0" and PROJECT["license-files"] == ["LICENSE"]
    assert metadata("volley-dagster")["License-Expression"] == "Apache-2.0"  # the installed package's


def test_the_metadata_has_authors_classifiers_and_urls() -> None:
    assert PROJECT["authors"] == [{"name": "volley-dagster developers"}]
    classifiers = PROJECT["classifiers"]
    assert "Typing :: Typed" in classifiers and "Programming Language :: Python :: 3.10" in classifiers
    assert not [c for c in classifiers if c.startswith("License ::")]  # PEP 639: the expression says it
    assert {"Homepage", "Changelog"} <= set(PROJECT["urls"])


def test_the_version_is_the_distributions_and_a_checkout_reads_pyproject(monkeypatch: pytest.MonkeyPatch) -> None:
    assert volley_dagster.__version__ == version("volley-dagster") == PROJECT["version"]
    import importlib.metadata

    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert volley_dagster._version() == PROJECT["version"]


def test_py_typed_ships_and_the_docs_extra_holds_dagster_deltalake() -> None:
    assert (ROOT / "volley_dagster" / "py.typed").exists()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["volley_dagster"]
    extras = PROJECT["optional-dependencies"]
    assert [r for r in extras["dagster"] if r.startswith("dagster-deltalake")]
    assert "dagster" in re.search(r"\[(.*)\]", extras["test"][0]).group(1).split(",")  # type: ignore[union-attr]


def test_the_readme_says_java_17_where_it_speaks_to_a_teams_project() -> None:
    readme = (ROOT / "README.md").read_text()
    team = readme[readme.index("**In your own Dagster project**"):readme.index("## Running unattended")]
    assert "Java 17" in team and "volley dagster-instance" in team and "volley-dagster[dagster]" in team


def test_the_wheel_carries_the_license_py_typed_and_metadata(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(zf.read(info).decode())
    assert "volley_dagster/py.typed" in names and "volley_dagster/spark/log4j2.properties" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "volley_dagster/dagster/instance.py" in names and not [n for n in names if n.startswith(("tests/", "assets/"))]
    assert meta["License-Expression"] == "Apache-2.0" and meta["Author"] == "volley-dagster developers"
    assert "Typing :: Typed" in meta.get_all("Classifier")
    assert 'dagster-deltalake<1,>=0.25; extra == "dagster"' in meta.get_all("Requires-Dist")
    assert any(url.startswith("Homepage, ") for url in meta.get_all("Project-URL"))
