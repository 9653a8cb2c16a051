"""The engine's modules import one another without cycles (module-level imports,
``TYPE_CHECKING`` blocks aside): ``checkpoint/`` in layers, operators above state."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[1] / "volley_dagster"


def module_imports() -> dict[str, set[str]]:
    """Each engine module and the engine modules it imports when it is imported (the
    package ``__init__`` aside: importing a submodule through it is not a cycle)."""
    names = {}
    for path in ENGINE.rglob("*.py"):
        parts = path.relative_to(ENGINE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {name: set() for name in names}
    for name, path in names.items():
        for stmt in ast.parse(path.read_text()).body:
            if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.dump(stmt.test):
                continue
            for node in ast.walk(stmt) if isinstance(stmt, (ast.If, ast.Try)) else [stmt]:
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
                elif isinstance(node, ast.Import):
                    targets = [alias.name for alias in node.names]
                else:
                    continue
                graph[name] |= {t for t in targets if t in names and t not in (name, "volley_dagster")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_engine_has_no_import_cycles() -> None:
    graph = module_imports()
    assert len(graph) > 80 and "volley_dagster.checkpoint.epoch_log" in graph["volley_dagster.attempt"]
    assert cycles(graph) == []


def test_a_cycle_is_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_a_shard_task_imports_no_sink_or_table_library() -> None:
    """A Spark Python worker unpickling a shard task imports ``spark/tasks.py`` and its
    operator: the package's lazy names (``lazy_exports``) keep PyIceberg, SQLAlchemy,
    delta-rs, pandas and Dagster out of it (1.4 s of a fresh worker's start)."""
    heavy = ("pyiceberg", "sqlalchemy", "deltalake", "pandas", "dagster")
    code = ("import sys, volley_dagster.spark.tasks, volley_dagster.operators.aggregate, volley_dagster.operators.window; "
            f"print(','.join(m for m in {heavy!r} if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == ""


def test_every_public_name_loads() -> None:
    import volley_dagster
    from volley_dagster import dimensions, sinks

    for package in (volley_dagster, dimensions, sinks):
        assert all(getattr(package, name) is not None for name in package.__all__), package.__name__
