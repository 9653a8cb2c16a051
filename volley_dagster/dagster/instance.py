"""The Dagster instance settings a deployment needs, shipped with the package: the
``dagster.yaml`` sections that give each pipeline one run at a time and heal a killed
run with no person. ``volley dagster-instance`` prints them; ``--merge PATH`` writes
them into an existing ``dagster.yaml``, keeping every other key. The sensor's
``instance_settings`` check names what an instance lacks
(``volley_dagster/dagster/runs.instance_problems``).

This repository's own ``dagster.yaml`` holds them (``tests/adoption/test_instance_settings.py``)."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]  # no stubs among the dependencies

from volley_dagster.errors import ConfigError
from volley_dagster.json_records import JsonObject

WARM_LAUNCHER = {"module": "volley_dagster.dagster.launcher", "class": "WarmRunLauncher"}
QUEUED_COORDINATOR = {"module": "dagster.core.run_coordinator", "class": "QueuedRunCoordinator"}

# What each section is for, printed above it (and above a section --merge rewrites).
_WHY = {
    "run_launcher": """\
Runs start as workers forked from a fork server that has Dagster, PySpark and the code
location imported (about 0.1 s instead of 2.5 s); a worker killed with kill -9 or by the
OOM killer is marked failed at once. Optional: any launcher works (Kubernetes, Docker).""",
    "run_coordinator": """\
Runs wait in a queue until their pool admits them (dequeued every second).""",
    "concurrency": """\
One run per pipeline at a time: every run that runs epochs or rescales a pipeline is in
its pool volley_<pipeline>, and each pool admits one run; the others stay queued.""",
    "run_monitoring": """\
A run whose process died is marked failed, and its pool slot freed, so it is retried.""",
    "run_retries": """\
