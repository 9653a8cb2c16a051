"""docs/your-project.md followed as a new user follows it: every block in order, from
the wheel built from this checkout, in a fresh virtualenv, in a project made by
``create-dagster project``, to epochs committed by the cut job and ``dg launch``, then
by the sensor under ``dg dev``, a downstream asset reading the table, and the factory
in place of the YAML.

The page reads as one shell session: each ``bash`` block runs in the folder and
environment the blocks before it left (``source .venv/bin/activate`` holds on). A
``python`` block whose first line is ``# src/...py`` is that file of the project:
written, or, where ``dg scaffold`` wrote it, compared with what it wrote; any other
runs with the project's interpreter, after the imports of those before it. The
``yaml`` block is compared with the ``defs.yaml`` the scaffold wrote. ``dg dev``
runs in the background on a free port until the sensor has committed the epoch the
file before it landed. The one thing the test adds: ``UV_FIND_LINKS`` points at the
wheel, as the page tells a user to do until the package is on an index.

Deep lane: the install and five Spark runs take several minutes. No mocks: the
project's own Dagster, Spark (Java 17) and the tables on disk."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from dagster import AssetKey, DagsterInstance, DagsterRunStatus, RunsFilter
from deltalake import DeltaTable

from harness.processes import free_port, tail
from tests.adoption.wheel import build_wheel, uv
from tests.test_docs import RUN_LANGUAGES, Block, imports_of, parse_page
from volley_dagster.checkpoint.epoch_log import EpochLog

pytestmark = [pytest.mark.deep, pytest.mark.spark]

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "your-project.md"
PROJECT_FILE = re.compile(r"\A# (src/\S+\.py)\n")
SCAFFOLDED_YAML = "src/team_project/defs/payments/defs.yaml"
BLOCK_TIMEOUT_S = 900  # the install, on a cold uv cache, downloads PySpark
SENSOR_TIMEOUT_S = 300


@dataclass
class Shell:
    """The page's shell session: its folder and exported environment, carried from one
    block to the next as a terminal carries them."""

    cwd: Path
    env: dict[str, str]
    state: Path
    outputs: list[tuple[str, str]] = field(default_factory=list)  # (block name, what it printed)

    def run(self, b: Block) -> str:
        saved = self.state / "env.sh"
        script = "\n".join([
            "set -euo pipefail",
            f"[ -f {shlex.quote(str(saved))} ] && source {shlex.quote(str(saved))}",
            f"cd {shlex.quote(str(self.cwd))}",
            b.text,
            f"pwd > {shlex.quote(str(self.state / 'cwd'))}",
            f"export -p | grep -v -E '^declare -x (OLDPWD|PWD|SHLVL|_)=' > {shlex.quote(str(saved))}",
        ])
        done = subprocess.run(["bash", "-c", script], env=self.env, capture_output=True, text=True,
                              timeout=BLOCK_TIMEOUT_S)
        printed = done.stdout + done.stderr
        assert done.returncode == 0, f"{b.name} exited {done.returncode}:\n{b.text}\n--- it printed:\n{printed[-6000:]}"
        self.cwd = Path((self.state / "cwd").read_text().strip())
        self.outputs.append((b.name, printed))
        return printed

    def environment(self) -> dict[str, str]:
        """The session's environment now, for a process the test starts in it."""
        printed = subprocess.run(["bash", "-c", f"source {shlex.quote(str(self.state / 'env.sh'))}; env -0"],
                                 env=self.env, capture_output=True, text=True, check=True).stdout
        return dict(line.split("=", 1) for line in printed.split("\0") if "=" in line)


SUITE_VARIABLES = ("VOLLEY_", "PYSPARK_", "DAGSTER_", "PYTEST_", "VIRTUAL_ENV", "PYTHONPATH", "SPARK_")


def clean_env(wheel_dir: Path, tools: Path) -> dict[str, str]:
    """A new user's terminal on this machine: its environment (certificates, proxies,
    Java) without the suite's own settings, and its PATH without this checkout's venv
    (only uv from it, as the page asks for uv)."""
    ours = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith(SUITE_VARIABLES)}
    env["PATH"] = ":".join([str(tools), *(p for p in os.environ["PATH"].split(":") if p and p != ours)])
    env.update({"UV_FIND_LINKS": str(wheel_dir), "DAGSTER_DISABLE_TELEMETRY": "true"})
    return env


def project_file(shell: Shell, b: Block) -> None:
    match = PROJECT_FILE.match(b.text)
    assert match
    path, text = shell.cwd / match.group(1), b.text[match.end():]
    if path.exists():  # written by the scaffold: the page shows it as it is
        assert path.read_text() == text, f"{b.name} differs from the {match.group(1)} dg scaffold wrote"
    else:
        path.write_text(text)


