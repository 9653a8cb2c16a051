"""``deploy/Dockerfile`` and the Helm values of ``docs/kubernetes.md``, checked as far as
the project's machines can check them: there is no Docker engine, no Kubernetes and no
Helm here, so the image is never built and the chart never rendered.

What is checked instead: the Dockerfile's base image, Java and interpreter against
``pyproject.toml``, ``./dev`` and the README; every ``COPY`` source against the files
of a checkout; its command against the code location the page's values name; its pip
line, read from the Dockerfile, installed with the wheel of this checkout into a fresh
virtualenv (``uv venv``), where ``volley_dagster.dagster`` and ``dagster_k8s`` import
and ``dagster api grpc`` takes the command's flags, and resolved for the image's Python
on Linux amd64 and arm64 with a wheel for every package but pyspark (the slim image has
no compiler). The page's YAML blocks: every Helm key against the keys the chart defines
(``CHART_KEYS``), the instance they make against ``volley dagster-instance``'s
sections, loaded by Dagster and read by the pipelines' own ``instance_settings`` check,
and the component YAML against the component's attributes."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from dagster import DagsterInstance
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from tests.adoption.wheel import build_wheel, uv
from tests.test_docs import parse_page
from volley_dagster.dagster.component import VolleyPipelines
from volley_dagster.dagster.instance import instance_settings, merged_settings
from volley_dagster.dagster.runs import instance_problems

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
PAGE = ROOT / "docs" / "kubernetes.md"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


# -- reading the Dockerfile --------------------------------------------------------------


@dataclass
class Stage:
    image: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, its arguments)

    def all(self, instruction: str) -> list[str]:
        return [args for name, args in self.instructions if name == instruction]


def stages(text: str) -> list[Stage]:
    """The Dockerfile's build stages, each with its instructions: continuation lines
    joined, comments dropped."""
    lines: list[str] = []
    pending = ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    found: list[Stage] = []
    for line in lines:
        instruction, _, args = line.strip().partition(" ")
        if instruction.upper() == "FROM":
            image, *rest = args.split()
            found.append(Stage(image, rest[1] if len(rest) == 2 and rest[0].upper() == "AS" else None))
        else:
            assert found, f"an instruction before FROM: {line}"
            found[-1].instructions.append((instruction.upper(), args.strip()))
    return found


STAGES = stages(DOCKERFILE.read_text())
FINAL = STAGES[-1]


def env(stage: Stage) -> dict[str, str]:
    values: dict[str, str] = {}
    for args in stage.all("ENV"):
        for pair in shlex.split(args):
            key, _, value = pair.partition("=")
            values[key] = value
    return values


def arg_defaults(stage: Stage) -> dict[str, str]:
    return dict(a.partition("=")[::2] for a in stage.all("ARG"))


def pip_requirements(stage: Stage) -> list[str]:
    """The requirement strings of the stage's ``pip install`` (its flags left out), with
    the stage's ``ARG`` defaults put in."""
    (line,) = [r for r in stage.all("RUN") if "pip install" in r]
    command = line.split("&&")[0]
    words = shlex.split(command)
    assert words[:2] == ["pip", "install"], command
    args = arg_defaults(stage)
    expand = re.compile(r"\$\{(\w+)\}")
    return [expand.sub(lambda m: args[m.group(1)], w) for w in words[2:] if not w.startswith("-")]


def python_version(image: str) -> str:
    m = re.fullmatch(r"python:(\d+\.\d+)-slim-(\w+)", image)
    assert m, f"{image}: not an official slim Python image pinned to a Debian release"
    return m.group(1)


# -- reading the page ----------------------------------------------------------------------


def page_yaml(heading: str) -> list[dict[str, Any]]:
    blocks = [b for b in parse_page(PAGE) if b.language == "yaml" and b.heading == heading]
    assert blocks, f"docs/kubernetes.md has no YAML block under {heading!r}"
    return [yaml.safe_load(b.text) for b in blocks]


