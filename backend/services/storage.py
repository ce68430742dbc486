"""The database implementation of the coordinator's `Storage` port."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sqlalchemy import update
from sqlmodel import Session, col, func, select

from agents import globs
from agents.coordinator.ports import Integration, NodeRecord, StudyView
from agents.failures import Blame
from agents.policies.base import Proposal
from agents.tree import pruning
from agents.tree.insights import InsightUpdate
from agents.tree.status import ACTIVE, TERMINAL, NodeStatus, Origin, StudyStatus
from backend.core import db, gitops
from backend.core.models import Event, Job, LlmCall, Node, ReceiptRow, Study, now
from backend.core.states import JobKind, RunKind
from backend.services import lifecycle, memory
from backend.services import proposals as proposals_of
from backend.services.recordcache import Written, cache_of
from backend.services.records import add_event, add_insight, spec_of, transition

MAX_DIFF = 12_000  # characters of a node's diff the verifier is shown
# The ideator's repository map: files listed, files whose Python symbols are read, characters of text.
MAP_FILES, MAP_SYMBOL_FILES, MAP_TEXT = 300, 60, 16_000
# The protected files' preview in the map: the first lines of the smallest text files, within a budget.
PREVIEW_TEXT, PREVIEW_EACH, PREVIEW_LINES, PREVIEW_FILE_BYTES, PREVIEW_FILES = 6000, 1500, 30, 2_000_000, 40
EVAL_OUTPUT = 2000  # characters of trunk's last dev output shown to the ideator


def prune_subtree(s: Session, study_id: int, node_id: int, reason: str, lesson: str, by: str = "") -> None:
    """Prune a node and its prunable descendants; the node keeps its lesson as an insight."""
    # The subtree only, a level at a time (a query per level of the subtree).
    top = s.get(Node, node_id)
    assert top is not None and top.study_id == study_id
    rows: dict[int, Node] = {node_id: top}
    kids: dict[int | None, list[int]] = {}
    level = [node_id]
    while level:
        children = list(s.exec(select(Node).where(Node.study_id == study_id, col(Node.parent_id).in_(level))))
        for c in children:
            rows[c.id or 0] = c
            kids.setdefault(c.parent_id, []).append(c.id or 0)
        level = [c.id or 0 for c in children]
    stack = [node_id]
    while stack:
        nid = stack.pop()
        n = rows[nid]
        stack += kids.get(nid, [])
        if n.status in TERMINAL or n.status in ACTIVE or n.status == NodeStatus.AWAITING_APPROVAL:
            continue
        if n.status == NodeStatus.EVALUATED and nid != node_id:
            continue
        transition(s, n, NodeStatus.PRUNED, reason=reason, by=by)
    top.lesson = f"{pruning.LESSON_PREFIX}{reason}). Lesson: {lesson}"
    s.add(top)
    add_insight(s, study_id, node_id, top.lesson, [node_id])


DIFF_CHARS = 6000  # of a parent's diff shown to its child's executor


def inherit(s: Session, st: Study, node: Node) -> dict[str, Any]:
    """Return what a node starts from besides trunk: its parent's change, merged onto trunk.

    A policy that rebases on trunk (the `search` policy writes a whole assignment) starts every node
    from trunk. Otherwise a child of a node whose change is not in trunk builds on that change: its
    branch is set to the merge of trunk and the parent's commit, and its executor is told the
    parent's diff, its measured effect and, for a refine, why it is refined. A revisit builds on the
    node it revisits the same way (it hangs under trunk). A conflict with trunk leaves the node on
    trunk, with the conflict told to the executor to resolve.
    """
    source = node.origin_ref if node.origin == Origin.REVISIT else node.parent_id
    parent = s.get(Node, source) if source is not None else None
    if (
        parent is None
        or parent.parent_id is None
        or not parent.commit
        or spec_of(st).capabilities.whole_assignments
    ):
        return {}
    repo = gitops.Repo(Path(st.repo_path))
    if repo.is_ancestor(parent.commit, st.trunk_commit):
        return {}  # merged: trunk holds the change
    out: dict[str, Any] = {
        "parent": parent.number,
        "title": parent.title,
        "diff": repo.diff(parent.base_commit or st.trunk_commit, parent.commit)[:DIFF_CHARS],
        "effect": _effect(parent),
    }
    if node.origin == Origin.REFINE:
        out["goal"] = str((parent.verification or {}).get("reason", "")) or "meet its open constraints"
    try:
        out["commit"] = repo.merge_onto(
            node.branch, st.trunk_commit, parent.commit, f"Grove n{node.number}: start from n{parent.number}"
        )
    except gitops.MergeConflict as exc:
        out["conflict"] = str(exc.stderr)[:1000]
    return out


def _effect(parent: Node) -> str:
    """Return a parent's measured effect in words (its dev mean, gain over its base and fate)."""
    if parent.dev_mean is None:
        return f"not measured ({parent.status}{': ' + parent.failure[:200] if parent.failure else ''})"
    gain = f", gain {parent.gain:+.4g} over its base" if parent.gain is not None else ""
    return f"dev mean {parent.dev_mean:.4g}{gain}; {parent.status}" + (
        f": {parent.status_reason[:300]}" if parent.status_reason else ""
    )


