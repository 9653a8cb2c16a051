"""A real ``dagster dev`` for tests, and a small client for its GraphQL API.

``start_dagster_dev(workspace_yaml)`` runs ``python -m dagster dev -w <workspace.yaml>
-h 127.0.0.1 -p <free port>`` from this interpreter's environment, with a private
``DAGSTER_HOME`` (a temp dir holding the ``dagster.yaml`` you pass in), in its own
process group, logging to ``<home>/dagster-dev.log``. It returns once the webserver
answers GraphQL, every code location is LOADED and (by default) the daemons the
backfills need report healthy; otherwise it fails loudly with the log's tail.

    with dagster_dev("workspace.yaml", dagster_yaml="dagster.yaml") as server:
        gql = server.client
        backfill_id = gql.launch_partition_backfill(["pipe", "state"], ["0001", "0002"])
        result = gql.wait_backfill(backfill_id, timeout=180)
        assert result.succeeded, result
        gql.asset_materializations(["pipe", "state"])  # [{partition, metadata, ...}]

Facts measured with dagster 1.13.27 on this machine:
the backfill daemon ticks every 30 s (hard-coded) and a run launch costs ~5 s with the
in-process executor. A trivial backfill waits for one tick to submit its run and
another to notice it finished: ~58 s to COMPLETED_SUCCESS, 18-36 s with
``wait_backfill(..., until="runs")``; give ``wait_backfill`` a few minutes. ``dagster dev`` started from a non-interactive shell has
SIGINT (and hence its SIGTERM handling) ignored: we reset both to their defaults in
the child before exec, or it cannot be stopped short of SIGKILL.

Only the standard library and ``requests`` (a dagster dependency) are used, so the
module imports without Spark or the project's code.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import requests

DEFAULT_DAGSTER_YAML = "telemetry:\n  enabled: false\n"

# Backfill statuses (BulkActionStatus) after which nothing more happens.
TERMINAL_BACKFILL_STATUSES = frozenset({"COMPLETED", "COMPLETED_SUCCESS", "COMPLETED_FAILED", "FAILED", "CANCELED"})
SUCCESS_BACKFILL_STATUSES = frozenset({"COMPLETED", "COMPLETED_SUCCESS"})
TERMINAL_RUN_STATUSES = frozenset({"SUCCESS", "FAILURE", "CANCELED"})

# The daemons a partition backfill needs: the backfill daemon launches the runs and,
# when the instance queues runs (the default), the run-queue daemon dequeues them.
BACKFILL_DAEMONS = ("BACKFILL", "QUEUED_RUN_COORDINATOR")


class GraphQLError(RuntimeError):
    """A GraphQL request failed, or returned an error member of a result union."""


# -- GraphQL documents ---------------------------------------------------------------------

WORKSPACE_QUERY = """
query VolleyWorkspace {
  workspaceOrError {
    __typename
    ... on Workspace {
      locationEntries {
        name
        loadStatus
        locationOrLoadError {
          __typename
          ... on RepositoryLocation { name repositories { name } }
          ... on PythonError { message stack }
        }
      }
    }
    ... on PythonError { message stack }
  }
}
"""

DAEMON_HEALTH_QUERY = """
query VolleyDaemonHealth {
  instance { daemonHealth { allDaemonStatuses { daemonType required healthy lastHeartbeatTime } } }
}
"""

# What the UI's "Materialize" -> partitions dialog sends for an asset selection
# (dagster-webserver 1.13: backfillParams {tags, assetSelection, partitionNames,
# fromFailure: false, runConfigData}); with a single selected partition the UI launches
# a plain run instead of a backfill.
LAUNCH_PARTITION_BACKFILL_MUTATION = """
mutation VolleyLaunchPartitionBackfill($backfillParams: LaunchBackfillParams!) {
  launchPartitionBackfill(backfillParams: $backfillParams) {
    __typename
    ... on LaunchBackfillSuccess { backfillId launchedRunIds }
    ... on PartitionSetNotFoundError { message }
    ... on PartitionKeysNotFoundError { message partitionKeys }
    ... on InvalidStepError { invalidStepKey }
    ... on InvalidOutputError { stepKey invalidOutputName }
    ... on RunConfigValidationInvalid { pipelineName errors { message } }
    ... on PipelineNotFoundError { message }
    ... on RunConflict { message }
    ... on UnauthorizedError { message }
    ... on InvalidSubsetError { message }
    ... on PresetNotFoundError { message }
    ... on ConflictingExecutionParamsError { message }
    ... on NoModeProvidedError { message }
    ... on PythonError { message stack }
  }
}
"""

BACKFILL_QUERY = """
query VolleyBackfill($backfillId: String!) {
  partitionBackfillOrError(backfillId: $backfillId) {
    __typename
    ... on PartitionBackfill {
      id
      status
      partitionNames
      assetSelection { path }
      numPartitions
      timestamp
      endTimestamp
      error { message stack }
      runs { runId status tags { key value } }
    }
    ... on BackfillNotFoundError { message }
    ... on PythonError { message stack }
  }
}
"""

_METADATA_ENTRY_FIELDS = """
  __typename
  label
  ... on IntMetadataEntry { intValue intRepr }
  ... on FloatMetadataEntry { floatValue floatRepr }
  ... on BoolMetadataEntry { boolValue }
  ... on TextMetadataEntry { text }
  ... on JsonMetadataEntry { jsonString }
  ... on MarkdownMetadataEntry { mdStr }
  ... on PathMetadataEntry { path }
  ... on NotebookMetadataEntry { path }
  ... on UrlMetadataEntry { url }
  ... on TimestampMetadataEntry { timestamp }
  ... on PipelineRunMetadataEntry { runId }
  ... on AssetMetadataEntry { assetKey { path } }
  ... on JobMetadataEntry { jobName }
  ... on PoolMetadataEntry { pool }
  ... on PythonArtifactMetadataEntry { module name }
  ... on TableSchemaMetadataEntry { schema { columns { name type description } } }
  ... on TableMetadataEntry { table { records } }
