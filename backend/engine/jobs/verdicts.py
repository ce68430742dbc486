"""A gate's verdict as the server keeps it: the bound it recomputes, the checks of reported values, the node's row."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlmodel import Session, col, select

from agents.tree.status import NodeStatus
from backend.core.gitops import Repo
from backend.core.models import Node, ReceiptRow, Study
from backend.core.states import RunKind
from backend.services.records import add_event, transition


@dataclass(frozen=True)
class Bound:
    """A held-out gain with its lower confidence bound, at the level the gate judged it."""

    gain: float
    lcb: float
    level: float  # the bound's one-sided confidence, 1 - alpha (0.95 at the first look)


def record_verdict(
    s: Any,
    node: Node,
    passed: bool,
    reason: str,
    commit: str = "",
    values: list[float] | None = None,
    gain: Bound | None = None,
) -> None:
    """Store a node's gate verdict with its event; a failed gate rejects the node (if nothing ended it first)."""
    node.gated, node.gate_passed, node.gate_reason, node.gate_commit = True, passed, reason, commit
    node.heldout_values = values or []
    node.heldout_gain, node.heldout_lcb, node.heldout_level = (
        (gain.gain, gain.lcb, gain.level) if gain else (None, None, None)
    )
    s.add(node)
    add_event(s, node.study_id, "node.gate_passed" if passed else "node.gate_failed", node.id, passed=passed)
    if not passed and node.status == NodeStatus.EVALUATED:
        transition(s, node, NodeStatus.REJECTED, reason="held-out gate failed")


def local_repo(study: Study) -> Repo:
    """Return Grove's clone of a study's repository."""
    return Repo(Path(study.repo_path))


def out_of_bounds(spec: Any, values: list[float]) -> str:
    """Return why held-out values cannot be a metric's ('' if they can): finite, within objective.bounds."""
    low, high = spec.objective.bounds or (-math.inf, math.inf)
    if all(isinstance(v, int | float) and math.isfinite(v) and low <= v <= high for v in values):
        return ""
    return f"held-out values {values[:12]} are not finite numbers within objective.bounds"


def unrecorded(
    s: Session, spec: Any, which: Any, values: list[float], commit: str, first: int = 0, latest: bool = True
) -> str:
    """Return why `values` are not the metric of the recorded test runs `which` selects ('' if they are).

    Seeds start at `first`; where `commit` is named, only runs that evaluated it count. With
    `latest`, a seed's last run counts (a retried job runs them again); without, any of its runs
    (jobs running side by side each measure trunk's next seeds).
    """
    where = [which, ReceiptRow.kind == RunKind.TEST, col(ReceiptRow.ok)] + (
        [ReceiptRow.commit == commit] if commit else []
    )
    seen: dict[int, list[Any]] = {}
    for r in sorted(s.exec(select(ReceiptRow).where(*where)).all(), key=lambda r: r.id or 0):
        seen.setdefault(r.seed, []).append((r.metrics or {}).get(spec.objective.metric))
    seeds = [k for k in sorted(seen) if k >= first]
    if latest:
        fits = [seen[k][-1] for k in seeds] == list(values)
    else:
        fits = all(v in seen.get(first + i, ()) for i, v in enumerate(values))
    if not fits:
        at = f" of {commit[:12]}" if commit else ""
        return f"the held-out values are not those of the job's recorded test runs{at}"
    return ""
