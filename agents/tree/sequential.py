"""Adaptive dev repeats: look again at an unclear gain, with the test's error spent across looks.

Three paired seeds give a t with two degrees of freedom: a real but small gain cannot be told
from noise. A node whose gain is unclear (its lower bound within one standard error of zero)
is re-run together with trunk on more paired seeds, `repeats` at a time, up to `max_repeats`.
Looking more than once at a fixed 5% level would raise the false-positive rate, so the 5% is
spent across the looks (a power alpha-spending function, `alpha * sqrt(n / max_repeats)` spent
by the time `n` seeds are in: look k tests at the difference of that over its seeds, so the first
look keeps most of the 5%); by Bonferroni the chance that any look passes a gain that is not
there stays at or below `alpha`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

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
        """Return the level of the look that `n` seeds reached (the last look at or below `n`)."""
        looks = self.looks()
        k = max((i for i, m in enumerate(looks) if m <= n), default=0)
        before = looks[k - 1] if k > 0 else 0
        return self.spent(looks[k]) - self.spent(before)

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
