"""Proposed nodes: the one module that adds a node to a study's tree, for the policy and for people.

The coordinator's ideation rounds (`SqlStorage.add_proposals`) and a human hypothesis (the API's
hypotheses route) both come here: a proposal becomes a `proposed` child of its parent with one
`node.proposed` event, and a human one is checked against the study first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlmodel import Session

from agents import configfiles
from agents.policies.base import Proposal
from agents.tree.status import NodeStatus, Origin
from backend.core import gitops
from backend.core.errors import FieldError
from backend.core.models import Node, Study
from backend.services.records import add_event, spec_of


def reach(s: Session, node: Node) -> int:
    """Return how many steps a node sits below its nearest merged ancestor (what `max_depth` bounds)."""
    steps, n = 0, node  # type: tuple[int, Node | None]
    while n is not None and n.status != NodeStatus.MERGED and n.parent_id is not None:
        steps, n = steps + 1, s.get(Node, n.parent_id)
    return steps


class ProposalRefused(FieldError):
    """A human hypothesis the study cannot take (`key` names the field)."""


def add(s: Session, study_id: int, parent: Node, proposal: Proposal, round_no: int, by: str = "") -> Node:
    """Add a proposal as a proposed child of `parent`, with its `node.proposed` event; return the node."""
    node = Node(
        study_id=study_id,
        parent_id=parent.id,
        depth=parent.depth + 1,
        round_no=round_no,
        title=proposal.title,
        hypothesis=dict(proposal.hypothesis),
        origin=proposal.origin,
        origin_ref=proposal.origin_ref,
        prior=proposal.prior,
        edits=dict(proposal.edits),
    )
    s.add(node)
    s.flush()
    told: dict[str, Any] = {"title": proposal.title, "parent_id": parent.id, "origin": proposal.origin}
    add_event(s, study_id, "node.proposed", node.id, **told, **({"by": by} if by else {}))
    return node


def human(s: Session, st: Study, parent: Node, title: str, hypothesis: dict[str, str], edits: dict[str, Any],
          by: str) -> Node:  # fmt: skip
    """Add a person's hypothesis under `parent`; it runs before the policy's own proposals.

    Raises ProposalRefused where the parent is too deep below trunk's line, an edit names no
    `[search]` key found at trunk, or the search policy is given no edits to make.
    """
    spec = spec_of(st)
    if reach(s, parent) >= spec.policy.max_depth:
        raise ProposalRefused(
            "parent",
            f"n{parent.number} is policy.max_depth ({spec.policy.max_depth}) steps below the last merged "
            "change on its line; add the hypothesis under a node nearer to it",
        )
    # The search policy's nodes hold whole assignments; an llm node holds what it sets itself, so a
    # hypothesis without edits is a change of code for the executor.
    chosen = {**st.base_values, **parent.edits} if spec.capabilities.whole_assignments else {}
    repo = gitops.Repo(Path(st.repo_path))
    for key, value in edits.items():
        if key not in spec.search:
            raise ProposalRefused(f"edits.{key}", "not a key of the study's [search] section")
        try:
            spec.value_at(key, lambda f: repo.read_followed(st.trunk_commit, f))
        except (configfiles.ConfigKeyError, gitops.GitError, ValueError):
            raise ProposalRefused(f"edits.{key}", "not found at trunk") from None
        chosen[key] = value
    if not spec.capabilities.edits_code and not edits:
        raise ProposalRefused("edits", "the search policy implements hypotheses as key edits")
    idea = Proposal(parent.id or 0, title, hypothesis, 1.0, chosen, origin=Origin.HUMAN)
    return add(s, st.id or 0, parent, idea, round_no=-1, by=by)