LOCATION_HEADING = "The Helm values: the code location"
INSTANCE_HEADING = "The Helm values: runs and the instance"


def helm_location() -> dict[str, Any]:
    return next(v for v in page_yaml(LOCATION_HEADING) if "dagster-user-deployments" in v)


def component_yaml() -> dict[str, Any]:
    return next(v for v in page_yaml(LOCATION_HEADING) if "type" in v)


def code_location() -> dict[str, Any]:
    (deployment,) = helm_location()["dagster-user-deployments"]["deployments"]
    return deployment


# -- the Dockerfile ------------------------------------------------------------------------


def test_the_base_image_is_a_python_that_pyproject_admits_on_debian_12() -> None:
    """One base for both stages (the wheel is built by the Python it is installed in).
    Debian 12: Debian 13, the slim images' newer default, ships no Java 17."""
    assert {s.image for s in STAGES} == {FINAL.image}
    version = python_version(FINAL.image)
    assert Version(version) in SpecifierSet(PROJECT["requires-python"])
    assert f"Programming Language :: Python :: {version}" in PROJECT["classifiers"]
    assert FINAL.image.endswith("-slim-bookworm")


def test_java_17_headless_with_java_home_and_the_images_python_for_pyspark() -> None:
    """The Java of ``./dev`` and of the README's word to a team; ``JAVA_HOME`` is the
    arch-independent link the install makes; PySpark's workers run the image's own
    interpreter (the official image's, in /usr/local/bin)."""
    (install,) = [r for r in FINAL.all("RUN") if "apt-get install" in r]
    (java,) = re.findall(r"openjdk-(\d+)-jre-headless", install)
    assert java == "17" and re.findall(r"openjdk-(\d+)-jre-headless", (ROOT / "dev").read_text())[0] == java
    assert f"Java {java}" in (ROOT / "README.md").read_text()
    variables = env(FINAL)
    assert variables["JAVA_HOME"] == f"/usr/lib/jvm/java-{java}"
    assert f'"/usr/lib/jvm/java-{java}-openjdk-$(dpkg --print-architecture)" {variables["JAVA_HOME"]}' in install
    assert variables["PYSPARK_PYTHON"] == variables["PYSPARK_DRIVER_PYTHON"] == "/usr/local/bin/python"


def test_every_copy_source_is_in_a_checkout() -> None:
    """Each ``COPY`` from the build context names files git tracks (what a fresh clone
    holds: no ``dist/``, no ``.venv``); each ``COPY --from`` an earlier stage."""
    names = {s.name for s in STAGES if s.name}
    copies = [(i, args) for i, s in enumerate(STAGES) for args in s.all("COPY")]
    assert copies
    for i, args in copies:
        words = shlex.split(args)
        flags = [w for w in words if w.startswith("--")]
        sources = [w for w in words if not w.startswith("--")][:-1]
        if any(f.startswith("--from=") for f in flags):
            (source,) = [f.partition("=")[2] for f in flags if f.startswith("--from=")]
            assert source in names and source in {s.name for s in STAGES[:i]}, args
            continue
        for path in sources:
            assert (ROOT / path).exists(), f"COPY {path}: not in the checkout"
            tracked = subprocess.run(["git", "ls-files", "--", path], cwd=ROOT, capture_output=True, text=True)
            assert tracked.returncode == 0 and tracked.stdout.strip(), f"COPY {path}: git tracks no such file"


