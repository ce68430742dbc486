"""The built-in `search` policy: no LLM, edits of the declared config keys.

Ideation asks an Optuna sampler (`[policy] sampler`: GP where torch is installed, else TPE) for a batch, after
replaying every measured node as a trial with its dev objective and constraint values
(`agents/policies/optuna_bridge.py`). Each suggestion hangs under the nearest feasible measured
node it differs least from. Before new ideas come AREX's requests: a node that improves but
breaks a constraint gets a *refine* child predicted feasible by a local linear model of each
constraint metric over the measured nodes, keeping as much of the predicted gain as it can;
an abandoned branch gets a *restart* child of the root, far from it. Everything is seeded by
(study seed, round), so ideation is reproducible.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from agents import configfiles, globs
from agents.capabilities import SEARCH, Capabilities
from agents.policies import optuna_bridge
from agents.policies.base import (
    IdeationInput,
    ImplementationError,
    ImplementInput,
    Judgement,
    NodeEvidence,
    Proposal,
    RefineRequest,
)
from agents.policies.optuna_bridge import SamplerName
from agents.policies.space import Assignment, Space
from agents.spec import Judge, split_search_key
from agents.tree.status import NodeStatus, Origin

MEASURED = ("evaluated", "merged", "awaiting_approval", "rejected")  # pruned directions stay closed
STEPS = (0.05, 0.1, 0.2, 0.35, 0.5)
FINISH_RADII = (0.2, 0.05)  # the finishing phase's trust region, at its start and at its end


# A node's assignment, by the evidence object the coordinator hands back while the node is unchanged.
_ASSIGNED: dict[str, dict[int, tuple[NodeEvidence, Assignment, tuple[str, ...]]]] = {}  # by space


def _assignments(space: Space, ctx: IdeationInput) -> tuple[dict[int, Assignment], set[tuple[str, ...]]]:
    """Return every node's full assignment and the set of their identities (tried or proposed)."""
    of_space = repr((sorted(ctx.search_space.items()), sorted(ctx.base_values.items())))
    if sum(len(v) for v in _ASSIGNED.values()) > 200_000:  # across every study this process serves
        _ASSIGNED.clear()
    known = _ASSIGNED.setdefault(of_space, {})
    assignment, seen = {}, set()
    for n in ctx.nodes:
        hit = known.get(id(n))
        if hit is None or hit[0] is not n:
            a = space.full({**ctx.base_values, **n.edits})
            hit = known[id(n)] = (n, a, space.key_of(a))
        assignment[n.id] = hit[1]
        seen.add(hit[2])
    return assignment, seen


def _tag(by_id: dict[int, NodeEvidence], node_id: int) -> str:
    """Return how texts name a node: `n` and its number in the study."""
    return f"n{by_id[node_id].number}" if node_id in by_id else "n?"


def sampler_seed(seed: int, round_no: int) -> int:
    """Return the sampler seed of one ideation round."""
    return (seed * 7919 + round_no) % 2**32


class LocalModel:
    """A kernel-weighted ridge regression of one metric over the measured nodes, around a point."""

    def __init__(
        self,
        space: Space,
        points: list[tuple[Assignment, float]],
        around: Assignment,
        *,
        bandwidth: float = 0.5,
        quadratic: bool = False,
        log: bool = True,
    ) -> None:
        self.space = space
        self.around = around
        self.quadratic = quadratic
        x = np.array([[1.0, *self.features(a)] for a, _ in points])
        y = np.array([v for _, v in points])
        self.log = log and bool(len(y)) and bool(np.all(y > 0))  # sizes and costs are multiplicative
        if self.log:
            y = np.log(y)
        w = np.array([np.exp(-(space.distance(a, around) ** 2) / (2 * bandwidth**2)) for a, _ in points])
        ridge = 1e-3 * np.eye(x.shape[1])
        ridge[0, 0] = 0.0
        xtw = x.T * w
        self.beta = np.linalg.solve(xtw @ x + ridge, xtw @ y) if len(y) else np.zeros(x.shape[1])

    def features(self, a: Assignment) -> list[float]:
        """Return the space's features plus a log coordinate per positive linear range (sizes grow as powers)."""
        extra = []
        for k in self.space.keys:
            if self.space.is_ordered(k):
                vs = self.space.ordered(k)
                lo, hi = float(vs[0]), float(vs[-1])
                if lo > 0:
                    v = max(float(self.space.value(a, k)), lo)
                    extra.append(math.log(v / lo) / math.log(hi / lo) if hi > lo else 0.0)
            elif self.space.is_range(k) and not self.space.dims[k].get("log"):
                lo, hi = self.space.bounds(k)
                if lo > 0:
                    v = max(float(self.space.value(a, k)), lo)
                    extra.append(math.log(v / lo) / math.log(hi / lo) if hi > lo else 0.0)
        if self.quadratic:  # a curvature per ordered key, around the centre: an optimum inside the region
            extra += [
                (
                    self.space.coord(k, self.space.value(a, k))
                    - self.space.coord(k, self.space.value(self.around, k))
                )
                ** 2
                for k in self.space.keys
                if self.space.is_range(k) or self.space.is_ordered(k)
            ]
        return [*self.space.features(a), *extra]

    def predict(self, a: Assignment) -> float:
        """Return the predicted metric at an assignment."""
        v = float(np.dot(self.beta, [1.0, *self.features(a)]))
        return float(np.exp(min(v, 700.0))) if self.log else v


