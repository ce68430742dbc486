"""The `[search]` space of a study: its dimensions, values, and coordinates for distances.

A conditional key (`when`) is active only where its parent list key takes one of the named
values; where it is inactive an assignment holds the repository's value for it, so two
assignments that differ only there are one configuration.
"""

from __future__ import annotations

import math
from typing import Any

Assignment = dict[str, Any]


def fmt(v: Any) -> str:
    """Format a config value for titles and identity: floats with 4 significant digits."""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


class Space:
    """One dimension per `[search]` key, with the repository's current values as the base."""

    def __init__(self, dims: dict[str, dict[str, Any]], base: Assignment) -> None:
        self.dims = dims
        self.base = base
        self.keys = sorted(dims)
        # key -> {parent key: the parent's values under which the key is active}
        self.conditions: dict[str, dict[str, list[Any]]] = {
            k: {p: (v if isinstance(v, list) else [v]) for p, v in (d.get("when") or {}).items()}
            for k, d in dims.items()
            if d.get("when")
        }
        self.roots = [k for k in self.keys if k not in self.conditions]

    def active(self, a: Assignment, key: str) -> bool:
        """Return whether a key is active under an assignment (its conditions hold; always, if it has none)."""
        return all(
            any(fmt(a.get(p, self.base.get(p))) == fmt(c) for c in allowed)
            for p, allowed in self.conditions.get(key, {}).items()
        )

    def is_range(self, key: str) -> bool:
        """Return whether a key is a numeric range (else a list of values)."""
        return self.dims[key].get("values") is None

    def values(self, key: str) -> list[Any]:
        """Return the choices of a list key (an ordered one's in ascending order)."""
        if self.is_ordered(key):
            return self.ordered(key)
        return list(self.dims[key]["values"])

    def is_ordered(self, key: str) -> bool:
        """Return whether a list key holds numbers only: an ordered dimension, not a set of categories."""
        values = self.dims[key].get("values")
        return (
            values is not None
            and len(values) >= 2
            and all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
        )

    def ordered(self, key: str) -> list[Any]:
        """Return an ordered key's values, ascending."""
        return sorted(self.dims[key]["values"], key=float)

    def index(self, key: str, value: Any) -> float:
        """Return a value's place among an ordered key's values (interpolated between them)."""
        vs = [float(v) for v in self.ordered(key)]
        if isinstance(value, bool) or not isinstance(value, int | float):
            return 0.0
        x = float(value)
        if x <= vs[0]:
            return 0.0
        for i in range(1, len(vs)):
            if x <= vs[i]:
                return i - 1 + (x - vs[i - 1]) / (vs[i] - vs[i - 1]) if vs[i] > vs[i - 1] else float(i)
        return float(len(vs) - 1)

    def is_int(self, key: str) -> bool:
        """Return whether a range key takes integers."""
        d = self.dims[key]
        cur = self.base.get(key)
        if d.get("integer") is not None:
            return bool(d["integer"])
        # An int in the file makes an int key only where the bounds are whole numbers too.
        whole = float(d["low"]).is_integer() and float(d["high"]).is_integer()
        return whole and isinstance(cur, int) and not isinstance(cur, bool)

    def bounds(self, key: str) -> tuple[float, float]:
        """Return a range key's bounds (integer keys: the integers inside them)."""
        d = self.dims[key]
        lo, hi = float(d["low"]), float(d["high"])
        if self.is_int(key):
            lo, hi = float(math.ceil(lo)), float(math.floor(hi))
        return lo, hi

    def value(self, a: Assignment, key: str) -> Any:
        """Return a key's value in an assignment, falling back to the base (always the base where it is inactive)."""
        if key in self.conditions and not self.active(a, key):
            return self.base.get(key)
        return a.get(key, self.base.get(key))

    def full(self, a: Assignment) -> Assignment:
        """Return the assignment of every key."""
        return {k: self.value(a, k) for k in self.keys}

    def contains(self, key: str, v: Any) -> bool:
        """Return whether a value lies in the key's dimension."""
        if not self.is_range(key):
            return any(v == c and type(v) is type(c) for c in self.values(key))
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            return False
        lo, hi = self.bounds(key)
        if self.is_int(key) and float(v) != int(v):
            return False
        return lo <= float(v) <= hi

    def coord(self, key: str, value: Any) -> float:
        """Map a value to [0, 1]: ranges by value (log on log ranges), ordered lists by place; categories to 0."""
        if self.is_ordered(key):
            return self.index(key, value) / (len(self.ordered(key)) - 1)
        if not self.is_range(key):
            return 0.0
        lo, hi = self.bounds(key)
        v = float(value) if isinstance(value, int | float) else lo
        if self.dims[key].get("log"):
            lo, hi, v = math.log(lo), math.log(hi), math.log(max(v, 1e-300))
        return min(max((v - lo) / (hi - lo), 0.0), 1.0) if hi > lo else 0.0

    def features(self, a: Assignment) -> list[float]:
        """Return an assignment as numbers: a coordinate per range key, one-hot per categorical key."""
        out: list[float] = []
        for k in self.keys:
            v = self.value(a, k)
            if self.is_range(k) or self.is_ordered(k):
                out.append(self.coord(k, v))
            else:
                out += [1.0 if v == c and type(v) is type(c) else 0.0 for c in self.values(k)]
        return out

    def distance(self, a: Assignment, b: Assignment) -> float:
        """Return the distance between assignments (a categorical mismatch counts 1)."""
        total = 0.0
        for k in self.keys:
            u, v = self.value(a, k), self.value(b, k)
            if self.is_range(k) or self.is_ordered(k):
                total += (self.coord(k, u) - self.coord(k, v)) ** 2
            elif fmt(u) != fmt(v):
                total += 1.0
        return math.sqrt(total)

    def differing(self, a: Assignment, b: Assignment) -> list[str]:
        """Return the keys whose values differ."""
        return [k for k in self.keys if fmt(self.value(a, k)) != fmt(self.value(b, k))]

    def snap(self, key: str, x: float) -> Any:
        """Map a coordinate in [0, 1] back to a value (4 significant digits for floats; an ordered list's nearest)."""
        x = min(max(x, 0.0), 1.0)
        if self.is_ordered(key):
            vs = self.ordered(key)
            return vs[round(x * (len(vs) - 1))]
        lo, hi = self.bounds(key)
        if self.dims[key].get("log"):
            v = math.exp(math.log(lo) + x * (math.log(hi) - math.log(lo)))
        else:
            v = lo + x * (hi - lo)
        return self.clean(key, v)

    def clean(self, key: str, v: Any) -> Any:
        """Round a suggested value the way it will be written (ints, 4 significant digits)."""
        if not self.is_range(key):
            return v
        lo, hi = self.bounds(key)
        if self.is_int(key):
            return int(min(max(round(float(v)), lo), hi))
        return min(max(float(f"{float(v):.4g}"), lo), hi)

    def neighbours(self, a: Assignment, key: str, step: float) -> list[Any]:
        """Return the values one step away from `a[key]` (adjacent choices for categorical keys)."""
        cur = self.value(a, key)
        if self.is_ordered(key):  # every other value, nearest first: a repair may need a long step
            x = self.coord(key, cur)
            others = [c for c in self.values(key) if fmt(c) != fmt(cur)]
            return sorted(others, key=lambda c: abs(self.coord(key, c) - x))
        if not self.is_range(key):
            return [c for c in self.values(key) if fmt(c) != fmt(cur)]
        x = self.coord(key, cur)
        out: list[Any] = []
        for nx in (x - step, x + step):
            v = self.snap(key, nx)
            if fmt(v) != fmt(cur) and v not in out:
                out.append(v)
        return out

    def key_of(self, a: Assignment) -> tuple[str, ...]:
        """Return a hashable identity for an assignment."""
        return tuple(fmt(self.value(a, k)) for k in self.keys)

    def describe(self, old: Assignment, new: Assignment) -> list[str]:
        """Return `key old → new` for every key that changes."""
        return [
            f"{k} {fmt(self.value(old, k))} → {fmt(self.value(new, k))}" for k in self.differing(old, new)
        ]
