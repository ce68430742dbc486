"""Summary statistics and a one-sided lower confidence bound of a gain."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# One-sided 95% Student-t quantiles for 1..30 degrees of freedom.
_T95 = (
    6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812,
    1.796, 1.782, 1.771, 1.761, 1.753, 1.746, 1.740, 1.734, 1.729, 1.725,
    1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697,
)  # fmt: skip


def t95(df: int) -> float:
    """Return the one-sided 95% quantile of Student's t with `df` degrees of freedom."""
    if df < 1:
        return math.inf
    return _T95[df - 1] if df <= len(_T95) else 1.645


@dataclass(frozen=True)
class Summary:
    n: int
    mean: float
    std: float


def summarize(values: Sequence[float]) -> Summary:
    """Return n, mean and sample standard deviation of the values."""
    n = len(values)
    if n == 0:
        return Summary(0, math.nan, math.nan)
    mean = math.fsum(values) / n
    var = math.fsum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return Summary(n, mean, math.sqrt(var))


@dataclass(frozen=True)
class Gain:
    """Improvement of a candidate over a reference, signed so that positive is better."""

    mean: float
    lcb: float
    n: int
    paired: bool


def gain_over(candidate: Sequence[float], reference: Sequence[float], *, maximize: bool) -> Gain:
    """Return the gain over the reference with a one-sided 95% lower confidence bound.

    Equal-length samples are paired by seed (GROVE_SEED=i on both sides), which removes the
    seed-to-seed noise they share; otherwise Welch's bound is used. With one run per side
    there is no noise estimate and the bound is the plain difference.
    """
    sign = 1.0 if maximize else -1.0
    if not candidate or not reference:
        return Gain(math.nan, -math.inf, 0, False)
    if len(candidate) == len(reference):
        diffs = [sign * (c - r) for c, r in zip(candidate, reference, strict=True)]
        s = summarize(diffs)
        if s.n == 1:
            return Gain(s.mean, s.mean, 1, True)
        return Gain(s.mean, s.mean - t95(s.n - 1) * s.std / math.sqrt(s.n), s.n, True)
    c, r = summarize(candidate), summarize(reference)
    mean = sign * (c.mean - r.mean)
    va, vb = c.std**2 / c.n, r.std**2 / r.n
    se = math.sqrt(va + vb)
    if se == 0.0:
        return Gain(mean, mean, c.n, False)
    num = (va + vb) ** 2
    den = (va**2 / (c.n - 1) if c.n > 1 else 0.0) + (vb**2 / (r.n - 1) if r.n > 1 else 0.0)
    df = int(num / den) if den > 0 else 1
    return Gain(mean, mean - t95(max(df, 1)) * se, c.n, False)
