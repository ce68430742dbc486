"""The `llm` policy: ideation, execution and insight synthesis by any litellm model."""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Callable
from dataclasses import asdict
from importlib import resources
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field, ValidationError, ValidationInfo, field_validator

from agents.executor import loop
from agents.executor.tools import Runtime, Toolbox
from agents.policies.base import (
    AnswerFormatError,
    IdeationInput,
    ImplementationError,
    ImplementInput,
    Judgement,
    NodeEvidence,
    Proposal,
)
from agents.policies.llm.answers import (
    choice,
    confidence,
    json_list,
    json_object,
    name_key,
    node_number,
    node_refs,
    number,
)
from agents.policies.llm.model import BudgetExhausted, Model, ModelError
from agents.policies.search import SearchPolicy
from agents.verify.state import ImprovementState, renumber


def prompt(name: str) -> str:
    """Return a prompt file's text."""
    return resources.files("agents.policies.llm").joinpath("prompts", f"{name}.md").read_text("utf-8")


class Child(BaseModel):
    parent_id: int
    title: str = Field(min_length=1, max_length=200)
    mechanism: str = ""
    hypothesis: str = ""
    observable: str = ""
    risks: str = ""
    expected_gain: float = 0.0

    @field_validator("parent_id", mode="before")
    @classmethod
    def _node(cls, v: Any) -> Any:
        return node_number(v)  # 3, "3" and "n3" (as the prompts write nodes) are node 3

    @field_validator("expected_gain", mode="before")
    @classmethod
    def _gain(cls, v: Any, info: ValidationInfo) -> Any:
        return 0.0 if v is None else number(v, (info.context or {}).get("trunk"))  # "5%": of trunk's dev


class Verdict(BaseModel):
    name: str
    confidence: int = Field(ge=0, le=100)
    reason: str = ""

    @field_validator("confidence", mode="before")
    @classmethod
    def _scale(cls, v: Any) -> Any:
        return confidence(v)  # 0.9, 90 and "90%" are 90


class Verdicts(BaseModel):
    verdicts: list[Verdict] = []
    call: Literal["", "accept", "refine", "restart"] = ""
    why: str = ""

    @field_validator("verdicts", mode="before")
    @classmethod
    def _listed(cls, v: Any) -> Any:
        if isinstance(v, dict):  # {"readable": 90} or {"readable": {"confidence": 90, ...}}
            return [{"name": k, **(x if isinstance(x, dict) else {"confidence": x})} for k, x in v.items()]
        return [] if v is None else v

    @field_validator("call", mode="before")
    @classmethod
    def _call(cls, v: Any) -> Any:
        return "" if v is None else choice(v, ("accept", "refine", "restart"))


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


def near_duplicate(title: str, others: list[str], threshold: float = 0.8) -> bool:
    """Return whether a text matches an existing one: word overlap (Jaccard) or characters ≥ threshold."""
    w = _words(title)
    flat = " ".join(sorted(w))
    for other in others:
        o = _words(other)
        if w and o and len(w & o) / len(w | o) >= threshold:
            return True
        if flat and difflib.SequenceMatcher(None, flat, " ".join(sorted(o))).ratio() >= 0.9:
            return True
    return False


def prior_of(expected: float, nodes: list[NodeEvidence], trunk_mean: float | None) -> float:
    """Shrink and clip a model's expected gain against the gains the study has measured.

    The clip is twice the largest measured |gain| (a tenth of |trunk dev| before any is measured);
    the shrink factor (n + 1) / (n + 4) trusts the model less while the study knows little.
    """
    gains = [
        abs(n.gain) for n in nodes if n.gain is not None and math.isfinite(n.gain) and n.parent_id is not None
    ]
    cap = 2 * max(gains) if gains else 0.1 * abs(trunk_mean or 0.0)
    if not math.isfinite(expected):
        return 0.0
    return max(-cap, min(cap, expected)) * (len(gains) + 1) / (len(gains) + 4)


SHOWN_NODES = 60  # nodes an ideator's prompt lists at most


