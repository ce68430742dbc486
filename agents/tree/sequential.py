"""Adaptive dev repeats: look again at an unclear gain, with the test's error spent across looks.

Three paired seeds give a t with two degrees of freedom: a real but small gain cannot be told
from noise. A node whose gain is unclear (its lower bound within one standard error of zero)
is re-run together with trunk on more paired seeds, `repeats` at a time, up to `max_repeats`.
Looking more than once at a fixed 5% level would raise the false-positive rate, so the 5% is
spent across the looks by a group-sequential design (Lan and DeMets): by the time `n` of
`max_repeats` seeds are in, at most `alpha * sqrt(n / max_repeats)` has been spent, so the first
look keeps most of it. The boundary of each look is computed exactly for the cumulative
statistic, whose looks are correlated (the seeds of look 1 are part of look 2): look k rejects at
the nominal level that makes the chance of a first rejection there equal its share. A later look
therefore tests at a higher nominal level than a Bonferroni split would give it, while the chance
that any look passes a gain that is not there stays `alpha`. The tests are t tests on few seeds,
so the levels are calibrated for them (`nominal_levels`); `tests/unit/test_sequential.py`
measures the false-positive rate and the power that looking again buys.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache, partial
from statistics import NormalDist

import numpy as np
from numpy.typing import NDArray

from agents.tree.stats import summarize, t_quantile


class Step(StrEnum):
    CLEAR = "clear"  # the gain is significant at this look
    FUTILE = "futile"  # the gain is clearly not there; more seeds would not help
    MORE = "more"  # unclear: run more paired seeds
    DONE = "done"  # the last look was taken


@dataclass(frozen=True)
class Plan:
    repeats: int
    max_repeats: int
    alpha: float = 0.05

    def looks(self) -> list[int]:
        """Return the seed counts at which the gain is judged."""
        return sorted({*range(self.repeats, self.max_repeats, self.repeats), self.max_repeats})

    def alpha_at(self, n: int) -> float:
        """Return the nominal level of the look that `n` seeds reached (the last look at or below `n`)."""
        looks = self.looks()
        k = max((i for i, m in enumerate(looks) if m <= n), default=0)
        return nominal_levels(tuple(looks), self.alpha)[k]

    def spent(self, n: int) -> float:
        """Return the error spent once `n` seeds are judged."""
        return self.alpha * math.sqrt(min(n, self.max_repeats) / self.max_repeats)

    def next_n(self, n: int) -> int:
        """Return the seed count of the look after `n` seeds."""
        return next((m for m in self.looks() if m > n), n)

    def step(self, diffs: Sequence[float]) -> Step:
        """Decide what to do after a look at these paired differences (positive is better)."""
        n = len(diffs)
        if n >= self.max_repeats:
            return Step.DONE
        if n < 2:
            return Step.MORE
        s = summarize(diffs)
        se = s.std / math.sqrt(n)
        lcb = s.mean - t_quantile(self.alpha_at(n), n - 1) * se
        if lcb > 0:
            return Step.CLEAR
        # Unclear: the normal-approximation 95% bound is within one standard error of zero. (The t
        # bound of two or three seeds is so wide that it would call almost every gain futile.)
        if se == 0.0 or s.mean - 1.645 * se < -se:
            return Step.FUTILE
        return Step.MORE


def resolution(sd: float, plan: Plan) -> float:
    """Return the mean paired gain that clears `plan`'s last look when the differences spread by `sd`.

    A gain below it is more likely than not to fail even at the last look: racing it with more
    seeds, here or at the sealed gate, buys a decision it would most likely lose.
    """
    n = plan.max_repeats
    if n < 2 or not math.isfinite(sd):
        return 0.0
    return t_quantile(plan.alpha_at(n), n - 1) * sd / math.sqrt(n)


def worth_racing(diffs: Sequence[float], *plans: Plan) -> bool:
    """Return whether an unclear gain could clear the last look of every plan it must pass."""
    if len(diffs) < 2:
        return True
    s = summarize(diffs)
    return s.mean > max((resolution(s.std, p) for p in plans), default=0.0)


_N = NormalDist()
_GRID = 241  # points per look of the continuation density (odd, for Simpson's rule)
_PATHS = 100_000  # simulated null studies that calibrate the t approximation
_SEED = 20261130


# `nominal_levels` of the plans that default settings give (`repeats` r, up to 3r seeds), as it
# computes them: 0.1 s or more each, otherwise paid by every process on its first look at a plan.
# `tests/unit/test_sequential.py` checks each entry against the computation.
TABULATED: dict[tuple[tuple[int, ...], float], tuple[float, ...]] = {
    ((1, 2, 3), 0.05): (0.028867499694378206, 0.01989892501393231, 0.01936491279490582),
    ((2, 4, 6), 0.05): (0.02573553955514065, 0.017489334883284524, 0.016930159728780092),
    ((3, 6, 9), 0.05): (0.026580882065637586, 0.018135376226842137, 0.017581284866149183),
    ((4, 8, 12), 0.05): (0.027503116441952857, 0.01884386192555665, 0.018296762094800467),
    ((5, 10, 15), 0.05): (0.027897968423871773, 0.01914835618646049, 0.01860470827773797),
}


@lru_cache(maxsize=64)
def nominal_levels(looks: tuple[int, ...], alpha: float) -> tuple[float, ...]:
    """Return each look's one-sided nominal level for t tests, with `alpha` spent across the looks.

    The boundaries are first computed exactly for the z statistic (`z_levels`). A t statistic's
    variance estimate differs from look to look, which makes its looks less correlated than z's,
    so the same nominal levels would reject a null a little more often than `alpha` (5.2% instead
    of 5% for looks at 3, 6 and 9 seeds). The spending is therefore scaled down until the t tests,
    run on a fixed set of simulated null studies, reject at most `alpha` of them.
    """
    known = TABULATED.get((looks, alpha))
    return known if known is not None else computed_levels(looks, alpha)


def computed_levels(looks: tuple[int, ...], alpha: float) -> tuple[float, ...]:
    """Compute `nominal_levels` (by simulation: 0.1 s and more)."""
    if len(looks) == 1:
        return (alpha,)
    rng = np.random.default_rng(_SEED)
    x = rng.standard_normal((_PATHS, looks[-1]))
    total, squares = np.cumsum(x, axis=1), np.cumsum(x * x, axis=1)
    n = np.array(looks, dtype=float)
    mean = total[:, n.astype(int) - 1] / n
    with np.errstate(divide="ignore", invalid="ignore"):  # a one-seed look has no t (`Plan.step` looks again)
        var = (squares[:, n.astype(int) - 1] - n * mean * mean) / (n - 1)
        stat = mean / np.sqrt(var / n)

    def rate(scale: float) -> tuple[float, tuple[float, ...]]:
        levels = z_levels(looks, alpha * scale)
        edges = np.array([t_quantile(a, m - 1) for a, m in zip(levels, looks, strict=True)])
        return float(np.mean(np.any(stat >= edges, axis=1))), levels

    lo, hi = 0.5, 1.0
    best = rate(lo)[1]
    for _ in range(20):
        mid = (lo + hi) / 2
        r, levels = rate(mid)
        if r <= alpha:
            lo, best = mid, levels
        else:
            hi = mid
    return best


@lru_cache(maxsize=64)
def z_levels(looks: tuple[int, ...], alpha: float) -> tuple[float, ...]:
    """Return each look's one-sided nominal level for a z test under the spending `alpha * sqrt(n / n_max)`.

    The score S_k (the sum of the first n_k paired differences, unit variance each) is a random
    walk; the density of S_k on the region where no look has rejected yet is carried from look
    to look on a grid, and each look's boundary is the one whose crossing probability equals its
    share of `alpha`.
    """
    spent = [alpha * math.sqrt(n / looks[-1]) for n in looks]
    levels = [spent[0]]
    root = math.sqrt(looks[0])
    grid = np.linspace(-8.0 * root, _N.inv_cdf(1 - spent[0]) * root, _GRID)
    dens = _pdf(grid / root) / root
    for k in range(1, len(looks)):
        share, n = spent[k] - spent[k - 1], looks[k]
        step = math.sqrt(n - looks[k - 1])
        mass = dens * _simpson(grid)
        hi = _root(
            partial(_excess, mass=mass, grid=grid, root=math.sqrt(n), step=step, share=share), -2.0, 10.0
        )
        levels.append(1 - _N.cdf(hi))
        new_grid = np.linspace(-8.0 * math.sqrt(n), hi * math.sqrt(n), _GRID)
        dens = _pdf((new_grid[:, None] - grid[None, :]) / step) @ mass / step
        grid = new_grid
    return tuple(levels)


def _excess(
    z: float, *, mass: NDArray[np.float64], grid: NDArray[np.float64], root: float, step: float, share: float
) -> float:
    """Return how much more than `share` crosses a boundary at `z` (the density's mass on `grid`)."""
    return float(np.sum(mass * _sf((z * root - grid) / step))) - share


def _root(f: Callable[[float], float], lo: float, hi: float, tol: float = 1e-12) -> float:
    """Return where a decreasing `f` crosses zero in [lo, hi], from the side where `f <= 0`.

    Illinois false position, to a bracket of `tol`: a boundary's crossing probability is smooth in
    the boundary, so this takes about half the evaluations of halving the bracket to that width.
    The answer is the bracket's upper end, as bisection's was: its crossing is at most the share.
    """
    f_lo, f_hi, side = f(lo), f(hi), 0
    if f_lo <= 0:
        return lo
    if f_hi >= 0:
        return hi
    for _ in range(100):
        mid = (lo * f_hi - hi * f_lo) / (f_hi - f_lo)
        if not lo < mid < hi:
            mid = (lo + hi) / 2
        f_mid = f(mid)
        if f_mid > 0:
            lo, f_lo = mid, f_mid
            if side == 1:
                f_hi /= 2
            side = 1
        else:
            hi, f_hi = mid, f_mid
            if side == -1:
                f_lo /= 2
            side = -1
        if hi - lo <= tol or f_mid == 0:
            break
    return hi


def _pdf(z: NDArray[np.float64]) -> NDArray[np.float64]:
    return np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)


_ERFC = np.vectorize(math.erfc, otypes=[np.float64])


def _sf(z: NDArray[np.float64]) -> NDArray[np.float64]:
    out: NDArray[np.float64] = 0.5 * _ERFC(z / math.sqrt(2))
    return out


def _simpson(grid: NDArray[np.float64]) -> NDArray[np.float64]:
    h = float(grid[1] - grid[0])
    w = np.where(np.arange(len(grid)) % 2 == 0, 2.0, 4.0) * h / 3
    w[0] = w[-1] = h / 3
    return w
