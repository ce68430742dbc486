"""Node fates from the database: the columns, refine children and trunk that `agents.tree.fate` reads."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from sqlmodel import Session, col, select

from agents.tree.fate import Facts, candidate, fate, rejection
from agents.tree.status import Origin
from backend.core.models import Node, Study
from backend.services.records import spec_of


def fate_columns() -> dict[str, Any]:
    """Return the columns a fate is told from (besides a node summary's), by name, for one bulk query.

    Only the two parts of `verification` a fate reads are taken out of it, in the database.
    """
    v = col(Node.verification)
    return {
        "status_reason": Node.status_reason,
        "status_by": Node.status_by,
        "decision": v["decision"].as_string(),
        "open_constraints": v["open_constraints"].as_string(),  # JSON text: decoded only when not empty
        "gated": Node.gated,
        "gate_reason": Node.gate_reason,
        "failure": Node.failure,
        "base_commit": Node.base_commit,
        "origin_ref": Node.origin_ref,
    }


def _names(value: Any) -> tuple[str, ...]:
    """Return constraint names from a JSON list (text, as read in bulk, or already decoded)."""
    if isinstance(value, str):
        value = json.loads(value) if value not in ("", "[]", "null") else []
    return tuple(str(c) for c in value or ())


def node_fate(
    row: Mapping[str, Any],
    refined_as: Sequence[int],
    trunk_commit: str,
    min_gain: float,
    revisited_as: Sequence[int] = (),
) -> str:
    # refined_as, revisited_as: the numbers of the node's refine children and of the nodes revisiting it
    """Return a node's fate from its columns (a node summary's fields and `fate_columns`)."""
    return fate(facts(row, refined_as, trunk_commit, min_gain, revisited_as))


class Told(NamedTuple):
    """A node's fate in words, with the fields a program reads from the same facts."""

    fate: str
    rejection: str  # human, constraint, gate or dev ('' unless rejected)
    candidate: bool  # a gate candidate


def node_told(
    row: Mapping[str, Any],
    refined_as: Sequence[int],
    trunk_commit: str,
    min_gain: float,
    revisited_as: Sequence[int] = (),
) -> Told:
    """Return a node's fate, what rejected it and whether it is a gate candidate, from its columns."""
    f = facts(row, refined_as, trunk_commit, min_gain, revisited_as)
    return Told(fate(f), str(rejection(f) or ""), candidate(f))


def facts(
    row: Mapping[str, Any],
    refined_as: Sequence[int],
    trunk_commit: str,
    min_gain: float,
    revisited_as: Sequence[int] = (),
) -> Facts:
    """Return what a node's fate is told from, out of its columns."""
    return Facts(
        status=row["status"],
        reason=row["status_reason"],
        by=row["status_by"],
        is_root=row["parent_id"] is None,
        gain_lcb=row["gain_lcb"],
        min_gain=min_gain,
        decision=row["decision"] or "",
        open_constraints=_names(row["open_constraints"]),
        refined_as=tuple(refined_as),
        gated=bool(row["gated"]),
        gate_reason=row["gate_reason"],
        failure=row["failure"],
        on_trunk=row["base_commit"] == trunk_commit,
        revisited_as=tuple(revisited_as),
    )


def refined_as(s: Session, n: Node) -> list[int]:
    """Return the numbers of a node's refine children."""
    return _refs(s, n)[0]


def _refs(s: Session, n: Node) -> tuple[list[int], list[int]]:
    """Return the numbers of a node's refine children and of the nodes that measure it again."""
    refs = s.exec(
        select(Node.origin, Node.number)
        .where(
            Node.origin_ref == n.id, col(Node.origin).in_(("refine", "revisit")), Node.study_id == n.study_id
        )
        .order_by(col(Node.id))
    ).all()
    refined = [num for origin, num in refs if origin == Origin.REFINE]
    revisited = [num for origin, num in refs if origin == Origin.REVISIT]
    return refined, revisited


def told_of(s: Session, n: Node) -> Told:
    """Return one node's fate and its fields (its refine children and its study's trunk are looked up)."""
    st = s.get(Study, n.study_id)
    assert st is not None
    refined, revisited = _refs(s, n)
    return node_told(_row(n), refined, st.trunk_commit, spec_of(st).plateau.min_gain, revisited)


def fate_of(s: Session, n: Node) -> str:
    """Return one node's fate in words."""
    return told_of(s, n).fate


def _row(n: Node) -> dict[str, Any]:
    """Return a loaded node as the columns `node_fate` reads (the two parts of its verification)."""
    v = n.verification or {}
    return {**n.model_dump(), "decision": v.get("decision"), "open_constraints": v.get("open_constraints")}


def study_fates(s: Session, st: Study) -> dict[int, str]:
    """Return the fate of every node of a study."""
    nodes = list(s.exec(select(Node).where(Node.study_id == st.id).order_by(col(Node.id))))
    refs: dict[str, dict[int, list[int]]] = {"refine": {}, "revisit": {}}
    for n in nodes:
        if n.origin in refs and n.origin_ref is not None:
            refs[n.origin].setdefault(n.origin_ref, []).append(n.number)
    min_gain = spec_of(st).plateau.min_gain
    return {
        n.id or 0: node_fate(
            _row(n),
            refs["refine"].get(n.id or 0, []),
            st.trunk_commit,
            min_gain,
            refs["revisit"].get(n.id or 0, []),
        )
        for n in nodes
    }
