"""Builders of the policies' inputs for tests."""

from __future__ import annotations

from typing import Any

from agents.policies.base import ImplementInput


def edits_input(edits: dict[str, Any], editable: list[str]) -> ImplementInput:
    """Return the input of an implementation that sets these keys, with these files editable."""
    return ImplementInput(node_id=1, title="t", hypothesis={}, edits=edits, reflection="", editable=editable)