"""

ASSET_MATERIALIZATIONS_QUERY = """
query VolleyAssetMaterializations($assetKey: AssetKeyInput!, $partitions: [String!], $limit: Int) {
  assetOrError(assetKey: $assetKey) {
    __typename
    ... on Asset {
      assetMaterializations(partitions: $partitions, limit: $limit) {
        partition
        runId
        timestamp
        metadataEntries { %s }
      }
    }
    ... on AssetNotFoundError { message }
  }
}
""" % _METADATA_ENTRY_FIELDS

ASSET_PARTITIONS_QUERY = """
query VolleyAssetPartitions($assetKey: AssetKeyInput!) {
  assetNodeOrError(assetKey: $assetKey) {
    __typename
    ... on AssetNode {
      partitionKeys
      assetPartitionStatuses {
        __typename
        ... on DefaultPartitionStatuses {
          materializedPartitions failedPartitions unmaterializedPartitions materializingPartitions
        }
      }
    }
    ... on AssetNotFoundError { message }
  }
}
"""

SET_NUX_SEEN_MUTATION = "mutation VolleySetNuxSeen { setNuxSeen }"

ADD_DYNAMIC_PARTITION_MUTATION = """
mutation VolleyAddDynamicPartition(
  $partitionsDefName: String!, $partitionKey: String!, $repositorySelector: RepositorySelector!
) {
  addDynamicPartition(
    partitionsDefName: $partitionsDefName, partitionKey: $partitionKey, repositorySelector: $repositorySelector
  ) {
    __typename
    ... on AddDynamicPartitionSuccess { partitionsDefName partitionKey }
    ... on DuplicateDynamicPartitionError { message }
    ... on UnauthorizedError { message }
    ... on PythonError { message stack }
  }
}
"""

RUN_QUERY = """
query VolleyRun($runId: ID!) {
  runOrError(runId: $runId) {
    __typename
    ... on Run { runId status jobName tags { key value } }
    ... on RunNotFoundError { message }
    ... on PythonError { message }
  }
}
"""


# -- helpers ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def asset_key_path(key: str | Sequence[str]) -> list[str]:
    """``"pipe/state"`` or ``["pipe", "state"]`` -> ``["pipe", "state"]``."""
    if isinstance(key, str):
        return key.split("/")
    return [str(part) for part in key]


def asset_keys(keys: str | Sequence[str] | Sequence[Sequence[str]]) -> list[list[str]]:
    """One key (``"a/b"`` or the path ``["a", "b"]``) or several (``["a/b", "a/c"]``,
    ``[["a", "b"], ["a", "c"]]``). A list of plain strings is ONE key path unless one of
    them contains a ``/``, in which case each string is a ``/``-joined key."""
    if isinstance(keys, str):
        return [asset_key_path(keys)]
    keys = list(keys)
    if keys and all(isinstance(k, str) for k in keys) and not any("/" in k for k in keys):  # type: ignore[operator]
        return [asset_key_path(keys)]  # type: ignore[arg-type]
    return [asset_key_path(k) for k in keys]  # type: ignore[arg-type]


def metadata_value(entry: Mapping[str, Any]) -> Any:
    """The Python value of one typed ``MetadataEntry`` returned by GraphQL."""
    kind = entry["__typename"]
    if kind == "IntMetadataEntry":
        # GraphQL's Int is 32 bits: larger values come back as intValue null + intRepr.
        return entry["intValue"] if entry.get("intValue") is not None else int(entry["intRepr"])
    if kind == "FloatMetadataEntry":
        if entry.get("floatValue") is not None:
            return entry["floatValue"]
        return float(entry["floatRepr"])  # "nan", "inf", "-inf"
    if kind == "BoolMetadataEntry":
        return entry["boolValue"]
    if kind == "TextMetadataEntry":
        return entry["text"]
    if kind == "JsonMetadataEntry":
        return json.loads(entry["jsonString"])
    if kind == "MarkdownMetadataEntry":
        return entry["mdStr"]
    if kind in ("PathMetadataEntry", "NotebookMetadataEntry"):
        return entry["path"]
    if kind == "UrlMetadataEntry":
        return entry["url"]
    if kind == "TimestampMetadataEntry":
        return entry["timestamp"]
    if kind == "PipelineRunMetadataEntry":
        return entry["runId"]
    if kind == "AssetMetadataEntry":
        return entry["assetKey"]["path"]
    if kind == "JobMetadataEntry":
        return entry["jobName"]
    if kind == "PoolMetadataEntry":
        return entry["pool"]
    if kind == "PythonArtifactMetadataEntry":
        return f"{entry['module']}.{entry['name']}"
    if kind == "TableSchemaMetadataEntry":
        return entry["schema"]["columns"]
    if kind == "TableMetadataEntry":
        return entry["table"]["records"]
    if kind == "NullMetadataEntry":
        return None
    return {k: v for k, v in entry.items() if k not in ("__typename", "label")}


@dataclass
class BackfillResult:
    backfill_id: str
    status: str
    run_ids: list[str]
    run_statuses: dict[str, str]
    partition_names: list[str]
    error: str | None
    seconds: float  # from the call to wait_backfill until the terminal status was seen

    @property
    def succeeded(self) -> bool:
        """All runs succeeded and the backfill is COMPLETED[_SUCCESS] (or, after
        ``wait_backfill(until="runs")``, not failing/canceled yet)."""
        if not self.run_statuses or any(s != "SUCCESS" for s in self.run_statuses.values()):
            return False
        return self.status in SUCCESS_BACKFILL_STATUSES or self.status == "REQUESTED"


# -- GraphQL client --------------------------------------------------------------------------


class DagsterGraphQL:
    """A minimal client for the webserver's ``/graphql`` endpoint."""

    def __init__(self, base_url: str, timeout: float = 30.0):
        self.base_url = base_url.rstrip("/")
        self.url = f"{self.base_url}/graphql"
        self.timeout = timeout
        self._session = requests.Session()

    def execute(self, query: str, variables: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """``data`` of the response; raises ``GraphQLError`` on HTTP or GraphQL errors."""
        try:
            resp = self._session.post(self.url, json={"query": query, "variables": dict(variables or {})},
                                      timeout=self.timeout)
        except requests.RequestException as exc:
            raise GraphQLError(f"POST {self.url} failed: {exc!r}") from exc
        try:
            body = resp.json()
        except ValueError:
            raise GraphQLError(f"POST {self.url}: HTTP {resp.status_code}, not JSON: {resp.text[:2000]}") from None
        if body.get("errors"):
            raise GraphQLError(f"GraphQL errors: {json.dumps(body['errors'], indent=1)[:4000]}")
        if body.get("data") is None:
            raise GraphQLError(f"POST {self.url}: HTTP {resp.status_code}: {resp.text[:2000]}")
        # A PythonError member of a result union comes with HTTP 500 but a normal body:
        # the callers turn it into a GraphQLError with its message.
        return body["data"]

    # workspace / instance ------------------------------------------------------------------

    def location_entries(self) -> list[dict[str, Any]]:
        result = self.execute(WORKSPACE_QUERY)["workspaceOrError"]
        if result["__typename"] != "Workspace":
            raise GraphQLError(f"workspaceOrError: {result.get('message')}")
        return result["locationEntries"]

    def location_errors(self) -> dict[str, str]:
        """Code locations that failed to load, with their errors."""
        errors = {}
        for entry in self.location_entries():
            loc = entry.get("locationOrLoadError") or {}
            if loc.get("__typename") == "PythonError":
                errors[entry["name"]] = loc["message"] + "".join(loc.get("stack") or [])
        return errors

    def repository_selector(self, location_name: str | None = None) -> dict[str, str]:
        """``{repositoryLocationName, repositoryName}`` of the only (or the named) location's
        repository (a ``Definitions`` object is the repository ``__repository__``)."""
        found = []
        for entry in self.location_entries():
            loc = entry.get("locationOrLoadError") or {}
            if loc.get("__typename") != "RepositoryLocation":
                continue
            if location_name is not None and entry["name"] != location_name:
                continue
            found += [{"repositoryLocationName": entry["name"], "repositoryName": r["name"]}
                      for r in loc["repositories"]]
        if len(found) != 1:
            raise GraphQLError(f"expected one repository (location {location_name!r}), found {found}")
        return found[0]

    def daemon_statuses(self) -> dict[str, dict[str, Any]]:
        data = self.execute(DAEMON_HEALTH_QUERY)
        return {d["daemonType"]: d for d in data["instance"]["daemonHealth"]["allDaemonStatuses"]}

    def set_nux_seen(self) -> None:
        """Dismiss the UI's first-visit community ("Join the Dagster community") dialog."""
        self.execute(SET_NUX_SEEN_MUTATION)

    def add_dynamic_partition(self, partitions_def_name: str, key: str,
                              repository_selector: Mapping[str, str] | None = None,
                              *, exist_ok: bool = False) -> None:
        """What the UI's "Add partition" does (``addDynamicPartition``). With ``exist_ok``
        an existing key is not an error."""
        selector = dict(repository_selector or self.repository_selector())
        result = self.execute(ADD_DYNAMIC_PARTITION_MUTATION, {
            "partitionsDefName": partitions_def_name, "partitionKey": key, "repositorySelector": selector,
        })["addDynamicPartition"]
        if result["__typename"] == "AddDynamicPartitionSuccess":
            return
        if result["__typename"] == "DuplicateDynamicPartitionError" and exist_ok:
            return
        raise GraphQLError(f"addDynamicPartition({partitions_def_name!r}, {key!r}): "
                           f"{result['__typename']}: {result.get('message')}")

    # backfills ----------------------------------------------------------------------------

    def launch_partition_backfill(self, keys: str | Sequence[str] | Sequence[Sequence[str]],
                                  partition_keys: Sequence[str], *,
                                  tags: Mapping[str, str] | None = None, title: str | None = None) -> str:
        """Launch an asset backfill the way the UI's dialog does; returns the backfill id.

        ``keys``: one asset key (``"pipe/state"`` or ``["pipe", "state"]``) or several (see
        ``asset_keys``); a non-subsettable multi_asset must be selected whole (dagster
        refuses a subset: "Backfill must include every key in a non-subsettable
        multi-asset"). Raises ``GraphQLError`` with the server's message on any non-success member
        of ``LaunchBackfillResult``.
        """
        params: dict[str, Any] = {
            "assetSelection": [{"path": p} for p in asset_keys(keys)],
            "partitionNames": list(partition_keys),
            "fromFailure": False,
            "tags": [{"key": k, "value": v} for k, v in (tags or {}).items()],
        }
        if title is not None:
            params["title"] = title
        result = self.execute(LAUNCH_PARTITION_BACKFILL_MUTATION, {"backfillParams": params})
        result = result["launchPartitionBackfill"]
        if result["__typename"] == "LaunchBackfillSuccess":
            return result["backfillId"]
        detail = {k: v for k, v in result.items() if k not in ("__typename", "stack")}
        stack = "".join(result.get("stack") or [])
        raise GraphQLError(f"launchPartitionBackfill: {result['__typename']}: {detail}\n{stack}".rstrip())

    def backfill(self, backfill_id: str) -> dict[str, Any]:
        result = self.execute(BACKFILL_QUERY, {"backfillId": backfill_id})["partitionBackfillOrError"]
        if result["__typename"] != "PartitionBackfill":
            raise GraphQLError(f"partitionBackfillOrError({backfill_id}): {result['__typename']}: "
                               f"{result.get('message')}")
        return result

    def wait_backfill(self, backfill_id: str, timeout: float = 240.0, poll: float = 1.0,
                      until: str = "status") -> BackfillResult:
        """Poll until the backfill is done; does not raise on a failed backfill: check
        ``.succeeded`` / ``.status``. Raises ``TimeoutError`` (with the last state seen)
        after ``timeout`` seconds.

        ``until="status"`` (default): the backfill's own status is terminal
        (COMPLETED[_SUCCESS|_FAILED] / FAILED / CANCELED) and its runs are finished. The
        backfill daemon only notices finished runs on its next tick (every 30 s), so this
        costs up to 30 s after the last run.
        ``until="runs"``: return as soon as the backfill has runs, all finished, and either
        one failed or every selected asset's every backfilled partition has its latest
        materialization from one of those runs (fine for single_run backfills, whose one
        run is requested on the first tick);
        ``.status`` is then whatever the backfill says at that moment (often REQUESTED).
        """
        if until not in ("status", "runs"):
            raise ValueError(f"until must be 'status' or 'runs', not {until!r}")
        start = time.monotonic()
        last: dict[str, Any] | None = None
        while True:
            last = self.backfill(backfill_id)
            runs = last.get("runs") or []
            runs_done = all(r["status"] in TERMINAL_RUN_STATUSES for r in runs)
            done = last["status"] in TERMINAL_BACKFILL_STATUSES and runs_done
            if not done and until == "runs" and runs and runs_done:
                done = any(r["status"] != "SUCCESS" for r in runs) or self._all_materialized(
                    [a["path"] for a in last.get("assetSelection") or []], last.get("partitionNames") or [],
                    {r["runId"] for r in runs})
            if done:
                err = last.get("error")
                return BackfillResult(
                    backfill_id=backfill_id, status=last["status"],
                    run_ids=[r["runId"] for r in reversed(runs)],  # oldest first
                    run_statuses={r["runId"]: r["status"] for r in runs},
                    partition_names=list(last.get("partitionNames") or []),
                    error=(err["message"] + "".join(err.get("stack") or [])) if err else None,
                    seconds=time.monotonic() - start,
                )
            if time.monotonic() - start > timeout:
                raise TimeoutError(f"backfill {backfill_id} not finished after {timeout:.0f}s; last state: "
                                   f"{json.dumps(last, indent=1)[:3000]}")
            time.sleep(poll)

    def _all_materialized(self, keys: list[list[str]], partitions: list[str], run_ids: set[str]) -> bool:
        """Every partition of every key has its latest materialization from one of ``run_ids``."""
        if not keys or not partitions:
            return False
        for key in keys:
            latest = {ev["partition"]: ev["run_id"] for ev in self.asset_materializations(key, partitions)}
            if any(latest.get(p) not in run_ids for p in partitions):
                return False
        return True

    def run(self, run_id: str) -> dict[str, Any]:
        result = self.execute(RUN_QUERY, {"runId": run_id})["runOrError"]
        if result["__typename"] != "Run":
            raise GraphQLError(f"runOrError({run_id}): {result['__typename']}: {result.get('message')}")
        return result

    # assets -------------------------------------------------------------------------------

    def asset_materializations(self, asset_key: str | Sequence[str], partitions: Sequence[str] | None = None,
                               limit: int | None = None) -> list[dict[str, Any]]:
        """Materialization events of an asset in the order they were stored (oldest
        first), as ``{"partition", "run_id", "timestamp", "metadata": {label: value},
        "metadata_types": {label: "IntMetadataEntry" ...}}``. Numeric metadata comes back
        as int/float (what the UI plots across partitions).

        Within one run over a partition range (single_run backfill) dagster 1.13 stores
        the per-partition events in no particular key order: sort by partition, or use
        ``latest_materializations``."""
        result = self.execute(ASSET_MATERIALIZATIONS_QUERY, {
            "assetKey": {"path": asset_key_path(asset_key)},
            "partitions": list(partitions) if partitions is not None else None,
            "limit": limit,
        })["assetOrError"]
        if result["__typename"] == "AssetNotFoundError":
            return []  # never materialized (nor defined)
        events = []
        for ev in reversed(result["assetMaterializations"]):  # GraphQL: newest first
            events.append({
                "partition": ev["partition"],
                "run_id": ev["runId"],
                "timestamp": float(ev["timestamp"]) / 1000.0,  # GraphQL gives epoch millis as a string
                "metadata": {e["label"]: metadata_value(e) for e in ev["metadataEntries"]},
                "metadata_types": {e["label"]: e["__typename"] for e in ev["metadataEntries"]},
            })
        return events

    def latest_materializations(self, asset_key: str | Sequence[str]) -> dict[str, dict[str, Any]]:
        """``{partition key: its latest materialization event}`` (see asset_materializations)."""
        return {ev["partition"]: ev for ev in self.asset_materializations(asset_key)}

    def asset_partitions(self, asset_key: str | Sequence[str]) -> dict[str, list[str]]:
        """``{"keys", "materialized", "failed", "unmaterialized", "materializing"}`` of a
        partitioned asset (keys in definition order, i.e. the order they were added)."""
        result = self.execute(ASSET_PARTITIONS_QUERY, {"assetKey": {"path": asset_key_path(asset_key)}})
        node = result["assetNodeOrError"]
        if node["__typename"] != "AssetNode":
            raise GraphQLError(f"assetNodeOrError({asset_key}): {node['__typename']}: {node.get('message')}")
        st = node["assetPartitionStatuses"]
        return {
            "keys": list(node["partitionKeys"] or []),
            "materialized": st.get("materializedPartitions", []),
            "failed": st.get("failedPartitions", []),
            "unmaterialized": st.get("unmaterializedPartitions", []),
            "materializing": st.get("materializingPartitions", []),
        }


# -- the server ------------------------------------------------------------------------------


def _reset_signals_and_detach() -> None:  # runs in the child between fork and exec
    # A non-interactive shell (or CI runner) may start us with SIGINT ignored; ignored
    # dispositions survive exec, and `dagster dev` then never stops on SIGINT/SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.setsid()  # own session and process group: stop() signals the whole tree


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(_ANSI.sub("", path.read_text(errors="replace")).splitlines()[-lines:])
    except OSError:
        return "(no log)"


_TOKEN_VAR = "VOLLEY_TEST_DAGSTER_DEV"


def _pids_with_env(var: str, value: str) -> list[int]:
    """Processes whose environment has ``var=value``: with the per-server token set only
    in the server's environment, its descendants even if one left the process group."""
    needle = f"{var}={value}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


@dataclass
class DagsterDev:
    """A running ``dagster dev``; stop it with ``stop()`` (idempotent)."""

    proc: subprocess.Popen[bytes]
    host: str
    port: int
    home: Path
    log: Path
    workspace: Path
    token: str = ""
    started_seconds: float = 0.0
    _owns_home: bool = False
    _log_file: Any = None
    client: DagsterGraphQL = field(init=False)

    def __post_init__(self) -> None:
        self.client = DagsterGraphQL(self.url)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log_tail(self, lines: int = 60) -> str:
        return _tail(self.log, lines)

    def instance(self) -> Any:
        """A ``DagsterInstance`` on the server's DAGSTER_HOME (the test's side of the
        same storage, e.g. for ``instance.add_dynamic_partitions``). Caller disposes."""
        from dagster import DagsterInstance

        return DagsterInstance.from_config(str(self.home))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the process group, wait, then SIGKILL it (and any straggler that still
        carries this server's token in its environment, e.g. a run worker or a JVM that
        started its own session)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        # the group leader may be gone while children linger
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and _group_alive(self.proc.pid):
            time.sleep(0.1)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in _pids_with_env(_TOKEN_VAR, self.token):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.proc.poll() is None:
            self.proc.wait(10)
        if self._log_file is not None and not self._log_file.closed:
            self._log_file.close()
        if self._owns_home:
            shutil.rmtree(self.home, ignore_errors=True)

    def __enter__(self) -> "DagsterDev":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def start_dagster_dev(workspace: str | os.PathLike[str], *,
                      dagster_yaml: str | os.PathLike[str] | None = None,
                      dagster_yaml_text: str | None = None,
                      home: str | os.PathLike[str] | None = None,
                      port: int | None = None,
                      env: Mapping[str, str] | None = None,
                      cwd: str | os.PathLike[str] | None = None,
                      wait_daemons: Sequence[str] = BACKFILL_DAEMONS,
                      timeout: float = 180.0,
                      keep_home: bool = False,
                      overrides: Mapping[str, Any] | None = None,
                      live_data_poll_rate_ms: int | None = 500,
                      extra_args: Sequence[str] = ()) -> DagsterDev:
    """Start ``dagster dev -w workspace -h 127.0.0.1 -p <port>`` and wait until it is usable.

    ``dagster_yaml`` (a file, copied) or ``dagster_yaml_text`` becomes
    ``$DAGSTER_HOME/dagster.yaml`` (default: telemetry off). ``home`` defaults to a fresh
    temp dir, removed by ``stop()`` unless ``keep_home``; logs go to
    ``<home>/dagster-dev.log`` (pass ``home=tmp_path / "dagster_home"`` in pytest to keep
    them for post-mortems). ``cwd`` defaults to the workspace file's directory.
    ``wait_daemons``: daemon types that must report healthy before returning
    (``()`` to skip). ``overrides`` is deep-merged into that dagster.yaml, e.g.
    ``{"run_coordinator": {"config": {"dequeue_interval_seconds": 1}}}`` (the queued run
    coordinator otherwise waits up to 5 s before launching a queued run).
    ``live_data_poll_rate_ms``: how often the UI refreshes asset live data (dagster's
    default 2000 ms left lineage nodes showing "Loading…" for ~6 s after a navigation
    one time in two; 500 ms made it ~0.3 s). ``None`` keeps dagster's default.
    """
    workspace = Path(workspace).resolve()
    if not workspace.is_file():
        raise FileNotFoundError(workspace)
    owns_home = home is None
    home_path = Path(tempfile.mkdtemp(prefix="dagster_home_")) if home is None else Path(home)
    home_path.mkdir(parents=True, exist_ok=True)
    home_path = home_path.resolve()
    if dagster_yaml is not None and dagster_yaml_text is not None:
        raise ValueError("pass dagster_yaml or dagster_yaml_text, not both")
    if dagster_yaml is not None:
        shutil.copyfile(dagster_yaml, home_path / "dagster.yaml")
    elif dagster_yaml_text is not None:
        (home_path / "dagster.yaml").write_text(dagster_yaml_text)
    elif not (home_path / "dagster.yaml").exists():
        (home_path / "dagster.yaml").write_text(DEFAULT_DAGSTER_YAML)
    if overrides:
        import yaml  # PyYAML: a dagster dependency

        config = yaml.safe_load((home_path / "dagster.yaml").read_text()) or {}
        (home_path / "dagster.yaml").write_text(yaml.safe_dump(_deep_merge(config, overrides), sort_keys=False))

    host = "127.0.0.1"
    port = port or free_port()
    log = home_path / "dagster-dev.log"
    token = uuid.uuid4().hex
    child_env = {**os.environ, **(env or {}), "DAGSTER_HOME": str(home_path), "PYTHONUNBUFFERED": "1",
                 _TOKEN_VAR: token}
    cmd = [sys.executable, "-m", "dagster", "dev", "-w", str(workspace), "-h", host, "-p", str(port),
           *(["--live-data-poll-rate", str(live_data_poll_rate_ms)] if live_data_poll_rate_ms else []),
           *extra_args]
    log_file = open(log, "ab")
    log_file.write(f"$ {' '.join(cmd)}\n".encode())
    log_file.flush()
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=str(cwd or workspace.parent), env=child_env, stdin=subprocess.DEVNULL,
                            stdout=log_file, stderr=subprocess.STDOUT, preexec_fn=_reset_signals_and_detach)
    server = DagsterDev(proc=proc, host=host, port=port, home=home_path, log=log, workspace=workspace,
                        token=token, _owns_home=owns_home and not keep_home, _log_file=log_file)
    try:
        _wait_ready(server, timeout, wait_daemons)
    except BaseException:
        server._owns_home = False  # keep the log for the post-mortem
        server.stop()
        raise
    server.started_seconds = time.monotonic() - t0
    return server


