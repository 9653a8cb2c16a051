"""A small client for the GraphQL API of a running ``dagster dev`` (queries, backfills, runs,
materializations). Only the standard library and ``requests`` (a dagster dependency)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import requests

DEFAULT_DAGSTER_YAML = "telemetry:\n  enabled: false\n"


TERMINAL_BACKFILL_STATUSES = frozenset({"COMPLETED", "COMPLETED_SUCCESS", "COMPLETED_FAILED", "FAILED", "CANCELED"})


SUCCESS_BACKFILL_STATUSES = frozenset({"COMPLETED", "COMPLETED_SUCCESS"})


TERMINAL_RUN_STATUSES = frozenset({"SUCCESS", "FAILURE", "CANCELED"})


BACKFILL_DAEMONS = ("BACKFILL", "QUEUED_RUN_COORDINATOR")


class GraphQLError(RuntimeError):
    """A GraphQL request failed, or returned an error member of a result union."""


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


SENSOR_QUERY = """
query VolleySensor($sensorSelector: SensorSelector!) {
  sensorOrError(sensorSelector: $sensorSelector) {
    __typename
    ... on Sensor { name sensorState { id status ticks(limit: 1) { status } } }
    ... on SensorNotFoundError { message }
    ... on PythonError { message }
  }
}
"""


STOP_SENSOR_MUTATION = """
mutation VolleyStopSensor($id: String!) {
  stopSensor(id: $id) {
    __typename
    ... on StopSensorMutationResult { instigationState { status } }
    ... on UnauthorizedError { message }
    ... on PythonError { message }
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

    def sensor_state(self, name: str, repository_selector: Mapping[str, str] | None = None) -> dict[str, Any]:
        """``{"id": its instigation state id, "status": "RUNNING" | "STOPPED", "ticks":
        [{"status": ...}]}``, the ticks newest first (at most one: the latest)."""
        selector = {**(repository_selector or self.repository_selector()), "sensorName": name}
        result = self.execute(SENSOR_QUERY, {"sensorSelector": selector})["sensorOrError"]
        if result["__typename"] != "Sensor":
            raise GraphQLError(f"sensorOrError({name!r}): {result['__typename']}: {result.get('message')}")
        return result["sensorState"]

    def stop_sensor(self, name: str, repository_selector: Mapping[str, str] | None = None) -> None:
        """What the UI's sensor toggle does when switched off (``stopSensor``)."""
        state_id = self.sensor_state(name, repository_selector)["id"]
        result = self.execute(STOP_SENSOR_MUTATION, {"id": state_id})["stopSensor"]
        if result["__typename"] != "StopSensorMutationResult" or result["instigationState"]["status"] != "STOPPED":
            raise GraphQLError(f"stopSensor({name!r}): {result}")

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