@dataclass(frozen=True)
class BudgetSpent:
    """What a study's experiment budget (`[budget] experiments`) has been charged, in its units."""

    experiments: int  # experiment jobs: one unit each
    extra_runs: int  # adaptive dev repeats beyond `repeats`, the nodes' and trunk's: `repeats` a unit
    repeats: int

    @property
    def units(self) -> int:
        return self.experiments + self.extra_runs // self.repeats


def budget_spent(s: Session, study_id: int, repeats: int) -> BudgetSpent:
    """Return what a study's experiment budget has been charged: its experiment jobs and their extra dev runs.

    The sealed baseline and gate jobs are not experiments.
    """
    jobs, extra = s.exec(
        select(func.count(col(Job.id)), func.coalesce(func.sum(Job.extra_runs), 0)).where(
            Job.study_id == study_id, Job.kind == JobKind.EXPERIMENT
        )
    ).one()
    return BudgetSpent(int(jobs), int(extra), max(1, repeats))


def experiments_used(s: Session, study_id: int, repeats: int, pending_runs: int = 0) -> int:
    """Return the experiments a study has spent: its experiment jobs, and every `repeats` extra dev runs as one."""
    spent = budget_spent(s, study_id, repeats)
    return spent.experiments + (spent.extra_runs + pending_runs) // spent.repeats


