"""The public API recorded: every name ``volley_dagster`` and ``volley_dagster.dagster``
export, with its signature (a class's constructor), must equal ``tests/public_api.txt``.
Changing it is a deliberate act: regenerate the record with
``.venv/bin/python -m tests.test_public_api > tests/public_api.txt``, keep the old names
working through a deprecation, and list the change in ``CHANGELOG.md``. The deprecated
keywords and attributes still work, with a warning that names their replacement."""

from __future__ import annotations

import importlib
import inspect
import warnings
from pathlib import Path

import pytest

from volley_dagster.result import EpochResult
from volley_dagster.settings import RunSettings, with_runner_keywords

RECORD = Path(__file__).with_name("public_api.txt")
MODULES = ("volley_dagster", "volley_dagster.dagster")


def described(obj: object) -> str:
    kind = "class" if inspect.isclass(obj) else "function" if callable(obj) else type(obj).__name__
    try:
        signature = str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        signature = ""
    return f"{kind}{signature}"


def members(cls: type) -> list[tuple[str, str]]:
    """A class's own public methods and properties (not those of Exception or pydantic)."""
    out = []
    for attr, value in sorted(vars(cls).items()):
        if attr.startswith("_"):
            continue
        if isinstance(value, property):
            out.append((attr, "property"))
        elif isinstance(value, (staticmethod, classmethod)) or inspect.isfunction(value):
            out.append((attr, described(getattr(cls, attr))))
    return out


def public_api() -> list[str]:
    lines = []
    for name in MODULES:
        module = importlib.import_module(name)
        for export in sorted(module.__all__):
            obj = getattr(module, export)
            lines.append(f"{name}.{export}: {described(obj)}")
            if inspect.isclass(obj) and obj.__module__.startswith("volley_dagster"):
                lines += [f"{name}.{export}.{attr}: {kind}" for attr, kind in members(obj)]
    return lines


def test_the_public_api_is_what_was_recorded():
    recorded = RECORD.read_text().splitlines()
    now = public_api()
    assert now == recorded, ("the public API changed: keep the old names working through a deprecation, list it in "
                             "CHANGELOG.md, then regenerate tests/public_api.txt (python -m tests.test_public_api)\n"
                             f"gone or changed: {sorted(set(recorded) - set(now))}\nnew: {sorted(set(now) - set(recorded))}")


def test_the_runner_keywords_before_run_settings_still_work_with_a_warning():
    with pytest.warns(DeprecationWarning, match=r"settings=RunSettings\(keep_epochs=\.\.\., max_records_per_epoch="):
        settings = with_runner_keywords(None, {"max_records_per_epoch": 500, "keep_epochs": 5})
    assert settings == RunSettings(max_records_per_epoch=500, keep_epochs=5, resident_state=settings.resident_state)
    with pytest.warns(DeprecationWarning):
        assert with_runner_keywords(RunSettings(keep_epochs=4), {"resident_state": False}) == \
            RunSettings(keep_epochs=4, resident_state=None)
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_records'"):
        with_runner_keywords(None, {"max_records": 5})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert with_runner_keywords(RunSettings(keep_epochs=2), {}) == RunSettings(keep_epochs=2)


def test_the_result_figures_that_were_attributes_still_read_with_a_warning():
    result = EpochResult("p", 1, {}, 10, 10, 0, 8, 8, 8, 0, 0, {}, {}, {}, figures={"duplicates": 2, "keys_expired": 1})
    with pytest.warns(DeprecationWarning, match=r"figures\['duplicates'\]"):
        assert result.duplicates == 2
    with pytest.warns(DeprecationWarning):
        assert (result.keys_expired, result.dedup_late) == (1, 0)


if __name__ == "__main__":
    print("\n".join(public_api()))