def _drivers(
    space: Space, models: list[LocalModel], a: Assignment, singles: list[tuple[str, Any]]
) -> set[str]:
    """Return the keys whose moves change a constraint's predicted value (all keys if nothing is modelled)."""
    if not models:
        return set(space.keys)
    effect = dict.fromkeys(space.keys, 0.0)
    for model in models:
        here = model.predict(a)
        scale = abs(here) or 1.0
        for k, v in singles:
            effect[k] = max(effect[k], abs(model.predict({**a, k: v}) - here) / scale)
    top = max(effect.values())
    return {k for k, e in effect.items() if e >= 0.1 * top} if top > 0 else set(space.keys)


def _mostly_numeric(space: Space) -> bool:
    """Return whether at least half the keys are numbers (ranges or ordered lists), where a local search has steps.

    A space of mostly unordered choices has no neighbourhood to refine: a trust region around the
    best node would swap one category at a time on a model that has seen few of them (on the
    research suite's categorical study, +0.649 ± 0.077 with the phase against +0.698 ± 0.053
    without it, 5 seeds), so the sampler goes on to the end.
    """
    numeric = sum(1 for k in space.keys if space.is_range(k) or space.is_ordered(k))
    return 2 * numeric >= len(space.keys)


def _violation(rule: dict[str, Any], value: float) -> float:
    return max(optuna_bridge.constraint_values([rule], {rule["metric"]: value}).values())