A run that failed because its process died is run again over the same epochs. A failed
epoch is retried inside its run; bad input fails once and is not retried.""",
}


def instance_settings(warm_launcher: bool = False) -> dict[str, Any]:  # public: its signature is recorded
    """The ``dagster.yaml`` sections a deployment needs, as a mapping. ``warm_launcher``:
    also this package's run launcher (``volley_dagster.dagster.launcher.WarmRunLauncher``,
    for runs on the machine of the daemon); without it, the instance keeps its own."""
    monitoring: JsonObject = {"enabled": True, "poll_interval_seconds": 10}
    if warm_launcher:  # a forked worker says its pid within a second: a run that never did was killed
        monitoring["start_timeout_seconds"] = 90
    monitoring["free_slots_after_run_end_seconds"] = 10
    settings: JsonObject = {"run_launcher": dict(WARM_LAUNCHER)} if warm_launcher else {}
    settings.update({
        "run_coordinator": {**QUEUED_COORDINATOR, "config": {"dequeue_interval_seconds": 1}},
        "concurrency": {"pools": {"granularity": "run", "default_limit": 1}},
        "run_monitoring": monitoring,
        "run_retries": {"enabled": True, "max_retries": 3, "retry_on_asset_or_op_failure": False},
    })
    return settings


def instance_settings_yaml(warm_launcher: bool = False) -> str:
    """``instance_settings`` as ``dagster.yaml`` text, each section under a comment saying what it is for."""
    settings = instance_settings(warm_launcher)
    head = ("# The Dagster instance settings volley-dagster pipelines need (volley dagster-instance):\n"
            "# merge them into $DAGSTER_HOME/dagster.yaml (volley dagster-instance --merge PATH).\n")
    return head + "".join(_section(key, value) for key, value in settings.items())


def _section(key: str, value: Any) -> str:
    comment = "".join(f"# {line}\n" for line in _WHY[key].splitlines()) if key in _WHY else ""
    return "\n" + comment + yaml.safe_dump({key: value}, sort_keys=False, default_flow_style=False)


def merged_settings(current: JsonObject, warm_launcher: bool = False) -> tuple[JsonObject, list[str]]:
    """(``current`` with the settings merged in, what changed): each setting's value wins;
    every other key stays. A run coordinator or launcher of another class is replaced
    whole (its config belonged to it); a run queue limit that Dagster refuses beside
    ``concurrency.pools`` (``max_concurrent_runs``, ``tag_concurrency_limits`` in the run
    coordinator's config or ``run_queue``) moves to ``concurrency.runs``, where Dagster
    reads it now."""
    merged = _copy(current)
    changes: list[str] = []
    for key, wanted in instance_settings(warm_launcher).items():
        have = merged.get(key)
        if key in ("run_launcher", "run_coordinator") and isinstance(have, dict) and \
                (have.get("module"), have.get("class")) != (wanted["module"], wanted["class"]):
            changes.append(f"{key}: {have.get('class')} -> {wanted['class']}")
            merged[key] = _copy(wanted)
            continue
        if not isinstance(have, dict):
            if have is not None:
                changes.append(f"{key}: {have!r} -> a mapping")
            else:
                changes.append(f"{key}: added")
            merged[key] = _copy(wanted)
            continue
        _merge_into(have, wanted, key, changes)
    for where in (merged.get("run_queue"), (merged.get("run_coordinator") or {}).get("config")):
        if not isinstance(where, dict):
            continue
        for field in ("max_concurrent_runs", "tag_concurrency_limits"):
            if field in where:
                value = where.pop(field)
                runs = merged["concurrency"].setdefault("runs", {})
                runs.setdefault(field, value)
                changes.append(f"{field}: moved to concurrency.runs (Dagster refuses it beside concurrency.pools)")
        if "block_op_concurrency_limited_runs" in where:
            raise ConfigError("block_op_concurrency_limited_runs: Dagster refuses it beside concurrency.pools; "
                              "remove it (concurrency.pools.op_granularity_run_buffer replaces its slot buffer)")
    return merged, changes


def _merge_into(have: JsonObject, wanted: JsonObject, path: str, changes: list[str]) -> None:
    for key, value in wanted.items():
        where = f"{path}.{key}"
        if isinstance(value, dict) and isinstance(have.get(key), dict):
            _merge_into(have[key], value, where, changes)
        elif key not in have:
            have[key] = _copy(value)
            changes.append(f"{where}: added ({_shown(value)})")
        elif have[key] != value:
            changes.append(f"{where}: {_shown(have[key])} -> {_shown(value)}")
            have[key] = _copy(value)


def _shown(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def merge_instance_settings(path: str | Path, warm_launcher: bool = False) -> list[str]:
    """Writes the settings into the ``dagster.yaml`` at ``path`` (created when missing),
    keeping every other key (``merged_settings``); what changed, empty when nothing did.
    A section it changes is rewritten under its comment; the rest of the file, its
    comments too, stays as it was."""
    path = Path(path)
    text = path.read_text() if path.exists() else ""
    try:
        current = yaml.safe_load(text) if text.strip() else {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(current, dict):
        raise ConfigError(f"{path}: holds a {type(current).__name__}, not the mapping a dagster.yaml is")
    merged, changes = merged_settings(current, warm_launcher)
    if not changes:
        return []
    touched = [key for key in merged if merged[key] != current.get(key)]
    kept = _without_sections(text, set(touched))
    new_text = (kept.rstrip("\n") + "\n" if kept.strip() else "") + "".join(_section(k, merged[k]) for k in touched)
    if yaml.safe_load(new_text) != merged:  # a layout the section cut cannot read (flow style, anchors): all of it
        new_text = "".join(_section(k, v) for k, v in merged.items()).lstrip("\n")
    _write_atomically(path, new_text)
    return changes


_TOP_KEY = re.compile(r"^([A-Za-z_][\w-]*)\s*:")


def _without_sections(text: str, keys: set[str]) -> str:
    """``text`` less the top-level sections named ``keys``, each with the comment lines
    just above it."""
    out: list[str] = []
    between: list[str] = []  # comment and blank lines at the margin: they belong to what follows them
    skipping = False
    for line in text.splitlines(keepends=True):
        if not line.strip() or line.startswith("#"):
            between.append(line)
            continue
        top = _TOP_KEY.match(line)
        if top is not None or not line.startswith((" ", "\t", "-")):
            skipping = top is not None and top.group(1) in keys
            if skipping:  # the section's own comment goes with it; a blank line before it stays
                while between and between[-1].startswith("#"):
                    between.pop()
            out += between
            between = []
        elif not skipping:
            out += between
            between = []
        else:
            between = []
        if not skipping:
            out.append(line)
    return "".join(out + between)


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        if path.exists():
            os.chmod(tmp, path.stat().st_mode & 0o777)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
