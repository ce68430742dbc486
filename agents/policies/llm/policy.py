"""The `llm` policy: ideation, execution and insight synthesis by any litellm model."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, replace
from importlib import resources
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field, ValidationError, field_validator

from agents.capabilities import LLM, Capabilities
from agents.executor import loop
from agents.executor.tools import Runtime, Toolbox
from agents.llm.model import BudgetExhausted, Model, ModelError
from agents.policies.base import (
    AnswerFormatError,
    IdeationInput,
    ImplementationError,
    ImplementInput,
    Judgement,
    NodeEvidence,
    Proposal,
)
from agents.policies.llm import schemas
from agents.policies.llm.answers import (
    choice,
    confidence,
    json_object,
    name_key,
    node_refs,
)
from agents.policies.llm.fitting import cut, fitted, room
from agents.policies.llm.ideas import Identity, identity, same
from agents.policies.llm.ideation import (
    SHOWN_NODES,
    Assigned,
    Detail,
    Unusable,
    children_of,
    choices_of,
    content_free,
    cut_all,
    errors_of,
    items_of,
    node_view,
    parent_lines,
    prior_of,
    prose,
    repo_view,
    revisits,
    shown_nodes,
)
from agents.policies.search import SearchPolicy
from agents.policies.space import Space
from agents.tree.insights import INSIGHT_CHARS, bounded
from agents.tree.status import NodeStatus, Origin
from agents.verify.state import ImprovementState, renumber


def prompt(name: str) -> str:
    """Return a prompt file's text."""
    return resources.files("agents.policies.llm").joinpath("prompts", f"{name}.md").read_text("utf-8")


LEAST_EVIDENCE = 300  # tokens of the least evidence a role's prompt holds beside its instructions


def shortest_prompt() -> int:
    """Return about the tokens of the shortest prompt a role may be sent: its instructions (and the
    executor's tools) and the least evidence, counted low (four characters a token)."""
    from agents.executor.tools import TOOLS

    roles = ("ideator", "insight", "reflect", "state", "verifier")
    texts = [prompt(r) for r in roles] + [prompt("executor") + json.dumps(TOOLS)]
    return max(len(t) for t in texts) // 4 + LEAST_EVIDENCE


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


# The ideator's prompt, fullest first: `fitting.fitted` sends the first level that fits the model's input.
IDEATOR_LEVELS = (
    Detail(SHOWN_NODES, 400, 300, 30, 400, None, None, 1),
    Detail(40, 240, 200, 16, 240, 4000, 120, None),
    Detail(24, 160, 120, 8, 160, 1500, 60, None),
    Detail(12, 100, 80, 4, 120, 400, 20, None),
    Detail(6, 60, 60, 2, 80, 0, 0, None),
    Detail(3, 0, 0, 0, 60, 0, 0, None),
)
DROPPED_SHOWN = 12  # dropped ideas the ideator is told of at most (the latest)
# The other roles' prompts at their levels of detail, fullest first.
INSIGHT_LEVELS = ((10_000, INSIGHT_CHARS), (24, 600), (12, 300), (6, 160), (3, 80))  # children, chars each
VERIFIER_LEVELS = ((20_000, 60_000, 4000), (6000, 16_000, 2000), (2500, 6000, 1000), (1000, 2000, 400),
                   (400, 600, 200))  # report, diff, failure characters  # fmt: skip
STATE_LEVELS = ((2000, None), (800, 600), (300, 300), (120, 160))  # evidence texts, each state text


