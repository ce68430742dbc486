"""Per-constraint verdicts for a candidate (AREX constraint-wise audit)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum


class Verdict(StrEnum):
    SATISFIED = "satisfied"
    VIOLATED = "violated"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class ConstraintRule:
    name: str
    metric: str
    min: float | None = None
    max: float | None = None

    def describe(self) -> str:
        """Return the rule as text, e.g. `n_params <= 50000`."""
        parts = []
        if self.min is not None:
            parts.append(f"{self.metric} >= {self.min:g}")
        if self.max is not None:
            parts.append(f"{self.metric} <= {self.max:g}")
        return " and ".join(parts)


@dataclass(frozen=True)
class ConstraintResult:
    name: str
    verdict: Verdict
    value: float | None
    receipt_id: int | None
    detail: str

    def to_dict(self) -> dict[str, object]:
        """Return a JSON-friendly dict."""
        return {
            "name": self.name,
            "verdict": str(self.verdict),
            "value": self.value,
            "receipt_id": self.receipt_id,
            "detail": self.detail,
        }


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    f = float(value)
    return None if math.isnan(f) else f


def check(rule: ConstraintRule, receipts: Sequence[tuple[int, Mapping[str, object]]]) -> ConstraintResult:
    """Judge one rule over the metrics of successful receipts, taking the worst value seen."""
    seen: list[tuple[float, int]] = []
    for receipt_id, metrics in receipts:
        v = _number(metrics.get(rule.metric))
        if v is not None:
            seen.append((v, receipt_id))
    if not seen:
        return ConstraintResult(
            rule.name, Verdict.UNKNOWN, None, None, f"no receipt reported {rule.metric!r}"
        )
    for value, rid in sorted(seen, key=lambda t: t[0]):
        if rule.min is not None and value < rule.min:
            return ConstraintResult(
                rule.name, Verdict.VIOLATED, value, rid, f"{rule.metric}={value:g} < {rule.min:g}"
            )
    for value, rid in sorted(seen, key=lambda t: -t[0]):
        if rule.max is not None and value > rule.max:
            return ConstraintResult(
                rule.name, Verdict.VIOLATED, value, rid, f"{rule.metric}={value:g} > {rule.max:g}"
            )
    worst, rid = max(seen, key=lambda t: t[0]) if rule.max is not None else min(seen)
    return ConstraintResult(
        rule.name, Verdict.SATISFIED, worst, rid, f"{rule.metric}={worst:g} ({rule.describe()})"
    )


def verify_all(
    rules: Sequence[ConstraintRule], receipts: Sequence[tuple[int, Mapping[str, object]]]
) -> list[ConstraintResult]:
    """Return one verdict per rule."""
    return [check(r, receipts) for r in rules]


def all_satisfied(results: Sequence[ConstraintResult]) -> bool:
    """Return whether every verdict is `satisfied`."""
    return all(r.verdict == Verdict.SATISFIED for r in results)