def run_script(shell: Shell, b: Block, earlier: list[Block]) -> None:
    imports = [line for other in earlier for line in imports_of(other.text)]
    python = shell.environment()["VIRTUAL_ENV"] + "/bin/python"
    done = subprocess.run([python, "-c", "\n".join([*imports, b.text])], cwd=shell.cwd, env=shell.environment(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{b.name}:\n{done.stderr[-4000:]}"


def serve_until_committed(shell: Shell, b: Block, epoch: int, logs: Path) -> float:
    """``dg dev`` as the block says, on a free port, until the sensor commits ``epoch``;
    the seconds it took."""
    assert shlex.split(b.text) == ["dg", "dev"], b.text
    log = logs / "dg-dev.log"
    started = time.monotonic()
    with log.open("wb") as out:
        server = subprocess.Popen(["dg", "dev", "--host", "127.0.0.1", "--port", str(free_port())], cwd=shell.cwd,
                                  env=shell.environment(), stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        epochs = EpochLog(shell.cwd / "data" / "volley" / "state" / "payments")
        while epochs.last_committed() < epoch:
            assert server.poll() is None, f"dg dev exited {server.returncode}:\n{tail(log)}"
            assert time.monotonic() - started < SENSOR_TIMEOUT_S, (
                f"the sensor did not commit epoch {epoch} in {SENSOR_TIMEOUT_S}s:\n{tail(log, 80)}")
            time.sleep(2)
        return time.monotonic() - started
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)


def stop_leftovers(venv: Path) -> None:
    """What the project's runs left running (a warm Spark server outliving its run by
    design), once the page is done."""
    for proc in psutil.process_iter(["cmdline"]):
        if any(str(venv) in part for part in proc.info["cmdline"] or ()):
            try:
                os.killpg(proc.pid, signal.SIGKILL) if os.getpgid(proc.pid) == proc.pid else proc.kill()
            except (psutil.Error, ProcessLookupError, PermissionError):
                pass


def totals_of(events: Path) -> dict[str, float]:
    """The reference: each key's total over every file landed, summed here."""
    records = pa.concat_tables(pq.read_table(f) for f in sorted(events.rglob("*.parquet")))
    grouped = records.group_by("key").aggregate([("amount", "sum")])
    return dict(zip(grouped["key"].to_pylist(), grouped["amount_sum"].to_pylist(), strict=True))


def delta_totals(project: Path) -> dict[str, float]:
    table = DeltaTable(str(project / "data" / "volley" / "tables" / "delta" / "payments_totals")).to_pyarrow_table()
    return dict(zip(table["key"].to_pylist(), pc.cast(table["total"], pa.float64()).to_pylist(), strict=True))


def test_a_new_user_follows_the_page_from_a_fresh_virtualenv_to_a_downstream_asset(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path / "build")
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "uv").symlink_to(uv())
    work, logs = tmp_path / "work", tmp_path / "logs"
    work.mkdir()
    logs.mkdir()
    state = tmp_path / "shell"
    state.mkdir()
    shell = Shell(work, clean_env(wheel.parent, tools), state)
    blocks = [b for b in parse_page(PAGE) if b.language in (*RUN_LANGUAGES, "yaml")]
    scripts: list[Block] = []
    committed_after: dict[str, int] = {}
    sensor_s = 0.0
    try:
        for b in blocks:
            project = shell.cwd
            if b.language == "yaml":
                assert (project / SCAFFOLDED_YAML).read_text() == b.text, f"{b.name} differs from what dg scaffold wrote"
            elif b.language == "python" and PROJECT_FILE.match(b.text):
                project_file(shell, b)
            elif b.language == "python":
                run_script(shell, b, scripts)
                scripts.append(b)
            elif b.text.strip() == "dg dev":
                sensor_s = serve_until_committed(shell, b, 2, logs)
            else:
                shell.run(b)
            log = shell.cwd / "data" / "volley" / "state" / "payments"
            committed_after[b.name] = EpochLog(log).last_committed() if (log / "pipeline.json").exists() else 0
        project = shell.cwd
        venv = Path(shell.environment()["VIRTUAL_ENV"])
    finally:
        stop_leftovers(work)

    assert venv == work / ".venv" and (venv / "lib").exists()
    installed = subprocess.run([str(venv / "bin" / "python"), "-c", "import volley_dagster, sys; "
                                "print(volley_dagster.__version__, volley_dagster.__file__)"],
                               capture_output=True, text=True, check=True, cwd=project).stdout.split()
    assert installed[1].startswith(str(venv)), installed  # the wheel, not this checkout
    assert wheel.name.startswith(f"volley_dagster-{installed[0]}-")

    # the command line committed epoch 1, the sensor epoch 2, and the factory cut nothing more
    assert committed_after["your-project.md#The first epoch/bash"] == 1
    assert committed_after["your-project.md#The first epoch/bash#2"] == 2 and sensor_s > 0  # dg dev
    assert max(committed_after.values()) == 2
    assert delta_totals(project) == pytest.approx(totals_of(project / "data" / "payments" / "events"))
    first = dict(shell.outputs)["your-project.md#The first epoch/bash"]
    assert "payments: cut epoch 1; registered 1 partition(s); epoch 1 waits to run: the sensor requests them" in first, first[-3000:]
    last = shell.outputs[-1][1]
    assert "nothing waits to be cut" in last and "every cut epoch is committed (the last is 2)" in last, last[-3000:]

    with DagsterInstance.from_config(str(project / ".dagster")) as instance:
        sensor_runs = instance.get_runs(RunsFilter(tags={"dagster/sensor_name": "payments_new_data"},
                                                   statuses=[DagsterRunStatus.SUCCESS]))
        assert sensor_runs, "no successful run of the sensor's"
        report = instance.fetch_materializations(AssetKey(["payments_report"]), limit=1).records
        assert report, "payments_report was not materialized"
        md = report[0].asset_materialization.metadata
        expected = totals_of(project / "data" / "payments" / "events")
        assert md["keys"].value == len(expected) and md["total"].value == pytest.approx(sum(expected.values()))
    shutil.rmtree(venv, ignore_errors=True)  # 1.2 GB

