"""A small Gaussian-process regressor in pure Python for the `search` policy's surrogate."""

from __future__ import annotations

import math
from collections.abc import Sequence


def _cholesky(a: list[list[float]]) -> list[list[float]]:
    n = len(a)
    low = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1):
            s = a[i][j] - sum(low[i][k] * low[j][k] for k in range(j))
            if i == j:
                low[i][j] = math.sqrt(max(s, 1e-12))
            else:
                low[i][j] = s / low[j][j]
    return low


def _solve_lower(low: list[list[float]], b: Sequence[float]) -> list[float]:
    x: list[float] = []
    for i, row in enumerate(low):
        x.append((b[i] - sum(row[k] * x[k] for k in range(i))) / row[i])
    return x


def _solve_upper_t(low: list[list[float]], b: Sequence[float]) -> list[float]:
    n = len(low)
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (b[i] - sum(low[k][i] * x[k] for k in range(i + 1, n))) / low[i][i]
    return x


class GaussianProcess:
    """RBF-kernel GP on [0, 1]^d inputs with a constant mean and homoscedastic noise."""

    def __init__(
        self,
        xs: Sequence[Sequence[float]],
        ys: Sequence[float],
        *,
        lengthscale: float = 0.3,
        noise: float = 0.0,
    ) -> None:
        self.xs = [list(x) for x in xs]
        self.mean = sum(ys) / len(ys) if ys else 0.0
        spread = (max(ys) - min(ys)) if len(ys) > 1 else 0.0
        self.signal = (spread / 2) ** 2 or 1e-4
        self.noise = max(noise, self.signal * 1e-6)
        self.ls2 = lengthscale**2
        n = len(self.xs)
        k = [
            [self._k(self.xs[i], self.xs[j]) + (self.noise if i == j else 0.0) for j in range(n)]
            for i in range(n)
        ]
        self.low = _cholesky(k) if n else []
        self.alpha = (
            _solve_upper_t(self.low, _solve_lower(self.low, [y - self.mean for y in ys])) if n else []
        )

    def _k(self, a: Sequence[float], b: Sequence[float]) -> float:
        d2 = sum((u - v) ** 2 for u, v in zip(a, b, strict=True))
        return self.signal * math.exp(-d2 / (2 * self.ls2))

    def predict(self, x: Sequence[float]) -> tuple[float, float]:
        """Return the posterior mean and standard deviation at `x`."""
        if not self.xs:
            return self.mean, math.sqrt(self.signal)
        ks = [self._k(x, p) for p in self.xs]
        mu = self.mean + sum(k * a for k, a in zip(ks, self.alpha, strict=True))
        v = _solve_lower(self.low, ks)
        var = max(self.signal - sum(t * t for t in v), 1e-12)
        return mu, math.sqrt(var)


def expected_improvement(mu: float, sigma: float, best: float) -> float:
    """Return the expected improvement of a normal(mu, sigma) over `best` (maximisation)."""
    if sigma <= 0:
        return max(mu - best, 0.0)
    z = (mu - best) / sigma
    cdf = 0.5 * (1 + math.erf(z / math.sqrt(2)))
    pdf = math.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
    return (mu - best) * cdf + sigma * pdf