class SearchPolicy:
    """Constraint-aware Bayesian optimisation over declared config keys, mapped onto the tree."""

    name = "search"
    capabilities: Capabilities = SEARCH

    def __init__(self, sampler: SamplerName = "auto") -> None:
        self.sampler = optuna_bridge.resolve(sampler)

    # ideation -------------------------------------------------------------------

    def ideate(self, ctx: IdeationInput) -> list[Proposal]:
        """Propose children: refine, revisit and restart requests first, then the sampler's batch.

        The batch fills the free slots only (`ctx.free`, else `ctx.k`): a suggestion that waits
        for a slot was asked on older evidence than the next one would be.
        """
        space = Space(ctx.search_space, ctx.base_values)
        rules = [c for c in ctx.constraints if c.get("judge", "metric") == Judge.METRIC]
        assignment, seen = _assignments(space, ctx)
        by_id = {n.id: n for n in ctx.nodes}
        rng = random.Random(sampler_seed(ctx.seed, ctx.round_no))
        trunk = assignment.get(ctx.trunk_node_id, space.full(ctx.base_values))
        out: list[tuple[NodeEvidence, Assignment, str, Origin, int | None]] = []
        for req in ctx.refine:
            node = by_id.get(req.node_id)
            if node is None or not ctx.takes_children(node) or len(out) >= ctx.k:
                continue
            a = self._refine(ctx, space, rules, node, assignment, req, seen)
            if a is not None:
                seen.add(space.key_of(a))
                out.append((node, a, f"refine n{node.number}: {req.goal}", Origin.REFINE, node.id))
        trunk_node = by_id.get(ctx.trunk_node_id)
        for nid in ctx.revisit[:1]:  # a revisit hangs under trunk: not where trunk is at the depth limit
            if (
                nid in assignment
                and len(out) < ctx.k
                and trunk_node is not None
                and ctx.takes_children(trunk_node)
            ):
                why = f"test {_tag(by_id, nid)}'s change again on the current trunk"
                out.append((trunk_node, assignment[nid], why, Origin.REVISIT, nid))
        root = next(n for n in ctx.nodes if n.parent_id is None)
        leaps = list(ctx.restart) + ([-1] if ctx.plateau_level >= 2 else [])
        for failed in leaps:
            if len(out) >= ctx.k:
                break
            avoid = self._branch(ctx.nodes, failed, assignment) if failed >= 0 else list(assignment.values())
            a = self._far(space, rng, avoid, seen)
            if a is not None:
                seen.add(space.key_of(a))
                why = (
                    f"restart away from {_tag(by_id, failed)}'s branch"
                    if failed >= 0
                    else "leap: progress has stalled"
                )
                out.append(
                    (
                        root,
                        a,
                        why,
                        Origin.RESTART if failed >= 0 else Origin.POLICY,
                        failed if failed >= 0 else None,
                    )
                )
        batch = ctx.free or ctx.k
        if len(out) < batch and ctx.finishing() and _mostly_numeric(space):
            for parent, a in self._finish(ctx, space, rules, assignment, seen, rng, batch - len(out)):
                seen.add(space.key_of(a))
                out.append(
                    (parent, a, f"finishing: local search around n{parent.number}", Origin.POLICY, None)
                )
        if len(out) < batch:
            recent = list(optuna_bridge.window(ctx.nodes, ctx.maximize))
            study = optuna_bridge.replay(
                space, recent, rules, maximize=ctx.maximize, windowed=True,
                sampler=optuna_bridge.make_sampler(
                    self.sampler, sampler_seed(ctx.seed, ctx.round_no), conditional=bool(space.conditions)
                ),
            )  # fmt: skip
            for _, a, *_ in out:
                study.add_trial(optuna_bridge.pending_trial(space, a))
            # The nearest of the nodes the sampler saw: the best and the recent, never thousands.
            parents = self._parents(replace(ctx, nodes=recent), rules)
            for a in optuna_bridge.ask(
                study, space, batch - len(out), seen, sampler_seed(ctx.seed, ctx.round_no)
            ):
                parent = min(
                    parents,
                    key=lambda n: (
                        len(space.differing(a, assignment[n.id])),
                        space.distance(a, assignment[n.id]),
                        n.id,
                    ),
                )
                out.append(
                    (parent, a, f"{self.sampler} suggestion near n{parent.number}", Origin.POLICY, None)
                )
        return [self._proposal(ctx, space, trunk, p, a, why, origin, ref) for p, a, why, origin, ref in out]

    def _finish(
        self,
        ctx: IdeationInput,
        space: Space,
        rules: list[dict[str, Any]],
        assignment: dict[int, Assignment],
        seen: set[tuple[str, ...]],
        rng: random.Random,
        want: int,
    ) -> list[tuple[NodeEvidence, Assignment]]:
        """Return up to `want` untried moves inside a trust region around the best node, best predicted first.

        The region's radius (in the space's coordinates) shrinks from 0.2 to 0.05 as the finishing
        share of the budget is spent. Moves are ranked by a local quadratic model of the objective
        fitted on the measured nodes around the best one; moves a local model of a constraint's
        metric predicts to break it are left out.
        """
        sign = 1.0 if ctx.maximize else -1.0
        measured = [n for n in ctx.nodes if n.dev_mean is not None and n.status != NodeStatus.FAILED]
        kept = [
            n for n in measured
            if n.status in (NodeStatus.EVALUATED, NodeStatus.MERGED, NodeStatus.AWAITING_APPROVAL) and optuna_bridge.feasible(rules, n)
        ]  # fmt: skip
        if not kept:
            return []
        best = max(kept, key=lambda n: (sign * float(n.dev_mean or 0.0), -n.id))
        x = assignment[best.id]
        units = max(math.ceil(ctx.finish * ctx.budget), 1)
        radius = FINISH_RADII[1] + (FINISH_RADII[0] - FINISH_RADII[1]) * min(ctx.budget_left / units, 1.0)
        moves: list[Assignment] = []
        for k in space.keys:
            if space.is_ordered(k):
                place = round(space.index(k, space.value(x, k)))
                vs = space.values(k)
                moves += [{**x, k: vs[i]} for i in (place - 1, place + 1) if 0 <= i < len(vs)]
            elif space.is_range(k):
                moves += [
                    {**x, k: v} for step in STEPS if step <= radius for v in space.neighbours(x, k, step)
                ]
            else:
                moves += [{**x, k: c} for c in space.neighbours(x, k, 0.0)]
        numeric = [k for k in space.keys if space.is_range(k) or space.is_ordered(k)]
        for _ in range(128 if numeric else 0):
            moved = [k for k in numeric if rng.random() < 0.5] or [rng.choice(numeric)]
            moves.append(
                {
                    **x,
                    **{
                        k: space.snap(k, space.coord(k, space.value(x, k)) + rng.gauss(0.0, radius / 2))
                        for k in moved
                    },
                }
            )
        objective = LocalModel(
            space, [(assignment[n.id], float(n.dev_mean or 0.0)) for n in measured], x,
            bandwidth=max(2 * radius, 0.2), quadratic=True, log=False,
        )  # fmt: skip
        models = [
            (r, LocalModel(space, pts, x))
            for r in rules
            if (
                pts := [
                    (assignment[n.id], n.dev_metrics[r["metric"]])
                    for n in measured
                    if r["metric"] in n.dev_metrics
                ]
            )
        ]
        ranked: dict[tuple[str, ...], tuple[float, Assignment]] = {}
        for m in moves:
            key = space.key_of(m)
            if key in seen or key in ranked or key == space.key_of(x):
                continue
            changed = space.differing(m, x)
            if (len(changed) > 1 or space.is_range(changed[0])) and space.distance(m, x) > 2 * radius:
                continue  # beyond the region (one step of a list key may be longer)
            if any(_violation(r, model.predict(m)) > 0 for r, model in models):
                continue
            ranked[key] = (-sign * objective.predict(m), m)
        parents = self._parents(ctx, rules)
        parent = best if best in parents else min(parents, key=lambda n: space.distance(x, assignment[n.id]))
        return [(parent, m) for _, m in sorted(ranked.values(), key=lambda t: t[0])[:want]]

    @staticmethod
    def _parents(ctx: IdeationInput, rules: list[dict[str, Any]]) -> list[NodeEvidence]:
        """Return the nodes a suggestion may hang under: measured, feasible, not at the depth limit."""
        root = next(n for n in ctx.nodes if n.parent_id is None)
        ok = [
            n for n in ctx.nodes
            if n.parent_id is not None and n.status in MEASURED and n.dev_mean is not None
            and ctx.takes_children(n) and optuna_bridge.feasible(rules, n)
        ]  # fmt: skip
        return [root, *ok]

    @staticmethod
    def _branch(
        nodes: list[NodeEvidence], node_id: int, assignment: dict[int, Assignment]
    ) -> list[Assignment]:
        """Return the assignments of a node's branch: the node, its ancestors below the root, its subtree."""
        by_id = {n.id: n for n in nodes}
        kids: dict[int | None, list[int]] = {}
        for n in nodes:
            kids.setdefault(n.parent_id, []).append(n.id)
        out: list[Assignment] = []
        cur = by_id.get(node_id)
        while cur is not None and cur.parent_id is not None:
            out.append(assignment[cur.id])
            cur = by_id.get(cur.parent_id)
        stack = list(kids.get(node_id, []))
        while stack:
            nid = stack.pop()
            out.append(assignment[nid])
            stack += kids.get(nid, [])
        return out

    @staticmethod
    def _far(
        space: Space, rng: random.Random, avoid: list[Assignment], seen: set[tuple[str, ...]]
    ) -> Assignment | None:
        """Return the random assignment farthest from every assignment in `avoid`."""
        best: tuple[float, Assignment] | None = None
        for _ in range(256):
            a = {
                k: (rng.choice(space.values(k)) if not space.is_range(k) else space.snap(k, rng.random()))
                for k in space.keys
            }
            if space.key_of(a) in seen:
                continue
            d = min((space.distance(a, b) for b in avoid), default=0.0)
            if best is None or d > best[0]:
                best = (d, a)
        return None if best is None else best[1]

    def _refine(
        self,
        ctx: IdeationInput,
        space: Space,
        rules: list[dict[str, Any]],
        node: NodeEvidence,
        assignment: dict[int, Assignment],
        req: RefineRequest,
        seen: set[tuple[str, ...]],
    ) -> Assignment | None:
        """Return the move from `node` predicted to meet its open constraints with the most gain kept."""
        a = assignment[node.id]
        open_rules = [r for r in rules if r["name"] in req.open_constraints]
        measured = [n for n in ctx.nodes if n.dev_mean is not None and n.status != NodeStatus.FAILED]
        data = {
            r["name"]: [
                (assignment[n.id], n.dev_metrics[r["metric"]])
                for n in measured
                if r["metric"] in n.dev_metrics
            ]
            for r in open_rules
        }
        # A rule no node reported (verdict "unknown") has nothing to model: moves are ranked on the objective.
        models = [(r, LocalModel(space, data[r["name"]], a)) for r in open_rules if data[r["name"]]]
        objective = LocalModel(space, [(assignment[n.id], float(n.dev_mean or 0.0)) for n in measured], a)
        sign = 1.0 if ctx.maximize else -1.0
        moves: list[Assignment] = []
        singles = list(
            dict.fromkeys((k, v) for k in space.keys for s in STEPS for v in space.neighbours(a, k, s))
        )
        # Only the knobs the open constraints depend on (as the history shows them) are moved: the
        # rest of the parent's change is what the repair should keep.
        drivers = _drivers(space, [m for _, m in models], a, singles)
        singles = [(k, v) for k, v in singles if k in drivers]
        moves += [{**a, k: v} for k, v in singles]
        moves += [
            {**a, k1: v1, k2: v2} for (k1, v1), (k2, v2) in itertools.combinations(singles, 2) if k1 != k2
        ]
        # Points on the way to the best measured nodes that meet every rule: a chain of refines that
        # misjudged the constraint bisects toward them.
        anchors = sorted(
            (n for n in measured if optuna_bridge.feasible(rules, n)),
            key=lambda n: -sign * float(n.dev_mean or 0.0),
        )[:3]
        for b in (assignment[n.id] for n in anchors):
            toward = {**a, **{k: space.value(b, k) for k in drivers}}
            moves += [self._between(space, a, toward, t / 10) for t in range(1, 10)]
        best: tuple[tuple[float, ...], Assignment] | None = None
        for m in moves:
            if space.key_of(m) in seen or space.key_of(m) == space.key_of(a):
                continue
            worst = max((_violation(r, model.predict(m)) for r, model in models), default=-1.0)
            # Moves predicted feasible first (all alike, however close to the bound: the largest
            # admissible step keeps the most), then the most objective kept, then the smallest change.
            rank = (max(worst, 0.0), -sign * objective.predict(m), float(len(space.differing(a, m))))
            if best is None or rank < best[0]:
                best = (rank, m)
        return None if best is None else best[1]

    @staticmethod
    def _between(space: Space, a: Assignment, b: Assignment, t: float) -> Assignment:
        """Return the assignment a fraction `t` of the way from `a` to `b`."""
        out = {}
        for k in space.keys:
            if space.is_range(k) or space.is_ordered(k):
                out[k] = space.snap(
                    k, (1 - t) * space.coord(k, space.value(a, k)) + t * space.coord(k, space.value(b, k))
                )
            else:
                out[k] = space.value(b if t >= 0.5 else a, k)
        return out

    def _proposal(
        self,
        ctx: IdeationInput,
        space: Space,
        trunk: Assignment,
        parent: NodeEvidence,
        new: Assignment,
        why: str,
        origin: Origin,
        ref_id: int | None,
    ) -> Proposal:
        # The node is built on trunk (capabilities.whole_assignments), so its title is its change to trunk.
        title = ", ".join(space.describe(trunk, new)) or "no change"
        direction = "raises" if ctx.maximize else "lowers"
        hyp = {
            "mechanism": f"Config edit ({why}): {title}",
            "hypothesis": f"Setting {title} {direction} dev {ctx.metric} relative to trunk",
            "observable": f"mean dev {ctx.metric} over the evaluation repeats, paired by seed against trunk",
            "risks": "; ".join(
                f"may break {c['name']} ({c.get('metric') or 'judged'})" for c in ctx.constraints
            )
            or "none identified",
        }
        return Proposal(parent.id, title, hyp, 0.0, space.full(new), origin, ref_id)

    # implementation --------------------------------------------------------------

    def implement(self, worktree: Path, node: ImplementInput) -> str:
        """Apply the node's key edits exactly; return a short account of what changed."""
        by_file: dict[str, dict[str, Any]] = {}
        for key, value in node.edits.items():
            for target in node.targets.get(key) or [key]:
                try:
                    file, dotted = split_search_key(target)
                except ValueError as exc:
                    raise ImplementationError(str(exc)) from None
                by_file.setdefault(file, {})[dotted] = value
        changed = []
        root = worktree.resolve()
        for file, values in sorted(by_file.items()):
            if not globs.match_any(node.editable, file):
                raise ImplementationError(f"{file} is not editable")
            path = (worktree / file).resolve()
            if not path.is_relative_to(root):
                raise ImplementationError(f"{file} resolves outside the worktree")
            real = path.relative_to(root).as_posix()
            if real != file and not globs.match_any(node.editable, real):
                raise ImplementationError(f"{file} is a link to {real}, which is not editable")
            if not path.is_file():
                raise ImplementationError(f"{file} does not exist")
            text = path.read_text("utf-8")
            try:
                new = configfiles.set_keys(file, text, values, node.formats.get(file))
            except configfiles.ConfigKeyError as exc:
                raise ImplementationError(f"{file}: key {exc} not found") from exc
            except configfiles.ConfigFormatError as exc:
                raise ImplementationError(str(exc)) from exc
            if new != text:
                path.write_text(new, "utf-8")
                changed.append(file)
        return f"set {len(node.edits)} keys in {', '.join(changed) or 'no file'}"

    # insights --------------------------------------------------------------------

    def summarise(self, node: NodeEvidence, ctx_metric: str, parent: NodeEvidence | None) -> str:
        """Return a structured statistical summary of one node's evidence."""
        if node.status == NodeStatus.FAILED or node.dev_mean is None:
            return f"n{node.number} {node.title}: failed ({node.failure or 'no result'})"
        cons = "; ".join(f"{c['name']} {c['verdict']}" for c in node.constraints)
        gain = "" if node.gain is None else f": {node.gain:+.4g} dev {ctx_metric} vs trunk"
        lcb = "" if node.gain_lcb is None else f" (LCB {node.gain_lcb:+.4g}, n={node.dev_n})"
        return f"n{node.number} {node.title}{gain}{lcb}" + (f"; {cons}" if cons else "")

    def synthesize(self, ancestor: NodeEvidence, children: list[NodeEvidence], metric: str) -> str:
        """Return an ancestor insight: per-child effects, best first, citing node ids."""
        done = [c for c in children if c.gain is not None]
        failed = [c for c in children if c.gain is None]
        done.sort(key=lambda c: -(c.gain or 0.0))
        lines = [
            f"{len(children)} children of n{ancestor.number}; {len(done)} measured, {len(failed)} failed."
        ]
        for c in done[:6]:
            lines.append(f"- n{c.number} {c.title}: {c.gain:+.4g} dev {metric}, n={c.dev_n}")
        wins = [c for c in done if (c.gain_lcb or 0) > 0]
        if wins:
            lines.append(f"Works: {', '.join(f'n{c.number}' for c in wins[:4])}.")
        elif done:
            lines.append("No child improved significantly on trunk here.")
        return "\n".join(lines)

    # verification ------------------------------------------------------------------

    def verify(self, node: NodeEvidence, soft: list[dict[str, Any]]) -> Judgement:
        """Judge nothing: without a model soft constraints stay unknown and AREX's call is the rule's."""
        return Judgement()

    def update_state(
        self,
        state: dict[str, Any],
        recent: list[NodeEvidence],
        numbers: dict[int, int] | None = None,
        accepted: frozenset[int] | None = None,
    ) -> dict[str, Any]:
        """Keep the rule-built improvement state as it is."""
        return state
