"""What a failed attempt says about its idea: the one exception base for failures that say nothing.

A failure of the model's answers or of the machinery (model server, budget, sandbox, git, disk) is
no evidence against the idea tried: the node gets more attempts, and its idea is not marked as
rejected. Such exceptions derive from `NoEvidence`; the attempt records its `Blame` as a field.
"""

from __future__ import annotations

from enum import StrEnum


class Blame(StrEnum):
    IDEA = "idea"  # the attempt failed on the idea's own terms: evidence against it
    MACHINERY = "machinery"  # the model's answers or the machinery failed: nothing was learned
    USD = "usd"  # a model call the study's LLM budget in dollars could not cover: the study pauses
    TOKENS = "tokens"  # a model call its token budget could not cover: the study pauses


SPENT = frozenset({Blame.USD, Blame.TOKENS})  # a spent LLM budget, which pauses the study


class NoEvidence(Exception):
    """A failure that is no evidence against the idea being tried."""

    blame: Blame = Blame.MACHINERY


def blame_of(exc: BaseException) -> Blame:
    """Return what a failed attempt's exception says about its idea."""
    if isinstance(exc, NoEvidence):
        return exc.blame
    return Blame.MACHINERY if isinstance(exc, OSError) else Blame.IDEA
