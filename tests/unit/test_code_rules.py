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


# Fields that hold a state or a kind: compared with a member of its enum, never with a string literal.
STATE_FIELDS = frozenset({"status", "kind", "origin", "judge", "mode", "decision", "verdict", "outcome", "level",
                          "stop_rule", "blame", "rejection", "step", "teacher", "support", "method"})  # fmt: skip
# Protocol words that share a field's name: an HTTP request's method.
PROTOCOL = frozenset({"request.method"})
# Fields that hold sentences written for people: no decision is read from their words.
SENTENCES = frozenset({"reason", "fate", "failure", "insight", "gate_reason", "stop_reason", "status_reason",
                       "why", "summary", "lesson", "refine_outcome", "obs", "detail"})  # fmt: skip


def _field(node: ast.AST) -> tuple[str, str]:
    """Return the field an expression reads (a name, an attribute, a `[key]` or `.get(key)`) and its path."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        key = node.args[0] if node.args else None
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            return key.value, f"{_dotted(node.func.value)}[{key.value}]"
        return "", ""
    name = _dotted(node)
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return str(node.slice.value), name
    return (name.rsplit(".", 1)[-1], name) if name else ("", "")


def _words(node: ast.AST) -> bool:
    """Return whether an expression is a string literal or a tuple, list or set of them ('' is no words)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value != ""
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return bool(node.elts) and all(
            isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts
        )
    return False


def state_literals(source: str) -> list[int]:
    """Return the lines that compare a state-like field with a string literal."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        for op, a, b in zip(node.ops, sides, sides[1:], strict=False):
            if not isinstance(op, ast.Eq | ast.NotEq | ast.In | ast.NotIn):
                continue
            for x, y in ((a, b), (b, a)):
                field, path = _field(x)
                if field in STATE_FIELDS and path not in PROTOCOL and _words(y):
                    lines.append(node.lineno)
    return sorted(set(lines))


def sentence_reads(source: str) -> list[int]:
    """Return the lines that decide something from the words of a sentence meant for people."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            method, target = node.func.attr, node.func.value
            if method in ("startswith", "endswith") and _field(target)[0] in SENTENCES:
                lines.append(node.lineno)
            pattern = _dotted(node.func) in ("re.search", "re.match", "re.fullmatch") and len(node.args) > 1
            if pattern and _field(node.args[1])[0] in SENTENCES:
                lines.append(node.lineno)
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            for op, a, b in zip(node.ops, sides, sides[1:], strict=False):
                words_in = isinstance(op, ast.In | ast.NotIn) and _words(a) and _field(b)[0] in SENTENCES
                equal = isinstance(op, ast.Eq | ast.NotEq) and any(
                    _words(x) and _field(y)[0] in SENTENCES for x, y in ((a, b), (b, a))
                )
                if words_in or equal:
                    lines.append(node.lineno)
    return sorted(set(lines))


def test_no_state_is_compared_with_a_string() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in product_files()
        for line in state_literals(path.read_text("utf-8"))
    ]
    assert found == [], "compare with the state's enum member (agents/tree/status.py, backend/core/states.py)"


def test_no_decision_is_read_from_a_sentence() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in product_files()
        for line in sentence_reads(path.read_text("utf-8"))
    ]
    assert found == [], "record what the decision needs as a field beside the sentence"


@pytest.mark.parametrize(
    ("source", "states", "sentences"),
    [
        ('if job.status == "done": pass', True, False),
        ('ok = n["status"] in ("merged", "awaiting_approval")', True, False),
        ('x = [j for j in jobs if j.kind != "gate"]', True, False),
        ('if c.get("verdict") == "satisfied": pass', True, False),
        ('if "pending" == appr.status: pass', True, False),
        ("if job.status == JobStatus.DONE: pass", False, False),
        ('if request.method == "GET": pass', False, False),
        ('if m["role"] == "tool": pass', False, False),
        ('if node.gate_reason.startswith("passed"): pass', False, True),
        ('if "constraint" in n["fate"]: pass', False, True),
        ('if st.stop_reason == "stopped by user": pass', False, True),
        ('m = re.search(r"refined as (n\\d+)", fate)', False, True),
        ("if r.evidence.insight.startswith(PREFIX): pass", False, True),
        ("if node.gate_passed: pass", False, False),
        ('ok = reason == ""', False, False),
        ('label = f"held-out gate: {n.gate_reason}"', False, False),
    ],
)
def test_the_checks_tell_a_string_compared_from_a_field(source: str, states: bool, sentences: bool) -> None:
    assert bool(state_literals(source)) is states
    assert bool(sentence_reads(source)) is sentences


MODULE_LINES = 600  # a product module longer than this mixes concerns: split it along its seams
ENGINE_FUNCTION_LINES = 80  # a function of backend/engine longer than this is a sequence of steps to name


def test_no_product_module_is_over_its_length() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in product_files()
        if (n := len(p.read_text("utf-8").splitlines())) > MODULE_LINES
    }
    assert long == {}


def long_functions(source: str, limit: int) -> list[str]:
    """Return the functions of a module longer than `limit` lines (methods and inner functions too)."""
    return [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and (node.end_lineno or node.lineno) - node.lineno + 1 > limit
    ]


def test_no_engine_function_is_over_its_length() -> None:
    found = {
        str(p.relative_to(ROOT)): got
        for p in sorted((ROOT / "backend" / "engine").rglob("*.py"))
        if (got := long_functions(p.read_text("utf-8"), ENGINE_FUNCTION_LINES))
    }
    assert found == {}


def test_the_length_check_counts_a_function_from_its_def_to_its_last_line() -> None:
    body = "def f():\n" + "    x = 1\n" * 80
    assert long_functions(body, 80) == ["f (81 lines)"]
    assert long_functions("def g():\n    pass\n", 80) == []


# The one module that creates (or updates in bulk) each kind of row; a row read back from JSON is no write.
WRITERS = {"Approval": {"backend/services/approvals.py"},
           "Node": {"backend/services/proposals.py", "backend/services/studies.py"}}  # fmt: skip


def row_writes(source: str) -> list[tuple[str, int]]:
    """Return the rows of the WRITERS kinds a module makes (`Node(...)`) or updates (`update(Node)`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            continue
        name = node.func.id
        if name in WRITERS and not (
            node.keywords and all(k.arg is None for k in node.keywords) and not node.args
        ):
            found.append((name, node.lineno))
        if (
            name == "update"
            and node.args
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id in WRITERS
        ):
            found.append((node.args[0].id, node.lineno))
    return found


def test_each_kind_of_row_has_one_writer() -> None:
    strays = [
        f"{rel}:{line} ({kind})"
        for path in product_files()
        if (rel := str(path.relative_to(ROOT)))
        for kind, line in row_writes(path.read_text("utf-8"))
        if rel not in WRITERS[kind]
    ]
    assert strays == [], "write it through the module that owns that kind of row"


def test_the_writer_check_tells_a_new_row_from_one_read_back() -> None:
    assert row_writes("a = Approval(study_id=1, node_id=2)") == [("Approval", 1)]
    assert row_writes("q = update(Node).where(x)") == [("Node", 1)]
    assert row_writes("n = Node(**got['node'])") == []
