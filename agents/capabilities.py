"""What each policy kind does that its callers must know, declared once.

Callers ask a study's policy for a capability (`spec.capabilities.calls_model`,
`policy.capabilities.reads_context`); nothing compares a policy's kind. A new policy is a class
with its `Capabilities`, one line in `KINDS` and one in `agents/policies/registry.py`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What a policy does beyond the protocol's methods."""

    edits_code: bool  # a change may rewrite code; else it sets `[search]` values only (needs `[search]`)
    whole_assignments: bool  # a node holds every `[search]` value and is built on trunk alone
    reads_baseline: bool  # its first proposals read trunk's dev value, so they wait for it
    calls_model: bool  # it calls a model: a model, prices, `budget.usd` and the model server apply
    reads_context: bool  # it reads the repository map, lab memory, insights, reflections, node numbers
    judges: bool  # it judges constraints with `judge = "llm"` and verifies a change from its diff


SEARCH = Capabilities(
    edits_code=False,
    whole_assignments=True,
    reads_baseline=False,
    calls_model=False,
    reads_context=False,
    judges=False,
)
LLM = Capabilities(
    edits_code=True,
    whole_assignments=False,
    reads_baseline=True,
    calls_model=True,
    reads_context=True,
    judges=True,
)
KINDS: dict[str, Capabilities] = {"search": SEARCH, "llm": LLM}


def of(kind: str) -> Capabilities:
    """Return the capabilities of a policy kind."""
    return KINDS[kind]