def test_the_command_is_the_code_server_that_the_helm_values_name() -> None:
    """The chart runs ``dagster api grpc -h 0.0.0.0 -p <port>`` with the deployment's
    ``dagsterApiGrpcArgs`` after them (its ``deployment-user.yaml``): the same command as
    the image's ``CMD``, which a run pod's ``dagster api execute_run`` replaces."""
    (cmd,) = FINAL.all("CMD")
    deployment = code_location()
    assert json.loads(cmd) == ["dagster", "api", "grpc", "-h", "0.0.0.0", "-p", str(deployment["port"]),
                               *deployment["dagsterApiGrpcArgs"]]
    assert FINAL.all("EXPOSE") == [str(deployment["port"])] and not FINAL.all("ENTRYPOINT")
    args = deployment["dagsterApiGrpcArgs"]
    module, workdir = args[args.index("-m") + 1], args[args.index("-d") + 1]
    assert FINAL.all("WORKDIR") == [workdir]
    assert any(re.fullmatch(rf"{re.escape(module.split('.')[0])}(\.py)? {re.escape(workdir)}/?", c)
               for c in FINAL.all("COPY")), f"no COPY puts module {module!r} in {workdir}"


def test_the_wheel_is_this_version_and_dagsters_libraries_release_with_the_dagster_it_admits() -> None:
    """The wheel by its exact file name, of pyproject's version; dagster-postgres and
    dagster-k8s in the window of pyproject's ``dagster`` (library 0.(N+16) releases
    beside dagster 1.N)."""
    requirements = pip_requirements(FINAL)
    volley = [r for r in requirements if r.startswith("volley-dagster")]
    assert volley == [f"volley-dagster[dagster] @ file:///tmp/wheels/volley_dagster-{PROJECT['version']}"
                      "-py3-none-any.whl"]
    (dagster,) = [r for r in PROJECT["dependencies"] if re.match(r"dagster\b", r) and not r.startswith("dagster-")]
    low, high = (Version(v) for v in re.findall(r"[\d.]+", dagster.removeprefix("dagster")))
    window = f">=0.{low.minor + 16},<0.{high.minor + 16}"
    for library in ("dagster-postgres", "dagster-k8s"):
        (spec,) = [r for r in requirements if r.startswith(library)]
        assert SpecifierSet(spec.removeprefix(library)) == SpecifierSet(window), spec


# -- the pip line, installed and resolved -----------------------------------------------------


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("dockerfile-wheel"))


def with_local_wheel(requirements: list[str], wheel: Path) -> list[str]:
    """The Dockerfile's requirements, the wheel it copies in replaced by the one built here
    (of the same file name)."""
    (named,) = [r for r in requirements if "file:///tmp/wheels/" in r]
    assert named.endswith(f"/{wheel.name}"), f"the Dockerfile installs {named}, the checkout builds {wheel.name}"
    return [r.replace(f"file:///tmp/wheels/{wheel.name}", wheel.as_uri()) for r in requirements]