class LlmPolicy:
    """Thinks with a model: the ideator, the executor and the insight synthesiser are prompts."""

    name = "llm"
    capabilities: Capabilities = LLM

    def __init__(
        self,
        model: Model,
        limits: loop.Limits = loop.Limits(),
        refused: Callable[[str, int | None, str, str, str], None] | None = None,
        settings_only: bool = False,
    ) -> None:
        self.model, self.limits = model, limits
        self.settings_only = settings_only  # every child carries edits, where the study has settings
        # Told of every answer that could not be used: (role, node id or None, reason, answer, try).
        self.refused = refused
        self._stats = SearchPolicy()

    def ideate(self, ctx: IdeationInput) -> list[Proposal]:
        """Ask the ideator for `ctx.k` children, after a revisit of a change a merge made stale; children
        with an invalid parent or that repeat an idea come back `dropped`, with why (`ideas.same`: equal
        change, or equal mechanism and parameters)."""
        again = revisits(ctx)
        if again:
            ctx = replace(ctx, k=ctx.k - len(again))
            if ctx.k <= 0:
                return again
        try:
            return again + self._ideate(ctx)
        except ModelError:
            if again:
                return again  # it needs no ideator: it runs, and the next round asks again
            raise

    def _ideate(self, ctx: IdeationInput) -> list[Proposal]:
        data = asdict(ctx)
        # The model sees each node by its number in the study, as every page does; answers map back.
        number = {n.id: n.number for n in ctx.nodes}
        node_of = {n.number: n.id for n in ctx.nodes}
        system = prompt("ideator").format(k=ctx.k, editable=", ".join(ctx.editable) or "any file")
        if self.settings_only and ctx.search_space:
            system += "Every child of this study sets at least one of the settings in `edits`.\n"
        dropped = [
            {"title": cut(x.get("title"), 160), "parent_id": number.get(x.get("parent_id")),  # type: ignore[arg-type]
             "reason": cut(x.get("reason"), 300)}
            for x in ctx.dropped[-DROPPED_SHOWN:]
        ]  # fmt: skip

        space = Space(ctx.search_space, ctx.base_values) if ctx.search_space else None
        settings = Assigned(space, ctx.nodes)
        on_trunk = settings.values(ctx.trunk_node_id)
        choices = choices_of(space, on_trunk) if space is not None else {}

        def build(level: int) -> list[dict[str, Any]]:
            d, full = IDEATOR_LEVELS[level], level == 0
            shown = shown_nodes(ctx, d.nodes)
            state = renumber(data["improvement_state"], number.get)
            evidence = {
                "goal": data["goal"],
                "objective": {"metric": data["metric"], "maximize": data["maximize"]},
                "constraints": data["constraints"],
                "trunk_node_id": number.get(ctx.trunk_node_id),
                "trunk_dev_mean": data["trunk_dev_mean"],
                **({"settings": choices} if choices else {}),
                "nodes": [node_view(n, number, d, full, ctx.takes_children(n)) for n in shown],
                "nodes_shown": f"{len(shown)} of {len(ctx.nodes)} (root, trunk, the best, the recent, the open "
                               "and their parents)" if len(shown) < len(ctx.nodes) else f"all {len(ctx.nodes)}",
                **({} if full else {"shortened": "texts and lists are cut to fit the model's context; … marks a cut"}),
                "dropped_ideas": dropped,
                "recent_changes": [
                    {"id": number.get(x["id"]), "executor_report": cut(x["report"], d.text * 2),
                     "diff": cut(x["diff"], d.contents if d.contents is not None else 3000)}
                    for x in data["recent"]
                ] if d.text else [],
                "repository": repo_view(ctx.repo_map, d),
                "improvement_state": state if full else {k: items_of(v, d) for k, v in state.items()},
                "validated_findings": data["validated_findings"] if full else items_of(data["validated_findings"], d),
                "pruned_lessons": items_of(data["pruned_lessons"], d),
                "lab_memory": [cut(x, d.item) for x in data["memory"][: d.items]],
                "refine_requests": [{**r, "node_id": number.get(r["node_id"])} for r in data["refine"]],
                "restart_from_root_away_from": [number.get(i) for i in data["restart"]],
                "max_depth": data["max_depth"],
                "plateau_level": data["plateau_level"],
            }  # fmt: skip
            return [
                {"role": "system", "content": system},
                {"role": "user", "content": json.dumps(evidence, indent=d.indent, default=str)},
            ]

        messages = fitted(self.model, "ideator", build, len(IDEATOR_LEVELS))
        try:
            parents = [
                n.number
                for n in ctx.nodes
                if n.status not in (NodeStatus.PRUNED, NodeStatus.CANCELLED) and ctx.takes_children(n)
            ]
            needed = self.settings_only and space is not None
            schema = schemas.ideator(ctx.k, parents, space, needed)
            children = self._ask(
                "ideator",
                messages,
                lambda text: children_of(text, ctx.trunk_dev_mean, space, needed),
                schema=schema,
            )
        except Unusable as exc:
            raise ModelError(f"the ideator's answer is not the requested JSON: {exc}") from exc
        valid = {n.id: n for n in ctx.nodes if n.status not in (NodeStatus.PRUNED, NodeStatus.CANCELLED)}
        # What is tried already: every node but the root and those cancelled before they ran.
        known: list[tuple[str, Identity]] = [
            (f"n{n.number} ({cut(n.title, 80)})", identity(n.title, n.mechanism, settings.of(n.id)))
            for n in ctx.nodes
            if n.parent_id is not None and n.status != NodeStatus.CANCELLED
        ]
        refine = {r.node_id for r in ctx.refine}
        titles = {n.title.strip().lower(): n.number for n in ctx.nodes}
        out = []
        root = next((n.id for n in ctx.nodes if n.parent_id is None), None)
        restarts = list(ctx.restart)  # the first root child after each abandoned branch answers it
        for c in children[: ctx.k]:
            asked = c.parent_id
            c.parent_id = node_of.get(c.parent_id, -1)
            edits = settings.changed(c.parent_id, c.edits)
            if edits:  # what is set is what the node says it does: its words cannot say otherwise
                c.mechanism = settings.said(c.parent_id, edits)
                if c.title.strip().lower() in titles or c.title.strip().lower() in system.lower():
                    c.title = cut(c.mechanism, 200)  # a title copied from the prompt says what was set
            idea = identity(c.title, c.mechanism, settings.of(c.parent_id, edits) if edits else None)
            twin = next((name for name, other in known if same(idea, other)), None)
            why = ""
            copied = titles.get(c.title.strip().lower())
            if c.parent_id not in valid:
                why = f"its parent n{asked} is not a node that may take children (unknown, pruned, cancelled)"
            elif c.edits and not edits:
                why = f"its edits change nothing: n{asked} already has those values"
            elif not edits and not c.mechanism.strip():
                why = "it names no change: neither edits nor a mechanism"
            elif copied is not None:
                why = f"its title is n{copied}'s, copied from the prompt: not a new idea"
            elif twin:
                why = f"a duplicate of {twin}: the same mechanism and parameters"
            if why:
                out.append(Proposal(c.parent_id, c.title, {"mechanism": c.mechanism}, 0.0, {}, dropped=why))
                continue
            known.append((f"{cut(c.title, 80)!r}, proposed beside it", idea))
            hyp = {
                "mechanism": c.mechanism,
                "hypothesis": c.hypothesis,
                "observable": c.observable,
                "risks": c.risks,
                "expected_gain": f"{c.expected_gain:g}",  # the model's prediction, kept beside the realised gain
            }
            origin, ref = (Origin.REFINE, c.parent_id) if c.parent_id in refine else (Origin.POLICY, None)
            if origin == Origin.POLICY and c.parent_id == root and restarts:
                origin, ref = Origin.RESTART, restarts.pop(0)
            prior = prior_of(c.expected_gain, ctx.nodes, ctx.trunk_dev_mean)
            out.append(Proposal(c.parent_id, c.title, hyp, prior, edits, origin, ref))
        return out

    def _ask(
        self,
        role: str,
        messages: list[dict[str, Any]],
        parse: Callable[[str], T],
        node_id: int | None = None,
        schema: dict[str, Any] | None = None,
    ) -> T:
        """Ask for a structured answer (in `schema`'s form, where the server constrains decoding); while
        it cannot be used, ask again (`REASKS` times at most), quoting what was wrong. Every refused
        answer is reported (on `node_id`, if given)."""
        asked = messages
        for tried in range(1, REASKS + 2):
            turn = self.model.complete(role, messages, schema=schema)
            try:
                return parse(turn.content)
            except Unusable as exc:
                self._refuse(role, node_id, str(exc), turn.content, f"{tried} of {REASKS + 1}")
                if tried > REASKS:
                    raise
                # The prompt, the last answer (cut: a model that echoed its prompt must not overflow its
                # context when asked again) and what was wrong with it.
                shown = {"role": "assistant", "content": cut(turn.content, SHOWN_ANSWER)}
                again = {"role": "user", "content": f"Your answer could not be used: {exc}. Answer again "
                         "with the JSON object only."}  # fmt: skip
                messages = [*asked, shown, again]
                space = room(self.model)
                if space is not None and self.model.count(messages) > space:  # type: ignore[attr-defined]
                    messages = [*asked, again]  # what was wrong fits where the answer does not
        raise AssertionError("unreachable")  # pragma: no cover

    def _refuse(self, role: str, node_id: int | None, reason: str, answer: str, tried: str = "") -> None:
        if self.refused is not None:
            self.refused(role, node_id, reason, answer, tried)

    def implement(self, worktree: Path, node: ImplementInput) -> str:
        """Apply the node's edits of settings exactly, or run the executor loop on its hypothesis; return
        the account of what changed (the executor's report)."""
        if node.edits:
            return self._stats.implement(worktree, node)  # exact values need no model turn
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
                *parent_lines(ctx.get("parent") or {}),
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
        system = prompt("reflect")
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": json.dumps(evidence, default=str)},
        ]
        try:
            said = self._ask(
                "reflect",
                messages,
                prose("reflection", system),
                node.node_id,
                schemas.prose("reflection", 1500),
            )
        except (ModelError, BudgetExhausted, Unusable):
            return ""
        return said[:1500]

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
        # Past the first level: fewer children (the measured best, then the latest), shorter lessons.
        lcb = [c.gain_lcb if c.gain_lcb is not None else float("-inf") for c in children]
        ranked = sorted(range(len(children)), key=lambda i: (-lcb[i], -children[i].number))

        def build(level: int) -> list[dict[str, Any]]:
            most, chars = INSIGHT_LEVELS[level]
            shown = kids if level == 0 else [kids[i] for i in sorted(ranked[:most])]
            body = {"node": {"id": ancestor.number, "title": cut(ancestor.title, 200)}, "metric": metric,
                    "children": [{**k, "title": cut(k["title"], 200), "insight": cut(k["insight"], chars)}
                                 for k in shown]}  # fmt: skip
            if len(shown) < len(kids):
                body["children_shown"] = f"{len(shown)} of {len(kids)} (the best measured and the latest)"
            return [
                {"role": "system", "content": system},
                {"role": "user", "content": json.dumps(body, default=str)},
            ]

        system = prompt("insight")
        try:
            messages = fitted(self.model, "insight writer", build, len(INSIGHT_LEVELS))
            schema = schemas.prose("insight", INSIGHT_CHARS)
            text = bounded(self._ask("insight", messages, prose("insight", system), ancestor.id, schema))
        except (ModelError, BudgetExhausted, Unusable):
            text = ""  # the statistical summary still records the lesson
        return text or self._stats.synthesize(ancestor, children, metric)

    def verify(self, node: NodeEvidence, soft: list[dict[str, Any]]) -> Judgement:
        """Ask the verifier for a 0-100 confidence per soft constraint and AREX's refine/restart call."""

        def build(level: int) -> list[dict[str, Any]]:
            report, diff, failure = VERIFIER_LEVELS[level]
            evidence = {
                "node": {"id": node.number, "title": node.title, "report": cut(node.report, report),
                         "diff": cut(node.diff, diff), "dev_metrics": node.dev_metrics, "gain": node.gain,
                         "gain_lcb": node.gain_lcb, "constraints": node.constraints,
                         "failure": cut(node.failure, failure)},
                "soft_constraints": [{"name": c["name"], "description": c["description"]} for c in soft],
            }  # fmt: skip
            return [
                {"role": "system", "content": prompt("verifier")},
                {"role": "user", "content": json.dumps(evidence, default=str)},
            ]

        try:
            messages = fitted(self.model, "verifier", build, len(VERIFIER_LEVELS))
        except ModelError:
            return Judgement()  # too long even shortened: no judgement, as when the call fails
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
            answer = self._ask(
                "verifier", messages, parse, node.id, schemas.verifier([c["name"] for c in soft])
            )
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
        shown = renumber(state, number.get)

        def build(level: int) -> list[dict[str, Any]]:
            text, item = STATE_LEVELS[level]  # the state's lists stay whole: its rewrite replaces them
            evidence = [
                {"id": number.get(n.id), "title": cut(n.title, 200), "status": n.status, "gain": n.gain,
                 "gain_lcb": n.gain_lcb, "constraints": n.constraints, "failure": cut(n.failure, text),
                 "summary": cut(n.summary, text)}
                for n in recent
            ]  # fmt: skip
            view = shown if item is None else {k: cut_all(v, item) for k, v in shown.items()}
            return [
                {"role": "system", "content": prompt("state")},
                {
                    "role": "user",
                    "content": json.dumps({"state": view, "new_evidence": evidence}, default=str),
                },
            ]

        try:
            messages = fitted(self.model, "state writer", build, len(STATE_LEVELS))
        except ModelError:
            return state  # too long even shortened: the state stays as it is, as when the call fails

        def parse(text: str) -> dict[str, Any]:
            try:
                fresh = ImprovementState.from_dict(renumber(node_refs(_object(text)), node_of.get)).to_dict()
            except (TypeError, KeyError, AttributeError, ValueError) as exc:
                raise Unusable(f"not an improvement state with the listed keys ({exc})") from None
            said = [
                *(f["text"] for f in fresh["verified_findings"]), *fresh["concerns"], *fresh["next_plan"],
                *(c["detail"] for c in fresh["open_constraints"]), *(r["reason"] for r in fresh["rejected_candidates"]),
            ]  # fmt: skip
            empty = next((t for t in said if content_free(str(t))), None)
            if empty is not None:
                raise Unusable(
                    f"{str(empty).strip()[:20]!r} is a placeholder: every entry says what was found"
                )
            if accepted is not None:
                fresh["verified_findings"] = [
                    f for f in fresh["verified_findings"] if f["node_ids"] and set(f["node_ids"]) <= accepted
                ]
            return fresh

        try:
            return self._ask("state", messages, parse, schema=schemas.state(sorted(node_of)))
        except (ModelError, BudgetExhausted, Unusable):
            return state


T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)
REASKS = 2  # times an unusable structured answer is asked for again, with what was wrong
SHOWN_ANSWER = 1000  # characters of the refused answer a re-ask shows the model


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
            raise Unusable(errors_of(exc)) from None

    return parse
