"""The README's commands, taken from the README itself: every `./dev` and `volley`
command names a command and flags that exist, the Python blocks import what exists, and the first command and the
first pipeline run as a newcomer would run them (on a smaller log)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from volley_dagster.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def commands() -> list[list[str]]:
    """Each command line of the README's bash blocks, without its comment."""
    lines = [line.split("  #")[0].strip() for block in blocks("bash") for line in block.splitlines()]
    return [shlex.split(line) for line in lines if line and not line.startswith("#")]


def dev_commands() -> set[str]:
    return set(re.findall(r"^  ([a-z-]+)\)", (ROOT / "dev").read_text(), flags=re.M))


def test_the_readme_has_the_two_commands_first():
    assert commands()[:2] == [["./dev", "demo"], ["./dev", "test"]]


def bench_flags(name: str) -> set[str]:
    """The flags a bench script's parser takes: its ``add_argument("--...")`` calls and
    those of the bench modules it imports (read, not run: each would start importing Spark)."""
    script = ROOT / "bench" / f"{name}.py"
    assert script.exists(), f"./dev bench {name}: no bench/{name}.py"
    text = script.read_text()
    text += "".join((ROOT / "bench" / f"{m}.py").read_text() for m in re.findall(r"^from bench\.(\w+) import", text, re.M))
    return set(re.findall(r'add_argument\(\s*"(--[\w-]+)"', text))


def check_dev(argv: list[str]) -> None:
    """A ``./dev`` command names one of its commands, and flags that it takes."""
    assert argv[0] == "./dev" and argv[1] in dev_commands(), f"./dev has no command {argv[1]!r}: {argv}"
    if argv[1] == "bench":
        flags = bench_flags(argv[2])
        for flag in (a for a in argv[3:] if a.startswith("--")):
            assert flag in flags, f"./dev bench {argv[2]} takes no {flag}: {argv}"
    elif argv[1] in ("demo", "spark-connect"):  # ./dev passes the rest to `volley <command>`
        build_parser().parse_args([argv[1], *argv[2:]])


def test_every_dev_and_volley_command_exists_with_its_flags():
    checked = 0
    for argv in commands():
        if argv[0] == "./dev":
            check_dev(argv)
        else:
            assert argv[0] == ".venv/bin/volley", f"a README command this test does not know: {argv}"
            build_parser().parse_args(argv[1:])  # exits 2 naming an unknown command or flag
        checked += 1
    assert checked >= 10


def test_the_python_blocks_import_what_exists():
    for block in blocks("python"):
        compile(block, "README.md", "exec")
        imports = "\n".join(line for line in block.splitlines() if line.startswith(("from ", "import ")))
        exec(compile(imports, "README.md", "exec"), {})


def test_the_first_command_and_the_pipeline_in_a_few_lines_run(tmp_path, spark, capsys, monkeypatch):
    """``./dev demo`` is the set-up ``./dev test`` runs too, then ``volley demo``: run here
    in this process, on the session's Spark, as are the README's ``volley`` commands."""
    work = tmp_path / "demo"
    assert main(["demo", "--workdir", str(work), "--files", "1", "--records-per-file", "1000", "--keys", "200",
                 "--max-records", "1000"]) == 0
    shown = capsys.readouterr().out
    assert "http://127.0.0.1:3000" in shown and "checkpoint layout" in shown and "merchant_minutes" in shown
    for argv in commands():  # the README's own commands, over the demo's state
        if argv[0] == ".venv/bin/volley":
            assert main([a.replace("demo/", f"{work}/") for a in argv[1:]]) == 0, argv
    assert "epochs from 2 on run with 7 shards" in capsys.readouterr().out

    from volley_dagster.demo.events import generate

    monkeypatch.chdir(tmp_path)  # the first Python block, in a folder with events where it reads them
    generate(tmp_path / "data" / "events", 2, 1_000, 100)
    scope: dict = {}
    exec(compile(blocks("python")[0], "README.md", "exec"), scope)
    runner = scope["runner"]
    assert runner.committed_epoch() >= 1 and runner.read_state().num_rows == 100
    assert any((tmp_path / "out").iterdir())
