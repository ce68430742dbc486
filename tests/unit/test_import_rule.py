"""The import rule of docs/architecture.md, checked on every module's source.

`backend/cli` and `backend/api` -> `backend/worker` -> `backend/engine` -> `backend/services` ->
`backend/core`; `agents/` imports no backend code; `agents/tree` and `agents/verify` import no I/O
library; `frontend/` imports only `client/` of Grove's own packages. No module reaches itself through its
imports (any import, a deferred one inside a function too).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYER = {"core": 0, "services": 1, "engine": 2, "worker": 3, "api": 4, "cli": 4}
IO = {"os", "io", "subprocess", "socket", "shutil", "tempfile", "pathlib", "urllib", "http", "sqlite3",
      "sqlmodel", "sqlalchemy", "redis", "celery", "httpx", "requests", "fastapi", "litellm", "langgraph",
      "torch", "streamlit"}  # fmt: skip
OURS = {"agents", "backend", "client", "frontend"}


def imports(path: Path) -> set[str]:
    """Return the absolute module names a file imports (anywhere in it, type-checking blocks too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text("utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def module_of(path: Path) -> str:
    """Return the dotted module name of a source file (a package is its `__init__`'s folder)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def edges(path: Path, known: set[str]) -> set[str]:
    """Return the modules of ours a file imports: `from a import b` names `a.b` where that is a module."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text("utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            subs = {f"{node.module}.{a.name}" for a in node.names} & known
            out |= subs or ({node.module} & known)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Return the import cycles of a module graph, one per strongly connected group (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while (w := stack.pop()) != v:
                group.append(w)
            group.append(v)
            if len(group) > 1 or v in graph.get(v, ()):
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def breaks(path: Path, module: str) -> str:
    """Return how `path` importing `module` breaks the rule ('' where it does not)."""
    rel = path.relative_to(ROOT).parts
    head = module.split(".")
    if rel[0] == "backend" and head[0] == "backend" and len(rel) > 2 and len(head) > 1:
        src, dst = rel[1], head[1]
        if src in LAYER and dst in LAYER and LAYER[dst] > LAYER[src]:
            return f"backend/{src} may not import backend/{dst}"
    if rel[0] == "agents" and head[0] == "backend":
        return "agents/ imports no backend code"
    if rel[:2] in (("agents", "tree"), ("agents", "verify")) and head[0] in IO:
        return f"{'/'.join(rel[:2])} imports no I/O library"
    if rel[0] == "frontend" and head[0] in OURS - {"client", "frontend"}:
        return "frontend/ imports only client/"
    return ""


def test_every_module_keeps_the_import_rule() -> None:
    broken = [
        f"{path.relative_to(ROOT)}: {module} ({why})"
        for package in ("backend", "agents", "frontend")
        for path in sources(package)
        for module in sorted(imports(path))
        if (why := breaks(path, module))
    ]
    assert broken == []


def test_no_module_reaches_itself_through_its_imports() -> None:
    files = [path for package in sorted(OURS) for path in sources(package)]
    known = {module_of(path) for path in files}
    graph = {module_of(path): edges(path, known) - {module_of(path)} for path in files}
    assert cycles(graph) == []


def test_the_cycle_check_finds_a_cycle_through_a_deferred_import() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c"], ["e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_every_backend_folder_has_a_layer() -> None:
    folders = {p.name for p in (ROOT / "backend").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(LAYER)


@pytest.mark.parametrize(
    ("path", "module", "broken"),
    [
        ("backend/services/studies.py", "backend.engine.workspace", True),
        ("backend/engine/trial.py", "backend.services.records", False),
        ("backend/core/db.py", "backend.api.deps", True),
        ("agents/llm/model.py", "backend.core.models", True),
        ("agents/tree/sequential.py", "numpy", False),
        ("agents/verify/checks.py", "subprocess", True),
        ("frontend/app.py", "agents.spec", True),
        ("frontend/app.py", "client.api", False),
    ],
)
def test_the_check_tells_a_broken_import_from_a_kept_one(path: str, module: str, broken: bool) -> None:
    assert bool(breaks(ROOT / path, module)) is broken
