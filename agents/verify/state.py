"""The study's improvement state (AREX ACU): a compact context rewritten at every integrate step.

It holds only dev-side evidence and gate pass/fail outcomes: held-out numbers never enter it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from agents.verify.constraints import Verdict


@dataclass
class Finding:
    text: str
    node_ids: list[int]


@dataclass
class OpenConstraint:
    name: str
    status: str
    detail: str
    node_ids: list[int]


@dataclass
class Rejected:
    node_id: int
    reason: str


@dataclass
class ImprovementState:
    verified_findings: list[Finding] = field(default_factory=list)
    open_constraints: list[OpenConstraint] = field(default_factory=list)
    rejected_candidates: list[Rejected] = field(default_factory=list)
    concerns: list[str] = field(default_factory=list)
    next_plan: list[str] = field(default_factory=list)
    raised: list[str] = field(default_factory=list, compare=False)  # concerns raised since loaded; not kept

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-friendly dict."""
        out = asdict(self)
        del out["raised"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> ImprovementState:
        """Rebuild a state from `to_dict` output."""
        data = data or {}
        return cls(
            [Finding(**f) for f in data.get("verified_findings", [])],
            [OpenConstraint(**c) for c in data.get("open_constraints", [])],
            [Rejected(**r) for r in data.get("rejected_candidates", [])],
            list(data.get("concerns", [])),
            list(data.get("next_plan", [])),
        )

    def add_finding(self, text: str, node_ids: list[int]) -> None:
        """Record a verified finding (replacing an identical text)."""
        self.verified_findings = [f for f in self.verified_findings if f.text != text]
        self.verified_findings.append(Finding(text, sorted(set(node_ids))))

    def set_constraint(self, name: str, status: str, detail: str, node_id: int) -> None:
        """Record the latest verdict of a constraint; satisfied ones leave the open list."""
        kept = [c for c in self.open_constraints if c.name != name]
        prior = next((c for c in self.open_constraints if c.name == name), None)
        if status != Verdict.SATISFIED:
            ids = sorted({*(prior.node_ids if prior else []), node_id})
            kept.append(OpenConstraint(name, status, detail, ids))
        self.open_constraints = kept

    def reject(self, node_id: int, reason: str, keep: int = 20) -> None:
        """Record a rejected candidate, keeping the most recent `keep`."""
        self.rejected_candidates = [r for r in self.rejected_candidates if r.node_id != node_id]
        self.rejected_candidates.append(Rejected(node_id, reason))
        self.rejected_candidates = self.rejected_candidates[-keep:]

    def retract(self, node_id: int, reason: str) -> None:
        """Withdraw every finding that rests on a node a human turned down, and record why."""
        self.verified_findings = [f for f in self.verified_findings if node_id not in f.node_ids]
        self.reject(node_id, reason)

    def concern(self, text: str, keep: int = 10) -> None:
        """Record a validity concern once, keeping the most recent `keep`."""
        self.raised.append(text)
        if text not in self.concerns:
            self.concerns = [*self.concerns, text][-keep:]


def renumber(state: dict[str, Any], to: Callable[[int], int | None]) -> dict[str, Any]:
    """Return a state (as `to_dict` gives it) with every node reference mapped by `to`; unmapped ones go."""

    def ids(xs: Any) -> list[int]:
        return [y for y in (to(x) for x in xs or [] if isinstance(x, int)) if y is not None]

    out = dict(state)
    out["verified_findings"] = [
        {**f, "node_ids": ids(f.get("node_ids"))}
        for f in state.get("verified_findings", [])
        if isinstance(f, dict)
    ]
    out["open_constraints"] = [
        {**c, "node_ids": ids(c.get("node_ids"))}
        for c in state.get("open_constraints", [])
        if isinstance(c, dict)
    ]
    out["rejected_candidates"] = [
        {**r, "node_id": ids([r.get("node_id")])[0]}
        for r in state.get("rejected_candidates", [])
        if isinstance(r, dict) and ids([r.get("node_id")])
    ]
    return out