class SqlStorage:
    """Storage port over SQLModel sessions.

    The study and its records, once read, are served again until a write through this storage
    changes them or `forget()` is called: a coordinator step reads them in every graph node, and
    the driver forgets them before each run of the graph (and after each call to the gatekeeper,
    which writes the study and its nodes itself). After its own writes, only the rows they wrote
    are read again: what others change meanwhile is seen from the next run of the graph.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self._maps: dict[tuple[int, str], dict[str, Any]] = {}  # repository maps by (study, trunk commit)
        self._views: dict[int, StudyView] = {}
        self._records: dict[int, list[NodeRecord]] = {}
        self._written: dict[int, Written] = {}  # by study: own writes since the records were read whole

    def forget(self, study: bool = True, nodes: bool = True) -> None:
        """Read the study (and, or, its records) from the database again on the next call."""
        if study:
            self._views.clear()
        if nodes:
            self._records.clear()
            self._written.clear()

    def _wrote(
        self, study_id: int, nodes: Iterable[int] = (), insights: Iterable[int] = (), jobs: Iterable[int] = ()
    ) -> None:
        """Note rows this storage wrote: the next `nodes()` reads them again (and nothing else)."""
        self._records.pop(study_id, None)
        own = self._written.get(study_id)
        if own is not None:  # else the records are read whole next time anyway
            own.nodes.update(nodes)
            own.insights.update(insights)
            own.jobs.update(jobs)

    def study(self, study_id: int) -> StudyView:
        """Return the study as the coordinator sees it."""
        view = self._views.get(study_id)
        if view is None:
            view = self._views[study_id] = self._read_study(study_id)
        return view

    def _read_study(self, study_id: int) -> StudyView:
        with db.session(self.url) as s:
            st = s.get(Study, study_id)
            assert st is not None and st.id is not None
            used = experiments_used(s, study_id, spec_of(st).evaluate.repeats)
            started = st.started_at or now()
            return StudyView(
                id=st.id,
                name=st.name,
                status=StudyStatus(st.status),
                spec=spec_of(st),
                trunk_commit=st.trunk_commit,
                trunk_node_id=st.trunk_node_id or 0,
                trunk_dev=list(st.trunk_dev),
                base_values=dict(st.base_values),
                test_queries=st.test_queries,
                experiments_used=used,
                elapsed_hours=(now() - started).total_seconds() / 3600,
                improvement_state=dict(st.improvement_state),
                plateau_level=st.plateau_level,
                seed=st.seed,
                usd_spent=float(
                    s.exec(
                        select(func.coalesce(func.sum(LlmCall.usd), 0.0)).where(LlmCall.study_id == study_id)
                    ).one()
                ),
            )

    def memory(self, study_id: int) -> list[str]:
        """Return the lab-memory entries most relevant to the study's goal and plan, one line each."""
        with db.session(self.url) as s:
            st = s.get(Study, study_id)
            return [memory.line(e) for e in memory.relevant(s, st)] if st is not None else []

    def repo_map(self, study_id: int) -> dict[str, Any]:
        """Return a map of trunk for the ideator: files and sizes, Python symbols, editable files' text.

        Sealed paths are left out entirely. Cached per trunk commit.
        """
        with db.session(self.url) as s:
            st = s.get(Study, study_id)
            if st is None or not st.trunk_commit:
                return {}
            spec = spec_of(st)
            key, repo_path = (study_id, st.trunk_commit), st.repo_path
            if key not in self._maps:  # what trunk's dev evaluation printed (dev only: never a sealed run)
                out = s.exec(
                    select(ReceiptRow.stdout_tail)
                    .where(
                        ReceiptRow.node_id == st.trunk_node_id, ReceiptRow.kind == RunKind.DEV, ReceiptRow.ok
                    )
                    .order_by(col(ReceiptRow.id).desc())
                    .limit(1)
                ).first()
        if key not in self._maps:
            try:
                found = repository_map(
                    gitops.Repo(Path(repo_path)), key[1], spec.files.editable, spec.files.sealed,
                    spec.files.protected,
                )  # fmt: skip
            except Exception:  # the repository is the study's, hostile until proven otherwise: no map
                found = {}
            evaluator = {"dev_command": spec.evaluate.dev, "dev_output": (out or "")[-EVAL_OUTPUT:]}
            self._maps[key] = {**found, "evaluator": evaluator}
            while len(self._maps) > 16:
                self._maps.pop(next(iter(self._maps)))
        return self._maps[key]

    def change(self, study_id: int, node_id: int) -> str:
        """Return a node's change as a diff of its commit against its base ("" when there is none)."""
        with db.session(self.url) as s:
            st, node = s.get(Study, study_id), s.get(Node, node_id)
            if st is None or node is None or not node.commit or not node.base_commit:
                return ""
            repo_path, base, commit = st.repo_path, node.base_commit, node.commit
            editable = spec_of(st).files.editable
        try:
            repo = gitops.Repo(Path(repo_path))
            files = [f for f in repo.changed_files(base, commit) if globs.match_any(editable, f)]
            text = (
                repo.git("diff", "--no-ext-diff", "--no-textconv", "--no-color", base, commit, "--", *files)
                if files
                else ""
            )
        except (gitops.GitError, OSError):
            return ""
        return text[:MAX_DIFF] + (
            f"\n[… {len(text) - MAX_DIFF} more characters]" if len(text) > MAX_DIFF else ""
        )

    def nodes(self, study_id: int) -> list[NodeRecord]:
        """Return every node of the study (from this process's cache, refreshed with what changed)."""
        records = self._records.get(study_id)
        if records is None:
            cache = cache_of(self.url, study_id)
            own = self._written.get(study_id)
            with db.session(self.url) as s:
                if own is not None and cache.since is not None:
                    records = cache.reread(s, study_id, own)
                else:
                    records = cache.refresh(s, study_id)
            self._records[study_id], self._written[study_id] = records, Written()
        return records

    def add_proposals(self, study_id: int, round_no: int, proposals: list[Proposal]) -> list[int]:
        """Insert the proposals of an ideation round once (a replayed round returns the same ids)."""
        ids = self._add_proposals(study_id, round_no, proposals)
        self._wrote(study_id, nodes=ids)
        return ids

    def _add_proposals(self, study_id: int, round_no: int, proposals: list[Proposal]) -> list[int]:
        with db.session(self.url) as s:
            existing = s.exec(
                select(Node)
                .where(Node.study_id == study_id, Node.round_no == round_no, Node.origin != Origin.HUMAN)
                .where(Node.parent_id != None)  # noqa: E711
            ).all()
            if existing:
                return [n.id for n in existing if n.id is not None]
            ids = []
            for p in proposals:
                parent = s.get(Node, p.parent_id)
                assert parent is not None
                node = proposals_of.add(s, study_id, parent, p, round_no)
                ids.append(node.id or 0)
            return ids

    def enqueue(self, study_id: int, node_id: int) -> int:
        """Create the job row of the node's next attempt (idempotent) and mark the node queued."""
        self._views.pop(study_id, None)  # the experiments used count jobs
        self._wrote(study_id, nodes=[node_id], jobs=[node_id])
        with db.session(self.url) as s:
            node = s.get(Node, node_id)
            st = s.get(Study, study_id)
            assert node is not None and st is not None
            # A dispatch replayed after a crash finds the node's job made, and maybe ended since (its
            # outcome not yet integrated): that job is the answer. Only a proposed node, or a failed
            # one whose failure was integrated (a retry), gets a new attempt.
            fresh = node.status == NodeStatus.PROPOSED or (
                node.status == NodeStatus.FAILED and node.completed_order > 0
            )
            if not fresh:
                job = s.exec(select(Job).where(Job.node_id == node_id, Job.attempt == node.attempts)).first()
                if job is not None and job.id is not None:
                    return job.id
            node.attempts += 1
            node.base_commit = st.trunk_commit
            node.branch = f"grove/{st.name}/n{node_id}"  # machine names (branches, folders) keep the id
            node.inherited = inherit(s, st, node)
            if node.status == NodeStatus.FAILED:
                node.completed_order = 0
                node.dev_values, node.dev_mean, node.dev_std, node.dev_n = [], None, None, 0
            job = Job(study_id=study_id, node_id=node_id, attempt=node.attempts)
            s.add(job)
            s.flush()
            transition(s, node, NodeStatus.QUEUED, job_id=job.id, attempt=node.attempts)
            assert job.id is not None
            return job.id

    def job_nodes(self, job_ids: list[int]) -> dict[int, int]:
        """Map job ids to their node ids."""
        if not job_ids:
            return {}
        with db.session(self.url) as s:
            return {j.id or 0: j.node_id for j in s.exec(select(Job).where(col(Job.id).in_(job_ids)))}

    def record(self, study_id: int, result: Integration) -> None:
        """Store a node's verification and summary; it becomes the node's first-level insight."""
        self._wrote(study_id, nodes=[result.node_id], insights=[result.node_id])
        with db.session(self.url) as s:
            node = s.get(Node, result.node_id)
            assert node is not None
            if node.status != result.status:
                transition(s, node, result.status, reason=result.verification.get("reason", ""))
            node.gain, node.gain_lcb = result.gain, result.gain_lcb
            node.constraints = result.constraints
            node.verification = result.verification
            node.summary = result.summary
            last = s.exec(
                select(func.coalesce(func.max(Node.completed_order), 0)).where(Node.study_id == study_id)
            ).one()
            node.completed_order = int(last) + 1
            s.add(node)
            add_event(
                s,
                study_id,
                "node.evaluated" if result.gain is not None else "node.verified",
                node.id,
                gain=result.gain,
                gain_lcb=result.gain_lcb,
                decision=result.verification.get("decision"),
                constraints={c["name"]: c["verdict"] for c in result.constraints},
            )
            add_insight(s, study_id, result.node_id, result.summary, [result.node_id])

    def add_insights(self, study_id: int, updates: list[InsightUpdate]) -> None:
        """Append insight versions for ancestors."""
        if not updates:
            return
        self._wrote(study_id, insights=[u.node_id for u in updates])
        with db.session(self.url) as s:
            for u in updates:
                add_insight(s, study_id, u.node_id, u.text, list(u.cites))

    def save_state(self, study_id: int, state: dict[str, Any], plateau_level: int) -> None:
        """Store the rewritten improvement state (the kept study view gets it too: nothing else changed)."""
        view = self._views.get(study_id)
        if view is not None:
            self._views[study_id] = replace(view, improvement_state=dict(state), plateau_level=plateau_level)
        with db.session(self.url) as s:
            st = s.get(Study, study_id)
            assert st is not None
            st.improvement_state = state
            st.plateau_level = plateau_level
            s.add(st)
            add_event(s, study_id, "state.updated", None, plateau_level=plateau_level)

    def prune(self, study_id: int, node_id: int, reason: str, lesson: str) -> None:
        """Prune a node and its prunable descendants; the node keeps its lesson as an insight."""
        self.forget(study=False)
        with db.session(self.url) as s:
            prune_subtree(s, study_id, node_id, reason, lesson)

    def event(self, study_id: int, type_: str, node_id: int | None, payload: dict[str, Any]) -> None:
        """Append an event."""
        with db.session(self.url) as s:
            add_event(s, study_id, type_, node_id, **payload)

    def said(self, study_id: int, type_: str, node_id: int) -> bool:
        """Return whether an event of this type was written for the node (a replayed step writes none twice)."""
        with db.session(self.url) as s:
            found = s.exec(
                select(Event.id).where(
                    Event.study_id == study_id, Event.type == type_, Event.node_id == node_id
                )
            ).first()
            return found is not None

    def pause(self, study_id: int, reason: str, spent: Blame) -> None:
        """Pause a running study whose LLM budget (`spent`: dollars or tokens) cannot cover a call."""
        self.forget(nodes=False)
        with db.session(self.url) as s:
            if lifecycle.load(s, study_id).status == StudyStatus.RUNNING:
                lifecycle.pause(s, study_id, reason=reason, budget=spent)

    def cancel_active(self, study_id: int, reason: str = "study stopped") -> None:
        """Cancel proposed, queued and running nodes (and their jobs) of a study that stops or failed."""
        self.forget()
        with db.session(self.url) as s:
            # Jobs first, in one statement: a claim or an end racing it sees them ended (both take the
            # job's lock before its node's), and none it ended is written back as running.
            s.connection().execute(
                update(Job)
                .where(col(Job.study_id) == study_id, col(Job.status).in_(["queued", "running"]))
                .values(status="failed", finished_at=now(), outcome={"reason": "cancelled"})
            )
            for n in s.exec(select(Node).where(Node.study_id == study_id)):
                if n.status in (NodeStatus.QUEUED, NodeStatus.RUNNING, NodeStatus.PROPOSED):
                    transition(s, n, NodeStatus.CANCELLED, reason=reason)


