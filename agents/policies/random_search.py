"""Random search over the declared keys: the baseline the `search` policy must beat."""

from __future__ import annotations

import random

from agents.policies.base import IdeationInput, Proposal
from agents.policies.search import SearchPolicy, Space


class RandomSearchPolicy(SearchPolicy):
    """Propose uniformly random assignments under the root, all with the same prior."""

    name = "random"

    def ideate(self, ctx: IdeationInput) -> list[Proposal]:
        """Return up to `ctx.k` fresh random assignments."""
        space = Space(ctx.search_space, ctx.base_values)
        rng = random.Random(ctx.seed * 7919 + ctx.round_no)
        seen = {space.key_of({**ctx.base_values, **n.edits}) for n in ctx.nodes}
        root = next(n for n in ctx.nodes if n.parent_id is None)
        out: list[Proposal] = []
        for _ in range(50 * ctx.k):
            if len(out) >= ctx.k:
                break
            a = space.sample(rng)
            if space.key_of(a) in seen:
                continue
            seen.add(space.key_of(a))
            out.append(
                self._proposal(ctx, space, root, ctx.base_values, a, 0.0, "random sample", "policy", None)
            )
        return out
