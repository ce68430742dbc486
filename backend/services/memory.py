"""Lab memory: what finished studies learned, kept for later studies of the same repository.

A study that finishes leaves its merged changes, its verified findings and its pruned lessons,
keyed by the repository's root commit and the objective (and by a name the spec may opt into).
A new study's ideator gets the entries most relevant to its goal, ranked by BM25, each with the
study and nodes it came from. Only dev-side evidence goes in: no held-out number, no sealed byte,
no gate reason.
"""

from __future__ import annotations

import re
from typing import Any

from rank_bm25 import BM25Okapi  # type: ignore[import-untyped]
from sqlmodel import Session, col, or_, select

from agents.tree.status import NodeStatus
from backend.core import gitops
from backend.core.models import MemoryEntry, Node, Study
from backend.services.records import latest_insight, spec_of

_WORD = re.compile(r"[a-z0-9_]+")


def repository_key(repo: gitops.Repo, commit: str) -> str:
    """Return a repository's identity: the first root commit of `commit`'s history."""
    roots = repo.git("rev-list", "--max-parents=0", commit).split()
    return sorted(roots)[0] if roots else ""


def objective_of(study: Study) -> str:
    """Return the study's objective as memory keys it: `<metric>:<direction>`."""
    spec = spec_of(study)
    return f"{spec.objective.metric}:{spec.objective.direction}"


def remember(s: Session, study: Study) -> int:
    """Keep what a finished study learned (once); return how many entries were written."""
    spec = spec_of(study)
    if not spec.memory.use or not study.repository_key or study.id is None:
        return 0
    if s.exec(select(MemoryEntry.id).where(MemoryEntry.study_id == study.id)).first() is not None:
        return 0
    nodes = list(s.exec(select(Node).where(Node.study_id == study.id).order_by(col(Node.number))))
    number = {n.id: n.number for n in nodes}
    objective = objective_of(study)

    def entry(
        kind: str, text: str, numbers: list[int], effect: float | None = None, diff: str = ""
    ) -> MemoryEntry:
        return MemoryEntry(
            repository=study.repository_key, objective=objective, name=spec.memory.name, kind=kind, text=text,
            study_id=study.id, study_name=study.name, node_numbers=numbers, dev_effect=effect, diff=diff,
        )  # fmt: skip

    entries = []
    for n in nodes:
        if (
            n.status == NodeStatus.MERGED and n.parent_id is not None
        ):  # the root is the starting point, no finding
            mechanism = str(n.hypothesis.get("mechanism", "")).strip()
            text = n.title + (f" — {mechanism}" if mechanism and mechanism not in n.title else "")
            entries.append(entry("finding", f"merged: {text}", [n.number], n.gain, _diff(n.diff_stats or {})))
        elif n.status == NodeStatus.PRUNED:
            lesson = latest_insight(s, n.id or 0) or n.summary or n.failure
            entries.append(entry("lesson", f"pruned: {n.title}: {lesson[:600]}", [n.number], n.gain))
    for f in study.improvement_state.get("verified_findings", []):
        if f.get("text"):
            entries.append(
                entry(
                    "finding", str(f["text"])[:600], [number[i] for i in f.get("node_ids", []) if i in number]
                )
            )
    s.add_all(entries)
    return len(entries)


def _diff(stats: dict[str, Any]) -> str:
    if not stats:
        return ""
    return f"{stats.get('files', 0)} file(s), +{stats.get('insertions', 0)} -{stats.get('deletions', 0)}"


def candidates(s: Session, study: Study) -> list[MemoryEntry]:
    """Return the entries a study may be given: same repository and objective, or its named memory."""
    spec = spec_of(study)
    if not spec.memory.use:
        return []
    same = (MemoryEntry.repository == study.repository_key) & (MemoryEntry.objective == objective_of(study))
    where = [same] if study.repository_key else []
    if spec.memory.name:
        where.append(MemoryEntry.name == spec.memory.name)
    if not where:
        return []
    rows = s.exec(
        select(MemoryEntry).where(or_(*where), MemoryEntry.study_id != study.id).order_by(col(MemoryEntry.id))
    )
    return list(rows)


def relevant(s: Session, study: Study) -> list[MemoryEntry]:
    """Return the `[memory] entries` most relevant to the study's goal and plan, best first."""
    pool = candidates(s, study)
    k = spec_of(study).memory.entries
    if not pool or k == 0:
        return []
    plan = " ".join(str(x) for x in study.improvement_state.get("next_plan", []))
    words = _words(f"{study.goal} {objective_of(study)} {plan}")
    corpus = [_words(f"{e.kind} {e.text}") or ["_"] for e in pool]
    scores = BM25Okapi(corpus).get_scores(words) if words else [0.0] * len(pool)
    order = sorted(range(len(pool)), key=lambda i: (-float(scores[i]), -(pool[i].id or 0)))
    return [pool[i] for i in order[:k]]


def entries(
    s: Session,
    study: str | None = None,
    repository: str | None = None,
    name: str | None = None,
    limit: int = 1000,
) -> list[MemoryEntry]:
    """List entries newest first, of one study (by name), repository or named memory when given."""
    q = select(MemoryEntry)
    if study is not None:
        q = q.where(MemoryEntry.study_name == study)
    if repository is not None:
        q = q.where(MemoryEntry.repository == repository)
    if name is not None:
        q = q.where(MemoryEntry.name == name)
    return list(s.exec(q.order_by(col(MemoryEntry.id).desc()).limit(limit)))


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def provenance(e: MemoryEntry) -> str:
    """Say where an entry came from: `study <name>, n3, n5`."""
    nodes = ", ".join(f"n{n}" for n in e.node_numbers)
    return f"study {e.study_name}" + (f", {nodes}" if nodes else "")


def line(e: MemoryEntry) -> str:
    """Describe one entry for a prompt: `[M<id>] <kind>: <text> (dev effect ..., diff; from ...)`."""
    facts = [*([f"dev effect {e.dev_effect:+.4g}"] if e.dev_effect is not None else []),
             *([e.diff] if e.diff else []), f"from {provenance(e)}"]  # fmt: skip
    return f"[M{e.id}] {e.text} ({'; '.join(facts)})"
