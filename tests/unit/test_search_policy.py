from __future__ import annotations

import json
from pathlib import Path

import pytest

from agents.policies import configfiles
from agents.policies.base import IdeationInput, ImplementationError, ImplementInput, NodeEvidence
from agents.policies.search import SearchPolicy

SPACE = {
    "c.toml:m.hidden": {"values": [8, 16, 32, 64], "low": None, "high": None, "log": False, "integer": False},
    "c.toml:t.lr": {"values": None, "low": 1e-4, "high": 1e-1, "log": True, "integer": False},
}
BASE = {"c.toml:m.hidden": 8, "c.toml:t.lr": 0.001}


def ev(
    i: int, parent: int | None, edits: dict[str, object], mean: float | None, status: str = "evaluated"
) -> NodeEvidence:
    return NodeEvidence(
        id=i, parent_id=parent, depth=0 if parent is None else 1, status=status, title=f"n{i}",
        edits=edits, origin="policy", dev_mean=mean, dev_std=0.0, dev_n=3,
        gain=None if mean is None else mean - 0.5, gain_lcb=None, dev_metrics={}, constraints=[],
        summary="", insight="",
    )  # fmt: skip


def ctx(nodes: list[NodeEvidence], round_no: int = 0, k: int = 3) -> IdeationInput:
    return IdeationInput(
        goal="g", metric="acc", maximize=True, search_space=SPACE, base_values=BASE, trunk_node_id=1,
        trunk_dev_mean=0.5, nodes=nodes, improvement_state={}, pruned_lessons=[], validated_findings=[],
        refine=[], plateau_level=0, k=k, round_no=round_no, seed=1,
    )  # fmt: skip


def test_ideation_is_deterministic_concrete_and_new() -> None:
    nodes = [ev(1, None, BASE, 0.5, "merged"), ev(2, 1, {**BASE, "c.toml:m.hidden": 16}, 0.6)]
    a = SearchPolicy().ideate(ctx(nodes))
    b = SearchPolicy().ideate(ctx(nodes))
    assert [p.edits for p in a] == [p.edits for p in b] and len(a) == 3
    seen = {json.dumps(n.edits, sort_keys=True) for n in nodes}
    for p in a:
        assert set(p.edits) == set(SPACE)
        assert p.edits["c.toml:m.hidden"] in (8, 16, 32, 64)
        assert 1e-4 <= p.edits["c.toml:t.lr"] <= 1e-1
        assert json.dumps(p.edits, sort_keys=True) not in seen
        assert set(p.hypothesis) == {"mechanism", "hypothesis", "observable", "risks"}
    # Exploit: at least one child is a one-key move under the best node.
    assert any(p.parent_id == 2 for p in a)


def test_ideation_depends_on_round_and_seed() -> None:
    nodes = [ev(1, None, BASE, 0.5, "merged")]
    assert [p.edits for p in SearchPolicy().ideate(ctx(nodes, 0))] != [
        p.edits for p in SearchPolicy().ideate(ctx(nodes, 1))
    ]


@pytest.mark.parametrize(
    ("name", "text", "check"),
    [
        ("c.toml", "# keep me\n[m]\nhidden = 8  # units\n[t]\nlr = 0.001\n", "# keep me"),
        ("c.yaml", "m:\n  hidden: 8\nt:\n  lr: 0.001\n", "hidden: 32"),
        ("c.json", '{\n  "m": {"hidden": 8},\n  "t": {"lr": 0.001}\n}\n', '"hidden": 32'),
    ],
)
def test_implementer_applies_edits_exactly(tmp_path: Path, name: str, text: str, check: str) -> None:
    (tmp_path / name).write_text(text)
    edits = {f"{name}:m.hidden": 32, f"{name}:t.lr": 0.02}
    SearchPolicy().implement(tmp_path, ImplementInput(1, "t", {}, edits, "", [name]))
    new = (tmp_path / name).read_text()
    assert configfiles.get_key(name, new, "m.hidden") == 32
    assert configfiles.get_key(name, new, "t.lr") == 0.02
    assert check in new


def test_implementer_refuses_non_editable_and_escaping_files(tmp_path: Path) -> None:
    (tmp_path / "c.toml").write_text("[m]\nhidden = 8\n")
    with pytest.raises(ImplementationError, match="not editable"):
        SearchPolicy().implement(
            tmp_path, ImplementInput(1, "t", {}, {"c.toml:m.hidden": 4}, "", ["other.toml"])
        )
    outside = tmp_path.parent / "outside.toml"
    outside.write_text("[m]\nhidden = 8\n")
    (tmp_path / "link.toml").symlink_to(outside)
    with pytest.raises(ImplementationError, match="outside the worktree"):
        SearchPolicy().implement(
            tmp_path, ImplementInput(1, "t", {}, {"link.toml:m.hidden": 4}, "", ["*.toml"])
        )
    with pytest.raises(ImplementationError, match="outside the worktree"):
        SearchPolicy().implement(
            tmp_path, ImplementInput(1, "t", {}, {"../outside.toml:m.hidden": 4}, "", ["**"])
        )
    assert "hidden = 8" in outside.read_text()