def _deep_merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _wait_ready(server: DagsterDev, timeout: float, wait_daemons: Sequence[str]) -> None:
    deadline = time.monotonic() + timeout
    stage, last = "webserver", "no answer yet"

    def fail(why: str) -> None:
        raise RuntimeError(f"dagster dev on {server.url}: {why} (stage: {stage}; last: {last}); "
                           f"log {server.log}:\n{server.log_tail()}")

    while True:
        if server.proc.poll() is not None:
            fail(f"exited with {server.proc.returncode}")
        if time.monotonic() > deadline:
            fail(f"not ready after {timeout:.0f}s")
        try:
            if stage == "webserver":
                requests.get(f"{server.url}/server_info", timeout=5).raise_for_status()
                stage = "locations"
            if stage == "locations":
                entries = server.client.location_entries()
                errors = server.client.location_errors()
                if errors:
                    fail("code location(s) failed to load:\n" + "\n".join(f"{k}: {v}" for k, v in errors.items()))
                statuses = {e["name"]: e["loadStatus"] for e in entries}
                last = f"locations {statuses}"
                if entries and all(s == "LOADED" for s in statuses.values()):
                    stage = "daemons"
            if stage == "daemons":
                if not wait_daemons:
                    return
                statuses = server.client.daemon_statuses()
                last = {k: v["healthy"] for k, v in statuses.items()}
                unhealthy = [d for d in wait_daemons if d in statuses and not statuses[d]["healthy"]]
                if not unhealthy:
                    return
        except (requests.RequestException, GraphQLError) as exc:
            last = repr(exc)[:500]
        time.sleep(0.25)


@contextmanager
def dagster_dev(workspace: str | os.PathLike[str], **kwargs: Any) -> Iterator[DagsterDev]:
    """``start_dagster_dev`` as a context manager (stops the server on exit)."""
    server = start_dagster_dev(workspace, **kwargs)
    try:
        yield server
    finally:
        server.stop()
