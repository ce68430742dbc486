"""Summary statistics and a one-sided lower confidence bound of a gain."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
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


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularised incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for num in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-14:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_tail(t: float, df: int) -> float:
    """Return P(T > t) for Student's t with `df` degrees of freedom."""
    p = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return p if t >= 0 else 1.0 - p


@functools.lru_cache(maxsize=4096)
def t_quantile(alpha: float, df: int) -> float:
    """Return the one-sided upper `alpha` quantile of Student's t (`t_quantile(0.05, df) == t95(df)`)."""
    if df < 1:
        return math.inf
    lo, hi = 0.0, 1.0
    while t_tail(hi, df) > alpha:
        lo, hi = hi, hi * 2
    for _ in range(100):  # to a relative 1e-13: past it, halving changes nothing a test can see
        if hi - lo <= 1e-13 * hi:
            break
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_tail(mid, df) > alpha else (lo, mid)
    return (lo + hi) / 2


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


def gain_over(
    candidate: Sequence[float], reference: Sequence[float], *, maximize: bool, alpha: float = 0.05
) -> Gain:
    """Return the gain over the reference with a one-sided `1 - alpha` (95%) lower confidence bound.

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
        return Gain(s.mean, s.mean - _t(alpha, s.n - 1) * s.std / math.sqrt(s.n), s.n, True)
    c, r = summarize(candidate), summarize(reference)
    mean = sign * (c.mean - r.mean)
    va, vb = c.std**2 / c.n, r.std**2 / r.n
    se = math.sqrt(va + vb)
    if se == 0.0:
        return Gain(mean, mean, c.n, False)
    num = (va + vb) ** 2
    den = (va**2 / (c.n - 1) if c.n > 1 else 0.0) + (vb**2 / (r.n - 1) if r.n > 1 else 0.0)
    df = int(num / den) if den > 0 else 1
    return Gain(mean, mean - _t(alpha, max(df, 1)) * se, c.n, False)


def _t(alpha: float, df: int) -> float:
    return t95(df) if alpha == 0.05 else t_quantile(alpha, df)


def same_every_seed(runs: Sequence[Mapping[str, float]], metrics: Sequence[str]) -> bool:
    """Return whether two or more runs on different seeds agree exactly on every named metric."""
    if len(runs) < 2:
        return False
    first = runs[0]
    return all(m in first for m in metrics) and all(
        all(m in r and r[m] == first[m] for m in metrics) for r in runs[1:]
    )
