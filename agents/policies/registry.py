"""Pick the policy a spec asks for."""

from __future__ import annotations

from agents.policies.base import Policy
from agents.policies.search import SearchPolicy
from agents.spec import Spec


class PolicyUnavailable(RuntimeError):
    """The spec asks for a policy this installation cannot provide."""


def make_policy(spec: Spec) -> Policy:
    """Return the policy for a spec."""
    if spec.policy_kind == "search":
        return SearchPolicy()
    raise PolicyUnavailable(
        "policy.kind = 'llm' is not available yet; declare a [search] space and use kind = 'search'"
    )