def repository_map(
    repo: gitops.Repo, commit: str, editable: list[str], sealed: list[str], protected: Iterable[str] = ()
) -> dict[str, Any]:
    """Map a commit's tree: paths and sizes, top-level Python symbols, editable files' text within a
    budget, and the start of the protected files (what the evaluator reads; sealed ones never)."""
    files: list[tuple[str, int]] = []
    for item in repo.git("ls-tree", "-r", "-l", "-z", commit).split("\0"):
        meta, _, path = item.partition("\t")
        parts = meta.split()
        if not path or len(parts) < 4 or parts[1] != "blob" or globs.match_any(sealed, path):
            continue
        files.append((path, int(parts[3]) if parts[3].isdigit() else 0))
    mine = sorted((f for f in files if globs.match_any(editable, f[0])), key=lambda f: f[1])
    py = [f for f in mine if f[0].endswith(".py")] + [
        f for f in files if f[0].endswith(".py") and not globs.match_any(editable, f[0])
    ]
    symbols: dict[str, list[str]] = {}
    for path, size in py[:MAP_SYMBOL_FILES]:
        if size > 200_000:
            continue
        try:
            tree = ast.parse(repo.read_at(commit, path))
        except (SyntaxError, ValueError, RecursionError, MemoryError, gitops.GitError):
            continue
        names = [
            n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        ]
        if names:
            symbols[path] = names[:40]
    contents: dict[str, str] = {}
    left = MAP_TEXT
    for path, size in mine:
        if left <= 0 or size > MAP_TEXT:
            continue
        try:
            text = repo.read_at(commit, path)
        except (gitops.GitError, UnicodeDecodeError):
            continue
        contents[path] = text[: min(6000, left)]
        left -= len(contents[path])
    return {
        "files": [{"path": p, "bytes": b} for p, b in files[:MAP_FILES]],
        "files_total": len(files),
        "python_symbols": symbols,
        "editable_contents": contents,
        "protected_preview": _preview(repo, commit, [f for f in files if globs.match_any(protected, f[0])]),
    }


def _preview(repo: gitops.Repo, commit: str, files: list[tuple[str, int]]) -> dict[str, str]:
    """Return the first lines of the smallest text files given, within `PREVIEW_TEXT` characters."""
    out: dict[str, str] = {}
    left = PREVIEW_TEXT
    for path, size in sorted(files, key=lambda f: f[1])[:PREVIEW_FILES]:
        if left <= 0 or size > PREVIEW_FILE_BYTES:
            break
        try:
            text = repo.read_at(commit, path)
        except (gitops.GitError, UnicodeDecodeError):
            continue
        if "\0" in text:
            continue
        head = "\n".join(text.splitlines()[:PREVIEW_LINES])[: min(PREVIEW_EACH, left)]
        out[path] = head
        left -= len(head)
    return out
