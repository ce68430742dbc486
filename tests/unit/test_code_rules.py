"""Rules of the code that a type checker cannot hold, checked on every product module's source."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("agents", "backend", "client", "frontend")
# Where a policy's kind may be looked at: the table of what each kind does, and the factory.
KIND_OWNERS = {"agents/capabilities.py", "agents/policies/registry.py"}


def product_files() -> list[Path]:
    return sorted(
        p for package in PRODUCT for p in (ROOT / package).rglob("*.py") if "migrations" not in p.parts
    )


def _dotted(node: ast.AST) -> str:
    """Return `a.b.c` for an attribute chain (a subscript by a string as `a[b]`), else ''."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return f"{head}.{node.attr}" if head else f"?.{node.attr}"
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        head = _dotted(node.value)
        return f"{head}[{node.slice.value}]"
    return ""


def is_policy_kind(node: ast.AST) -> bool:
    """Return whether an expression reads a policy's kind (`spec.policy_kind`, `policy.name`, ...)."""
    name = _dotted(node)
    last = name.rsplit(".", 1)[-1]
    return last == "policy_kind" or name.endswith(("policy.kind", "policy.name")) or name.endswith("[policy]")


def kind_comparisons(source: str) -> list[int]:
    """Return the lines that compare a policy's kind with anything but None."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        unset = (
            all(isinstance(c, ast.Constant) and c.value is None for c in node.comparators)
            if isinstance(node, ast.Compare)
            else False
        )
        if (
            isinstance(node, ast.Compare)
            and not unset
            and any(map(is_policy_kind, [node.left, *node.comparators]))
        ):
            lines.append(node.lineno)
        if isinstance(node, ast.Match) and is_policy_kind(node.subject):
            lines.append(node.lineno)
    return lines


def test_no_caller_compares_a_policy_kind() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in product_files()
        if str(path.relative_to(ROOT)) not in KIND_OWNERS
        for line in kind_comparisons(path.read_text("utf-8"))
    ]
    assert found == [], "ask the policy's capabilities (agents/capabilities.py) instead"


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ('if spec.policy_kind == "llm": pass', True),
        ('x = study.spec.policy_kind != "search"', True),
        ('if policy.name == "llm": pass', True),
        ('if ctx.policy.kind in ("llm",): pass', True),
        ('if s["policy"] == "llm": pass', True),
        ("match spec.policy_kind:\n    case 'llm': pass", True),
        ("if spec.capabilities.calls_model: pass", False),
        ('if node.name == "llm": pass', False),
        ("if spec.policy.kind is not None: pass", False),
    ],
)
def test_the_kind_check_tells_a_comparison_from_a_capability(source: str, found: bool) -> None:
    assert bool(kind_comparisons(source)) is found


def test_the_readme_is_an_entry_point_whose_links_lead_somewhere() -> None:
    text = (ROOT / "README.md").read_text("utf-8")
    assert len(text.splitlines()) <= 200
    assert "```bash\nbash scripts/example.sh\n```" in text
    assert "```bash\nbash scripts/test.sh\n```" in text
    for page in sorted(set(re.findall(r"\]\(((?:docs/)?[\w./-]+\.md)\)", text))):
        assert (ROOT / page).is_file(), page
    for doc in sorted((ROOT / "docs").glob("*.md")):
        for page in re.findall(r"\]\(([\w./-]+\.md)\)", doc.read_text("utf-8")):
            assert (doc.parent / page).resolve().is_file(), f"{doc.name}: {page}"
