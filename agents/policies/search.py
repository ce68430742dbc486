"""The built-in `search` policy: no LLM, edits of the declared config keys.

Ideation fits a Gaussian process to the dev objective of every evaluated assignment and
scores a pool of candidates by their expected improvement over trunk: *exploit* candidates
are one- and two-key moves of several sizes around the best nodes (children of those
nodes), *explore* candidates are random samples (children of the root, or of the nearest
measured node). A batch is chosen greedily with a penalty for crowding, and refine children
move a partially verified node toward its open constraint. Randomness comes from a RNG
seeded by (study seed, round), so ideation is reproducible.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agents import globs
from agents.policies import configfiles
from agents.policies.base import (
    IdeationInput,
    ImplementationError,
    ImplementInput,
    Judgement,
    NodeEvidence,
    Proposal,
    RefineRequest,
)
from agents.policies.gp import GaussianProcess, expected_improvement
from agents.spec import split_search_key

Assignment = dict[str, Any]


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


class Space:
    """The search space: one dimension per `[search]` key."""

    def __init__(self, dims: dict[str, dict[str, Any]], base: Assignment) -> None:
        self.dims = dims
        self.base = base
        self.keys = sorted(dims)

    def is_range(self, key: str) -> bool:
        """Return whether a key is a numeric range."""
        return self.dims[key].get("values") is None

    def is_int(self, key: str) -> bool:
        """Return whether a range key takes integers."""
        d = self.dims[key]
        return bool(d.get("integer")) or (
            isinstance(self.base.get(key), int) and not isinstance(self.base.get(key), bool)
        )

    def coord(self, key: str, value: Any) -> float:
        """Map a value to [0, 1] for distances."""
        d = self.dims[key]
        if not self.is_range(key):
            values = list(d["values"])
            if value in values:
                return values.index(value) / max(len(values) - 1, 1)
            return 0.5
        lo, hi, v = float(d["low"]), float(d["high"]), float(value)
        if d.get("log"):
            lo, hi, v = math.log(lo), math.log(hi), math.log(max(v, 1e-300))
        return min(max((v - lo) / (hi - lo), 0.0), 1.0)

    def vector(self, a: Assignment) -> list[float]:
        """Return an assignment's coordinates."""
        return [self.coord(k, a.get(k, self.base.get(k))) for k in self.keys]

    def snap(self, key: str, x: float) -> Any:
        """Map a coordinate in [0, 1] back to a value."""
        d = self.dims[key]
        x = min(max(x, 0.0), 1.0)
        if not self.is_range(key):
            values = list(d["values"])
            return values[round(x * (len(values) - 1))]
        lo, hi = float(d["low"]), float(d["high"])
        if d.get("log"):
            v = math.exp(math.log(lo) + x * (math.log(hi) - math.log(lo)))
        else:
            v = lo + x * (hi - lo)
        if self.is_int(key):
            return int(round(v))
        return float(f"{v:.4g}")

    def neighbours(self, a: Assignment, key: str, step: float) -> list[Any]:
        """Return values one step away from `a[key]`."""
        d = self.dims[key]
        cur = a.get(key, self.base.get(key))
        if not self.is_range(key):
            values = list(d["values"])
            if cur not in values:
                return values
            i = values.index(cur)
            return [values[j] for j in (i - 1, i + 1) if 0 <= j < len(values)]
        x = self.coord(key, cur)
        out = []
        for nx in (x - step, x + step):
            v = self.snap(key, nx)
            if v != cur and v not in out:
                out.append(v)
        return out

    def sample(self, rng: random.Random) -> Assignment:
        """Return a uniformly random assignment (log-uniform on log ranges)."""
        return {k: self.snap(k, rng.random()) for k in self.keys}

    def key_of(self, a: Assignment) -> tuple[Any, ...]:
        """Return a hashable identity for an assignment."""
        return tuple(_fmt(a.get(k, self.base.get(k))) for k in self.keys)


def _dist(a: Sequence[float], b: Sequence[float]) -> float:
    return math.sqrt(sum((u - v) ** 2 for u, v in zip(a, b, strict=True)))


def _describe(space: Space, old: Assignment, new: Assignment) -> list[str]:
    return [
        f"{k} {_fmt(old.get(k, space.base.get(k)))} → {_fmt(new[k])}"
        for k in space.keys
        if _fmt(new.get(k)) != _fmt(old.get(k, space.base.get(k)))
    ]


