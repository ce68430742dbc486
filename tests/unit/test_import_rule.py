"""The import rule of docs/architecture.md, checked on every module's source.

`backend/cli` and `backend/api` -> `backend/worker` -> `backend/engine` -> `backend/services` ->
`backend/core`; `agents/` imports no backend code; `agents/tree` and `agents/verify` import no I/O
library; `frontend/` imports only `client/` of Grove's own packages.
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


def test_every_backend_folder_has_a_layer() -> None:
    folders = {p.name for p in (ROOT / "backend").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(LAYER)


@pytest.mark.parametrize(
    ("path", "module", "broken"),
    [
        ("backend/services/studies.py", "backend.engine.workspace", True),
        ("backend/engine/trial.py", "backend.services.records", False),
        ("backend/core/db.py", "backend.api.deps", True),
        ("agents/policies/llm/model.py", "backend.core.models", True),
        ("agents/tree/sequential.py", "numpy", False),
        ("agents/verify/checks.py", "subprocess", True),
        ("frontend/app.py", "agents.spec", True),
        ("frontend/app.py", "client.api", False),
    ],
)
def test_the_check_tells_a_broken_import_from_a_kept_one(path: str, module: str, broken: bool) -> None:
    assert bool(breaks(ROOT / path, module)) is broken