def shown_nodes(ctx: IdeationInput, limit: int = SHOWN_NODES) -> list[NodeEvidence]:
    """Return a bounded view of the tree for a prompt: root, open nodes, trunk, the best, the recent, then parents."""
    nodes = ctx.nodes
    if len(nodes) <= limit:
        return list(nodes)
    sign = 1.0 if ctx.maximize else -1.0
    by_id = {n.id: n for n in nodes}
    measured = sorted((n for n in nodes if n.dev_mean is not None), key=lambda n: -sign * (n.dev_mean or 0.0))
    wanted = [n.id for n in nodes if n.parent_id is None or n.status in ("proposed", "queued", "running")]
    wanted += [ctx.trunk_node_id, *(r.node_id for r in ctx.refine), *ctx.restart]
    wanted += [n.id for n in measured[: limit // 3]] + [
        n.id for n in sorted(nodes, key=lambda n: -n.id)[: limit // 3]
    ]
    keep = dict.fromkeys(i for i in wanted if i in by_id)
    keep = dict.fromkeys(list(keep)[:limit])
    for i in list(keep):  # then their parents, while there is room
        parent = by_id[i].parent_id
        if len(keep) < limit and parent is not None:
            keep[parent] = None
    return sorted((by_id[i] for i in keep), key=lambda n: n.id)


class Unusable(ValueError):
    """A model's answer could not be used; the message says why (and goes back to the model)."""


def _parent_lines(parent: dict[str, Any]) -> list[str]:
    """Return the executor's view of the parent change its worktree builds on (none for a child of trunk)."""
    if not parent:
        return []
    n = f"n{parent.get('parent')}"
    lines = [
        f"You build on {n} ({parent.get('title', '')}): its change is already in your worktree, on "
        f"top of trunk. Its measured effect: {parent.get('effect', '')}.",
    ]
    if parent.get("goal"):
        lines.append(f"This is a refine of {n}: keep its mechanism and fix this: {parent['goal']}")
    if parent.get("conflict"):
        lines.append(
            f"{n}'s change conflicts with trunk, so your worktree is trunk alone: re-apply the parts of "
            f"its diff below that still make sense. Conflict: {parent['conflict']}"
        )
    lines.append(f"{n}'s diff against the trunk it was built on:\n{parent.get('diff', '')}")
    return lines


class LlmPolicy:
    """Thinks with a model: the ideator, the executor and the insight synthesiser are prompts."""

    name = "llm"
    rebase_on_trunk = False
    reads_baseline = True

    def __init__(
        self,
        model: Model,
        limits: loop.Limits = loop.Limits(),
        refused: Callable[[str, int | None, str, str, str], None] | None = None,
    ) -> None:
        self.model, self.limits = model, limits
        # Told of every answer that could not be used: (role, node id or None, reason, answer, try).
        self.refused = refused
        self._stats = SearchPolicy()

    def ideate(self, ctx: IdeationInput) -> list[Proposal]:
        """Ask the ideator for `ctx.k` children; drop invalid parents and near-duplicates."""
        data = asdict(ctx)
        # The model sees each node by its number in the study, as every page does; answers map back.
        number = {n.id: n.number for n in ctx.nodes}
        node_of = {n.number: n.id for n in ctx.nodes}
        shown = shown_nodes(ctx)
        evidence = {
            "goal": data["goal"],
            "objective": {"metric": data["metric"], "maximize": data["maximize"]},
            "constraints": data["constraints"],
            "trunk_node_id": number.get(ctx.trunk_node_id),
            "trunk_dev_mean": data["trunk_dev_mean"],
            "nodes": [
                {"id": number[n.id], "parent_id": number.get(n.parent_id) if n.parent_id is not None else None, "depth": n.depth, "status": n.status,
                 "title": n.title, "mechanism": n.mechanism, "dev_mean": n.dev_mean, "dev_n": n.dev_n, "gain": n.gain, "gain_lcb": n.gain_lcb,
                 "constraints": n.constraints, "insight": n.insight[:400], "failure": n.failure[:300]}
                for n in shown
            ],
            "nodes_shown": f"{len(shown)} of {len(ctx.nodes)} (the best, the recent, the open and their parents)"
            if len(shown) < len(ctx.nodes) else f"all {len(ctx.nodes)}",
            "repository": ctx.repo_map,
            "improvement_state": renumber(data["improvement_state"], number.get),
            "validated_findings": data["validated_findings"],
            "pruned_lessons": data["pruned_lessons"],
            "lab_memory": data["memory"],
            "refine_requests": [{**r, "node_id": number.get(r["node_id"])} for r in data["refine"]],
            "restart_from_root_away_from": [number.get(i) for i in data["restart"]],
            "max_depth": data["max_depth"],
            "plateau_level": data["plateau_level"],
        }  # fmt: skip
        messages = [
            {"role": "system", "content": prompt("ideator").format(k=ctx.k, editable=", ".join(ctx.editable) or "any file")},
            {"role": "user", "content": json.dumps(evidence, indent=1, default=str)},
        ]  # fmt: skip
        try:
            children = self._ask("ideator", messages, lambda text: _children(text, ctx.trunk_dev_mean))
        except Unusable as exc:
            raise ModelError(f"the ideator's answer is not the requested JSON: {exc}") from exc
        valid = {n.id: n for n in ctx.nodes if n.status not in ("pruned", "cancelled")}
        titles = [n.title for n in ctx.nodes]
        ideas = [f"{n.title} {n.mechanism}" for n in ctx.nodes]
        refine = {r.node_id for r in ctx.refine}
        out = []
        root = next((n.id for n in ctx.nodes if n.parent_id is None), None)
        restarts = list(ctx.restart)  # the first root child after each abandoned branch answers it
        for c in children[: ctx.k]:
            c.parent_id = node_of.get(c.parent_id, -1)
            idea = f"{c.title} {c.mechanism}"
            if c.parent_id not in valid or near_duplicate(c.title, titles) or near_duplicate(idea, ideas):
                continue
            titles.append(c.title)
            ideas.append(idea)
            hyp = {
                "mechanism": c.mechanism,
                "hypothesis": c.hypothesis,
                "observable": c.observable,
                "risks": c.risks,
                "expected_gain": f"{c.expected_gain:g}",  # the model's prediction, kept beside the realised gain
            }
            origin, ref = ("refine", c.parent_id) if c.parent_id in refine else ("policy", None)
            if origin == "policy" and c.parent_id == root and restarts:
                origin, ref = "restart", restarts.pop(0)
            prior = prior_of(c.expected_gain, ctx.nodes, ctx.trunk_dev_mean)
            out.append(Proposal(c.parent_id, c.title, hyp, prior, {}, origin, ref))
        return out

    def _ask(
        self, role: str, messages: list[dict[str, Any]], parse: Callable[[str], T], node_id: int | None = None
    ) -> T:
        """Ask for a structured answer; while it cannot be used, ask again (`REASKS` times at most),
        quoting what was wrong. Every refused answer is reported (on `node_id`, if given)."""
        for tried in range(1, REASKS + 2):
            turn = self.model.complete(role, messages)
            try:
                return parse(turn.content)
            except Unusable as exc:
                self._refuse(role, node_id, str(exc), turn.content, f"{tried} of {REASKS + 1}")
                if tried > REASKS:
                    raise
                messages = [*messages, turn.message(), {"role": "user", "content": f"Your answer could not be used: "
                            f"{exc}. Answer again with the JSON object only."}]  # fmt: skip
        raise AssertionError("unreachable")  # pragma: no cover

    def _refuse(self, role: str, node_id: int | None, reason: str, answer: str, tried: str = "") -> None:
        if self.refused is not None:
            self.refused(role, node_id, reason, answer, tried)

    def implement(self, worktree: Path, node: ImplementInput) -> str:
        """Run the executor loop on the node's hypothesis; return its report."""
        runtime: Runtime | None = node.runtime
        if runtime is None:
            raise ImplementationError("the llm executor needs a runtime for run and evaluate_dev")
        toolbox = Toolbox(worktree, node.editable, runtime)
        ctx = node.context
        related = ctx.get("reflections", [])
        task = "\n".join(
            [
                f"Goal of the study: {ctx.get('goal', '')}",
                f"Objective: {ctx.get('direction', '')} `{ctx.get('metric', '')}` (development evaluation: evaluate_dev).",
                *([f"Trunk (the code you start from) scores {ctx['trunk_dev']} on the development evaluation."]
                  if ctx.get("trunk_dev") else []),
                *(["Constraints every candidate is judged on:", *(f"- {c}" for c in ctx["constraints"])]
                  if ctx.get("constraints") else []),
                f"Your hypothesis (node n{node.number}): {node.title}",
                *(f"{k.capitalize()}: {v}" for k, v in node.hypothesis.items() if v),
                f"You have {self.limits.turns} turns; each observation says which turn it is.",
                "Lessons from the ancestors, root first:",
                *(f"- {x}" for x in ctx.get("insights", [])),
                *(["Reflections from failed attempts on related nodes (cite them by node when they shape "
                   "your plan):", *(f"- {r}" for r in related)] if related else []),
                *([f"A previous attempt at this node failed. {node.reflection}"] if node.reflection else []),
                *_parent_lines(ctx.get("parent") or {}),
            ]
        )  # fmt: skip
        system = prompt("executor").format(editable=", ".join(node.editable))
        transcript = loop.Transcript()
        report = ""
        try:
            report = loop.run(
                self.model, toolbox, system, task, self.limits, transcript,
                lambda reason, answer: self._refuse("executor", node.node_id, reason, answer),
            )  # fmt: skip
        except loop.FormatLimit as exc:
            raise AnswerFormatError(str(exc)) from exc
        except loop.ExecutorError as exc:
            raise ImplementationError(str(exc)) from exc
        finally:
            node.trajectory.update(messages=transcript.messages, feedback=transcript.feedback, report=report)
        return report

    def reflect(self, node: ImplementInput, failure: str) -> str:
        """Ask the model for a strategy-level reflection on a failed attempt; "" if it cannot answer."""
        traj = node.trajectory
        actions = [
            f"{c['function']['name']}({c['function']['arguments'][:300]})"
            for m in traj.get("messages", [])
            if m.get("role") == "assistant"
            for c in m.get("tool_calls") or []
        ] or [
            str(m.get("content", ""))[:300] for m in traj.get("messages", []) if m.get("role") == "assistant"
        ]
        evidence = {
            "hypothesis": {"title": node.title, **node.hypothesis},
            "failure": failure[:2000],
            "feedback": [f[:800] for f in traj.get("feedback", [])[-6:]],
            "last_actions": actions[-8:],
            "report": str(traj.get("report", ""))[:1000],
        }
        messages = [
            {"role": "system", "content": prompt("reflect")},
            {"role": "user", "content": json.dumps(evidence, default=str)},
        ]
        try:
            return self.model.complete("reflect", messages).content.strip()[:1500]
        except (ModelError, BudgetExhausted):
            return ""

    def summarise(self, node: NodeEvidence, ctx_metric: str, parent: NodeEvidence | None) -> str:
        """Return the node's evidence as a statistical summary (no model call)."""
        return self._stats.summarise(node, ctx_metric, parent)

    def synthesize(self, ancestor: NodeEvidence, children: list[NodeEvidence], metric: str) -> str:
        """Ask the synthesiser for the ancestor's new insight; fall back to statistics on a model error."""
        kids = [
            {"id": c.number, "status": c.status, "title": c.title, "gain": c.gain, "gain_lcb": c.gain_lcb,
             "n": c.dev_n, "insight": c.insight or c.summary}
            for c in children
        ]  # fmt: skip
        messages = [
            {"role": "system", "content": prompt("insight")},
            {"role": "user", "content": json.dumps({"node": {"id": ancestor.number, "title": ancestor.title},
                                                    "metric": metric, "children": kids}, default=str)},
        ]  # fmt: skip
        try:
            text = self.model.complete("insight", messages).content.strip()
        except (ModelError, BudgetExhausted):
            text = ""  # the statistical summary still records the lesson
        return text or self._stats.synthesize(ancestor, children, metric)

    def verify(self, node: NodeEvidence, soft: list[dict[str, Any]]) -> Judgement:
        """Ask the verifier for a 0-100 confidence per soft constraint and AREX's refine/restart call."""
        evidence = {
            "node": {"id": node.number, "title": node.title, "report": node.report, "diff": node.diff,
                     "dev_metrics": node.dev_metrics, "gain": node.gain, "gain_lcb": node.gain_lcb,
                     "constraints": node.constraints, "failure": node.failure},
            "soft_constraints": [{"name": c["name"], "description": c["description"]} for c in soft],
        }  # fmt: skip
        messages = [
            {"role": "system", "content": prompt("verifier")},
            {"role": "user", "content": json.dumps(evidence, default=str)},
        ]
        names = {name_key(c["name"]): c["name"] for c in soft}

        def parse(text: str) -> Verdicts:
            answer = _model_of(Verdicts)(text)
            for v in answer.verdicts:  # "Readable" judges the constraint `readable`
                v.name = names.get(name_key(v.name), v.name)
            missing = [c["name"] for c in soft if c["name"] not in {v.name for v in answer.verdicts}]
            if missing:
                raise Unusable(
                    f"no verdict for {', '.join(missing)}; give one per soft constraint, named as listed: "
                    + ", ".join(c["name"] for c in soft)
                )
            return answer

        try:
            answer = self._ask("verifier", messages, parse, node.id)
        except (ModelError, BudgetExhausted, Unusable):
            return Judgement()
        verdicts = {v.name: (v.confidence, v.reason) for v in answer.verdicts}
        return Judgement(verdicts, answer.call, answer.why)

    def update_state(
        self,
        state: dict[str, Any],
        recent: list[NodeEvidence],
        numbers: dict[int, int] | None = None,
        accepted: frozenset[int] | None = None,
    ) -> dict[str, Any]:
        """Ask the state updater to rewrite the improvement state; keep the old one if it fails.

        The model sees nodes by their numbers (`numbers`: id -> number); its answer is mapped back.
        A verified finding stays only if every node it cites is in `accepted` (when given).
        """
        number = numbers if numbers is not None else {n.id: n.id for n in recent}
        node_of = {v: k for k, v in number.items()}
        evidence = [
            {"id": number.get(n.id), "title": n.title, "status": n.status, "gain": n.gain, "gain_lcb": n.gain_lcb,
             "constraints": n.constraints, "failure": n.failure, "summary": n.summary}
            for n in recent
        ]  # fmt: skip
        messages = [
            {"role": "system", "content": prompt("state")},
            {
                "role": "user",
                "content": json.dumps(
                    {"state": renumber(state, number.get), "new_evidence": evidence}, default=str
                ),
            },
        ]

        def parse(text: str) -> dict[str, Any]:
            try:
                fresh = ImprovementState.from_dict(renumber(node_refs(_object(text)), node_of.get)).to_dict()
            except (TypeError, KeyError, AttributeError, ValueError) as exc:
                raise Unusable(f"not an improvement state with the listed keys ({exc})") from None
            if accepted is not None:
                fresh["verified_findings"] = [
                    f for f in fresh["verified_findings"] if f["node_ids"] and set(f["node_ids"]) <= accepted
                ]
            return fresh

        try:
            return self._ask("state", messages, parse)
        except (ModelError, BudgetExhausted, Unusable):
            return state


T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)
REASKS = 2  # times an unusable structured answer is asked for again, with what was wrong


def _object(text: str) -> dict[str, Any]:
    value = json_object(text)
    if value is None:
        raise Unusable("it holds no JSON object")
    return value


def _model_of(model: type[M]) -> Callable[[str], M]:
    def parse(text: str) -> M:
        try:
            return model.model_validate(_object(text))
        except ValidationError as exc:
            raise Unusable(_errors(exc)) from None

    return parse


def _errors(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'answer'}: {e['msg']}" for e in exc.errors()[:5])


def _children(text: str, trunk: float | None = None) -> list[Child]:
    """Return the valid children of an ideator's answer; each is checked on its own.

    A bare list of children, or one child alone, is read as the "children" list; `trunk` (trunk's dev
    mean) is what a percentage gain is a percentage of.
    """
    found = json_object(text)
    raw = found.get("children") if found is not None else None
    listed = json_list(text) if raw is None else None
    if (
        listed is not None
        and all(isinstance(x, dict) for x in listed)
        and (found is None or listed[:1] == [found])
    ):
        raw = listed  # a bare list of children
    if raw is None and found is not None:  # {"proposals": [...]}, or one child alone
        lists = [v for v in found.values() if isinstance(v, list) and v and all(isinstance(x, dict) for x in v)]  # fmt: skip
        raw = lists[0] if len(lists) == 1 else [found] if "title" in found else None
    if found is None and raw is None:
        raise Unusable("it holds no JSON object")
    if not isinstance(raw, list):
        raise Unusable('the object needs a "children" list')
    out, wrong = [], []
    for i, item in enumerate(raw):
        try:
            out.append(Child.model_validate(item, context={"trunk": trunk}))
        except ValidationError as exc:
            wrong.append(f"child {i}: {_errors(exc)}")
    if raw and not out:
        raise Unusable("no child is valid (" + "; ".join(wrong) + ")")
    return out