class SearchPolicy:
    """Evidence-guided local search over declared config keys."""

    name = "search"
    rebase_on_trunk = True

    def __init__(self, explore_fraction: float = 0.34, optimism: float = 1.0):
        self.explore_fraction = explore_fraction
        self.optimism = optimism

    # ideation -------------------------------------------------------------------

    def ideate(self, ctx: IdeationInput) -> list[Proposal]:
        """Propose up to `ctx.k` new children as concrete key edits."""
        space = Space(ctx.search_space, ctx.base_values)
        rng = random.Random(ctx.seed * 7919 + ctx.round_no)
        sign = 1.0 if ctx.maximize else -1.0
        assignment = {n.id: {**ctx.base_values, **n.edits} for n in ctx.nodes}
        seen = {space.key_of(a) for a in assignment.values()}
        scored = [n for n in ctx.nodes if n.dev_mean is not None and n.status != "failed"]
        gp = self._fit(space, [(assignment[n.id], sign * float(n.dev_mean or 0.0), n) for n in scored])
        ref = sign * ctx.trunk_dev_mean if ctx.trunk_dev_mean is not None else gp.mean
        root = next(n for n in ctx.nodes if n.parent_id is None)
        out: list[Proposal] = []

        def take(
            parent: NodeEvidence, a: Assignment, why: str, origin: str = "policy", ref_id: int | None = None
        ) -> None:
            key = space.key_of(a)
            if key in seen or len(out) >= ctx.k:
                return
            seen.add(key)
            mu, sd = gp.predict(space.vector(a))
            prior = expected_improvement(mu, sd, ref)
            out.append(
                self._proposal(ctx, space, parent, assignment[parent.id], a, prior, why, origin, ref_id)
            )

        by_id = {n.id: n for n in ctx.nodes}
        for req in ctx.refine:
            node = by_id.get(req.node_id)
            if node is not None:
                self._refine(ctx, space, node, assignment[node.id], req, take)

        pool: list[tuple[NodeEvidence, Assignment, str]] = []
        explore_only = ctx.plateau_level >= 2  # "change approach": leave the current neighbourhoods
        if not explore_only:
            for parent in sorted(scored, key=lambda n: -sign * float(n.dev_mean or 0.0))[:3]:
                a = assignment[parent.id]
                for step in (0.1, 0.25, 0.5):
                    for key in space.keys:
                        pool += [
                            (parent, {**a, key: v}, f"move {key} around n{parent.id}")
                            for v in space.neighbours(a, key, step)
                        ]
                for _ in range(6):
                    new = dict(a)
                    for key in rng.sample(space.keys, min(2, len(space.keys))):
                        opts = space.neighbours(a, key, rng.choice((0.1, 0.25, 0.5)))
                        if opts:
                            new[key] = rng.choice(opts)
                    pool.append((parent, new, f"combine moves around n{parent.id}"))
        measured = [(space.vector(assignment[n.id]), n) for n in scored]
        for _ in range(256):
            a = space.sample(rng)
            x = space.vector(a)
            near = min(measured, key=lambda m: _dist(m[0], x), default=None)
            if explore_only and near is not None and _dist(near[0], x) < 0.35:
                continue
            parent = near[1] if near is not None and _dist(near[0], x) < 0.2 and near[1].depth < 6 else root
            pool.append((parent, a, "explore a new region"))

        scores: list[tuple[float, NodeEvidence, Assignment, str]] = []
        for parent, a, why in pool:
            if space.key_of(a) in seen:
                continue
            mu, sd = gp.predict(space.vector(a))
            scores.append((expected_improvement(mu, sd, ref), parent, a, why))
        while scores and len(out) < ctx.k:
            best = max(range(len(scores)), key=lambda i: (scores[i][0], -i))
            _, parent, a, why = scores.pop(best)
            if space.key_of(a) in seen:
                continue
            take(parent, a, why)
            x = space.vector(a)
            scores = [  # crowding penalty keeps a batch diverse
                (s * (1.0 - math.exp(-(_dist(space.vector(b), x) ** 2) / (2 * 0.08**2))), p, b, w)
                for s, p, b, w in scores
            ]
        return out

    @staticmethod
    def _fit(space: Space, points: Sequence[tuple[Assignment, float, NodeEvidence]]) -> GaussianProcess:
        noise = [(n.dev_std or 0.0) ** 2 / max(n.dev_n, 1) for _, _, n in points]
        best = sorted(points, key=lambda p: -p[1])[:150]
        return GaussianProcess(
            [space.vector(a) for a, _, _ in best],
            [y for _, y, _ in best],
            lengthscale=0.25,
            noise=sum(noise) / len(noise) if noise else 0.0,
        )

    def _refine(self, ctx, space, node, a, req: RefineRequest, take) -> None:  # type: ignore[no-untyped-def]
        rules = {c["name"]: c for c in ctx.constraints}
        options: list[tuple[float, int, Assignment]] = []
        models = {}
        for name in req.open_constraints:
            rule = rules.get(name)
            pts = [
                (space.vector({**ctx.base_values, **n.edits}), n.dev_metrics[rule["metric"]])
                for n in ctx.nodes
                if rule and rule["metric"] in n.dev_metrics
            ]
            if rule and pts:
                models[name] = (
                    rule,
                    GaussianProcess([p for p, _ in pts], [y for _, y in pts], lengthscale=0.15),
                )
        for key in space.keys:
            for v in space.neighbours(a, key, 0.25):
                new = {**a, key: v}
                badness = 0.0
                for rule, model in models.values():
                    pred, _ = model.predict(space.vector(new))
                    if rule.get("max") is not None:
                        badness += max(pred - rule["max"], 0.0) / (abs(rule["max"]) or 1.0)
                    if rule.get("min") is not None:
                        badness += max(rule["min"] - pred, 0.0) / (abs(rule["min"]) or 1.0)
                options.append((badness, len(options), new))
        options.sort(key=lambda t: (t[0], t[1]))
        for _, _, new in options[:1]:
            take(node, new, f"refine n{node.id}: {req.goal}", "refine", node.id)

    def _proposal(self, ctx, space, parent, old, new, prior, why, origin, ref_id) -> Proposal:  # type: ignore[no-untyped-def]
        changes = _describe(space, old, new) or ["no change"]
        title = ", ".join(changes)
        direction = "raises" if ctx.maximize else "lowers"
        hyp = {
            "mechanism": f"Config edit ({why}): {title}",
            "hypothesis": f"Setting {title} {direction} dev {ctx.metric} relative to trunk",
            "observable": f"mean dev {ctx.metric} over the evaluation repeats, paired by seed against trunk",
            "risks": "; ".join(f"may break {c['name']} ({c['metric']})" for c in ctx.constraints)
            or "none identified",
        }
        edits = {k: new[k] for k in space.keys}
        return Proposal(parent.id, title, hyp, round(float(prior), 8), edits, origin, ref_id)

    # implementation --------------------------------------------------------------

    def implement(self, worktree: Path, node: ImplementInput) -> str:
        """Apply the node's key edits exactly; return a short account of what changed."""
        by_file: dict[str, dict[str, Any]] = {}
        for key, value in node.edits.items():
            file, dotted = split_search_key(key)
            by_file.setdefault(file, {})[dotted] = value
        changed = []
        for file, values in sorted(by_file.items()):
            if not globs.match_any(node.editable, file):
                raise ImplementationError(f"{file} is not editable")
            path = (worktree / file).resolve()
            if not path.is_relative_to(worktree.resolve()):
                raise ImplementationError(f"{file} resolves outside the worktree")
            if not path.is_file():
                raise ImplementationError(f"{file} does not exist")
            text = path.read_text("utf-8")
            try:
                new = configfiles.set_keys(file, text, values)
            except configfiles.ConfigKeyError as exc:
                raise ImplementationError(f"{file}: key {exc} not found") from exc
            if new != text:
                path.write_text(new, "utf-8")
                changed.append(file)
        return f"set {len(node.edits)} keys in {', '.join(changed) or 'no file'}"

    # insights --------------------------------------------------------------------

    def summarise(self, node: NodeEvidence, ctx_metric: str, parent: NodeEvidence | None) -> str:
        """Return a structured statistical summary of one node's evidence."""
        if node.status == "failed" or node.dev_mean is None:
            return f"n{node.id} {node.title}: failed ({node.failure or 'no result'})"
        cons = "; ".join(f"{c['name']} {c['verdict']}" for c in node.constraints)
        gain = "" if node.gain is None else f": {node.gain:+.4g} dev {ctx_metric} vs trunk"
        lcb = "" if node.gain_lcb is None else f" (LCB {node.gain_lcb:+.4g}, n={node.dev_n})"
        return f"n{node.id} {node.title}{gain}{lcb}" + (f"; {cons}" if cons else "")

    def synthesize(self, ancestor: NodeEvidence, children: list[NodeEvidence], metric: str) -> str:
        """Return an ancestor insight: per-child effects, best first, citing node ids."""
        done = [c for c in children if c.gain is not None]
        failed = [c for c in children if c.gain is None]
        done.sort(key=lambda c: -(c.gain or 0.0))
        lines = [f"{len(children)} children of n{ancestor.id}; {len(done)} measured, {len(failed)} failed."]
        for c in done[:6]:
            lines.append(f"- n{c.id} {c.title}: {c.gain:+.4g} dev {metric}, n={c.dev_n}")
        wins = [c for c in done if (c.gain_lcb or 0) > 0]
        if wins:
            lines.append(f"Works: {', '.join(f'n{c.id}' for c in wins[:4])}.")
        elif done:
            lines.append("No child improved significantly on trunk here.")
        return "\n".join(lines)

    # verification ------------------------------------------------------------------

    def verify(self, node: NodeEvidence, soft: list[dict[str, Any]]) -> Judgement:
        """Judge nothing: without a model soft constraints stay unknown and AREX's call is the rule's."""
        return Judgement()

    def update_state(self, state: dict[str, Any], recent: list[NodeEvidence]) -> dict[str, Any]:
        """Keep the rule-built improvement state as it is."""
        return state