def uv_run(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``uv`` from its cache alone first (seconds, when the cache is warm), then with the
    index (when it is not)."""
    offline = subprocess.run([str(uv()), *args, "--offline"], capture_output=True, text=True, timeout=timeout)
    if offline.returncode == 0:
        return offline
    return subprocess.run([str(uv()), *args], capture_output=True, text=True, timeout=timeout)


def test_the_pip_line_installs_with_the_checkouts_wheel_into_a_fresh_venv(wheel: Path, tmp_path: Path) -> None:
    """The Dockerfile's requirement strings, as it writes them, into a new virtualenv of
    this interpreter: ``volley_dagster.dagster``, ``dagster_k8s`` and ``dagster_postgres``
    import, and ``dagster api grpc`` takes every flag of the image's command."""
    venv = tmp_path / "venv"
    made = subprocess.run([str(uv()), "venv", "--quiet", "--python", sys.executable, str(venv)],
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    started = time.monotonic()
    installed = uv_run(["pip", "install", "--quiet", "--python", str(python),
                        *with_local_wheel(pip_requirements(FINAL), wheel)])
    assert installed.returncode == 0, installed.stderr[-4000:]
    print(f"installed in {time.monotonic() - started:.1f} s")
    imported = subprocess.run([str(python), "-c", "import volley_dagster.dagster, dagster_k8s, dagster_postgres; "
                               "from dagster_k8s import K8sRunLauncher; print(K8sRunLauncher.__name__)"],
                              capture_output=True, text=True, timeout=300)
    assert imported.returncode == 0 and imported.stdout.strip() == "K8sRunLauncher", imported.stderr[-4000:]
    helped = subprocess.run([str(venv / "bin" / "dagster"), "api", "grpc", "--help"],
                            capture_output=True, text=True, timeout=300)
    assert helped.returncode == 0, helped.stderr[-4000:]
    (cmd,) = FINAL.all("CMD")
    for flag in [w for w in json.loads(cmd) if w.startswith("-")]:
        assert re.search(rf"(^|[\s,]){re.escape(flag)}[\s,]", helped.stdout), f"dagster api grpc takes no {flag}"


@pytest.mark.parametrize("platform", ["x86_64-manylinux_2_28", "aarch64-manylinux_2_28"])
def test_the_pip_line_resolves_for_the_images_python_with_wheels_but_pysparks(wheel: Path, tmp_path: Path,
                                                                              platform: str) -> None:
    """For the image's Python on Linux amd64 and arm64 (glibc 2.28, under bookworm's
    2.36): every package has a wheel but pyspark, whose sdist is pure Python, so the
    slim image, with no compiler, installs it."""
    requirements = tmp_path / "requirements.in"
    requirements.write_text("\n".join(with_local_wheel(pip_requirements(FINAL), wheel)) + "\n")
    resolved = uv_run(["pip", "compile", "--quiet", "--python-version", python_version(FINAL.image),
                       "--python-platform", platform, "--only-binary", ":all:", "--no-binary", "pyspark",
                       str(requirements), "-o", str(tmp_path / "requirements.txt")])
    assert resolved.returncode == 0, resolved.stderr[-4000:]
    pins = (tmp_path / "requirements.txt").read_text()
    for name in ("dagster", "dagster-k8s", "dagster-postgres", "dagster-deltalake", "pyspark", "rocksdict"):
        assert re.search(rf"^{name}==", pins, re.M), f"{name} not in the resolution"


# -- the page's Helm values ---------------------------------------------------------------------

# The chart's keys that the page may use, as Dagster's Helm chart defines them (repository
# dagster-io/dagster, helm/dagster/schema/schema/charts/): the code location in
# dagster_user_deployments/subschema/user_deployments.py (UserDeployments, UserDeployment),
# the launcher in dagster/subschema/run_launcher.py (RunLauncher), the daemon in
# dagster/subschema/daemon.py (RunCoordinator, QueuedRunCoordinatorConfig, RunRetries), pools in
# dagster/subschema/concurrency.py (Concurrency, ConcurrencyPools, ConcurrencyRuns). The daemon's
# runMonitoring is a free mapping there: its keys are those templates/configmap-instance.yaml
# renders into run_monitoring. A key ending in "*" holds Kubernetes objects, passed on as they are.
CHART_KEYS = {
    "dagster-user-deployments.enabled",
    "dagster-user-deployments.deployments[].name",
    "dagster-user-deployments.deployments[].image.repository",
    "dagster-user-deployments.deployments[].image.tag",
    "dagster-user-deployments.deployments[].image.pullPolicy",
    "dagster-user-deployments.deployments[].dagsterApiGrpcArgs",
    "dagster-user-deployments.deployments[].port",
    "dagster-user-deployments.deployments[].env*",
    "dagster-user-deployments.deployments[].envConfigMaps*",
    "dagster-user-deployments.deployments[].envSecrets*",
    "dagster-user-deployments.deployments[].volumes*",
    "dagster-user-deployments.deployments[].volumeMounts*",
    "dagster-user-deployments.deployments[].resources*",
    "dagster-user-deployments.deployments[].includeConfigInLaunchedRuns.enabled",
    "runLauncher.type",
    "runLauncher.config.k8sRunLauncher.jobNamespace",
    "runLauncher.config.k8sRunLauncher.envSecrets*",
    "runLauncher.config.k8sRunLauncher.volumes*",
    "runLauncher.config.k8sRunLauncher.volumeMounts*",
    "runLauncher.config.k8sRunLauncher.runK8sConfig*",
    "dagsterDaemon.runCoordinator.enabled",
    "dagsterDaemon.runCoordinator.type",
    "dagsterDaemon.runCoordinator.config.queuedRunCoordinator.dequeueIntervalSeconds",
    "dagsterDaemon.runMonitoring.enabled",
    "dagsterDaemon.runMonitoring.pollIntervalSeconds",
    "dagsterDaemon.runMonitoring.startTimeoutSeconds",
    "dagsterDaemon.runMonitoring.maxResumeRunAttempts",
    "dagsterDaemon.runRetries.enabled",
    "dagsterDaemon.runRetries.maxRetries",
    "dagsterDaemon.runRetries.retryOnAssetOrOpFailure",
    "concurrency.enabled",
    "concurrency.pools.granularity",
    "concurrency.pools.defaultLimit",
    "concurrency.pools.opGranularityRunBuffer",
    "concurrency.runs.maxConcurrentRuns",
    "concurrency.runs.tagConcurrencyLimits*",
}

# How the chart writes those values into dagster.yaml (its templates: helpers/instance/
# _run-coordinator.tpl, _concurrency.tpl, configmap-instance.yaml).
CHART_TO_INSTANCE = {
    "dagsterDaemon.runCoordinator.config.queuedRunCoordinator.dequeueIntervalSeconds":
        "run_coordinator.config.dequeue_interval_seconds",
    "dagsterDaemon.runMonitoring.enabled": "run_monitoring.enabled",
    "dagsterDaemon.runMonitoring.pollIntervalSeconds": "run_monitoring.poll_interval_seconds",
    "dagsterDaemon.runMonitoring.startTimeoutSeconds": "run_monitoring.start_timeout_seconds",
    "dagsterDaemon.runRetries.enabled": "run_retries.enabled",
    "dagsterDaemon.runRetries.maxRetries": "run_retries.max_retries",
    "dagsterDaemon.runRetries.retryOnAssetOrOpFailure": "run_retries.retry_on_asset_or_op_failure",
    "concurrency.pools.granularity": "concurrency.pools.granularity",
    "concurrency.pools.defaultLimit": "concurrency.pools.default_limit",
}
QUEUED = {"module": "dagster.core.run_coordinator", "class": "QueuedRunCoordinator"}  # _run-coordinator.tpl

# What `volley dagster-instance` prints that the page leaves out, and why it may (the page says so too).
LEFT_OUT = {
    # frees slots that ended runs still hold; pools of granularity "run" claim none (Dagster's
    # InstanceConcurrencyContext.claim returns before claiming when the granularity is run)
    "run_monitoring.free_slots_after_run_end_seconds",
}


def flat(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every leaf, a list's items under ``[]``; a key of
    ``CHART_KEYS`` ending in ``*`` is a leaf, whatever it holds."""
    if prefix and f"{prefix}*" in CHART_KEYS:
        yield f"{prefix}*", value
    elif isinstance(value, dict):
        for key, inner in value.items():
            yield from flat(inner, f"{prefix}.{key}" if prefix else key)
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        for item in value:
            yield from flat(item, f"{prefix}[]")
    else:
        yield prefix, value


def test_the_helm_values_use_only_keys_the_chart_defines() -> None:
    for values in [helm_location(), *page_yaml(INSTANCE_HEADING)]:
        unknown = sorted({key for key, _ in flat(values)} - CHART_KEYS)
        assert not unknown, f"keys the chart does not define: {unknown}"


def rendered_instance() -> dict[str, Any]:
    """The dagster.yaml sections the chart writes from the page's values for the
    daemon's settings (the rest, storage and the launcher, are the chart's own)."""
    (values,) = page_yaml(INSTANCE_HEADING)
    leaves = dict(flat(values))
    assert leaves["runLauncher.type"] == "K8sRunLauncher"
    assert leaves["dagsterDaemon.runCoordinator.enabled"] is True
    assert leaves["dagsterDaemon.runCoordinator.type"] == "QueuedRunCoordinator"
    assert leaves["concurrency.enabled"] is True  # without it the chart writes no concurrency section
    instance: dict[str, Any] = {"run_coordinator": dict(QUEUED)}
    for key, value in leaves.items():
        if key in CHART_TO_INSTANCE:
            *path, last = CHART_TO_INSTANCE[key].split(".")
            node = instance
            for part in path:
                node = node.setdefault(part, {})
            node[last] = value
    return instance


def test_the_instance_values_are_what_volley_dagster_instance_prints() -> None:
    """Merging ``volley dagster-instance``'s sections into what the chart writes changes
    only what the page leaves out, and nothing the chart writes disagrees with them."""
    _, changes = merged_settings(rendered_instance())
    assert sorted(c.split(":")[0] for c in changes) == sorted(LEFT_OUT), changes
    settings = dict(flat(instance_settings()))
    assert LEFT_OUT <= set(settings)  # a setting that is gone is not left out any more


def test_dagster_loads_that_instance_and_the_pipelines_check_finds_nothing_missing(tmp_path: Path) -> None:
    """The sections, as the chart writes them, in a ``dagster.yaml`` (with Dagster's
    default local storage): Dagster accepts them, and ``instance_problems`` (the
    ``instance_settings`` check) names nothing."""
    (tmp_path / "dagster.yaml").write_text(yaml.safe_dump(rendered_instance()))
    instance = DagsterInstance.from_config(str(tmp_path))
    try:
        assert instance.run_retries_enabled and instance.run_monitoring_enabled
        assert instance_problems(instance, "payments") == []
    finally:
        instance.dispose()


def test_the_component_yaml_uses_the_components_attributes_and_the_shared_volume() -> None:
    """Its attributes are the component's; the checkpoint root is on the volume the Helm
    values mount; every variable it reads, the code location's ``env`` sets; Spark is a
    Connect server or a standalone master."""
    spec = component_yaml()
    assert spec["type"] == "volley_dagster.dagster.component.VolleyPipelines"
    attributes = spec["attributes"]
    assert set(attributes) <= {f.name for f in fields(VolleyPipelines)}
    deployment = code_location()
    (mount,) = [m["mountPath"] for m in deployment["volumeMounts"]]
    assert attributes["checkpoints_root"].startswith(f"{mount}/")
    variables = {e["name"]: e.get("value") for e in deployment["env"]}
    assert variables["VOLLEY_CHECKPOINTS"] == attributes["checkpoints_root"]
    assert variables["VOLLEY_WAREHOUSE"] == attributes["warehouse"]
    for name in re.findall(r"\{\{\s*env\.(\w+)\s*\}\}", yaml.safe_dump(attributes)):
        assert name in variables, f"the component reads {name}, which the code location's env does not set"
    assert variables["VOLLEY_SNAPSHOT_STORE"].startswith("s3://")
    assert variables["VOLLEY_SPARK_REMOTE"].startswith("sc://")
    (claim,) = [v["persistentVolumeClaim"]["claimName"] for v in deployment["volumes"]]
    assert claim and deployment["includeConfigInLaunchedRuns"] == {"enabled": True}


def test_the_page_names_files_that_exist() -> None:
    """Every file the page names (a test, a module, the Dockerfile) is in the checkout;
    the engine's modules may be named from inside the package."""
    named = set(re.findall(r"`([\w./-]+\.(?:py|md|yaml)|deploy/Dockerfile)`", PAGE.read_text()))
    assert "deploy/Dockerfile" in named and "tests/adoption/test_dockerfile.py" in named
    missing = [n for n in named if not (ROOT / n).exists() and not (ROOT / "volley_dagster" / n).exists()]
    assert not missing, missing
