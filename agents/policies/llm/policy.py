"""The `llm` policy: ideation, execution and insight synthesis by any litellm model."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field, ValidationError, ValidationInfo, field_validator

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
    json_list,
    json_object,
    name_key,
    node_number,
    node_refs,
    number,
)
from agents.policies.llm.fitting import cut, fitted, room
from agents.policies.llm.ideas import Identity, identity, same
from agents.policies.search import SearchPolicy
from agents.policies.space import Space, fmt
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


# What a model writes when it fills a form without an idea: punctuation alone, or a word that
# stands for a value (the schema's own words included).
_PLACEHOLDER = re.compile(
    r"^[\W_]*$|^(string|text|title|todo|tbd|placeholder)$", re.I
)  # "none" is a fair risk


def content_free(text: str) -> bool:
    """Return whether a text an answer gave holds no content: a placeholder, not words of its own."""
    return bool(_PLACEHOLDER.match(text.strip().strip("<>[]{}()\"'`").strip()))


def _plain(text: str) -> str:
    return " ".join(text.lower().split())


def echoed(text: str, instructions: str) -> bool:
    """Return whether a text begins with words copied from a role's instructions (as base models echo)."""
    start = _plain(text)[:60]
    return len(start) >= 24 and start in _plain(instructions)


def prose(field: str, instructions: str) -> Callable[[str], str]:
    """Return a reader of a one-text answer (`{field: text}`, or the text alone) that refuses text
    saying nothing: empty, a placeholder, or the instructions echoed."""

    def parse(text: str) -> str:
        found = json_object(text)
        if found is not None and not isinstance(found.get(field), str):
            raise Unusable(f'the object needs "{field}": the text')
        said = (found[field] if found is not None else text).strip()
        if not said or content_free(said):
            raise Unusable(f"the {field} is empty or a placeholder: write what the evidence shows")
        if echoed(said, instructions):
            raise Unusable(f"the {field} repeats the instructions: write what the evidence shows")
        return said

    return parse


def _setting(space: Space, key: Any, value: Any) -> tuple[str, Any]:
    """Return the `[search]` key an edit names (in full, or by its unique ending) and the value it sets.

    Raise ValueError, naming what the key may take, where it is not a key or the value not one of its.
    """
    name = str(key).strip()
    keys = [k for k in space.keys if k == name] or [
        k for k in space.keys if k.endswith((":" + name, "." + name)) or k.split(":", 1)[-1] == name
    ]
    if len(keys) != 1:
        raise ValueError(f"{name[:80]!r} is not one of the settings: {', '.join(space.keys)}")
    found = keys[0]
    if not space.is_range(found):
        for choice_ in space.values(found):
            if (choice_ == value and type(choice_) is type(value)) or fmt(choice_) == fmt(value):
                return found, choice_
        shown = ", ".join(fmt(v) for v in space.values(found))
        raise ValueError(f"{found} takes one of {shown}, not {fmt(value)[:40]}")
    x = number(value)
    if isinstance(x, float) and space.is_int(found) and x.is_integer():
        x = int(x)
    try:
        inside = space.contains(found, x)
    except OverflowError:  # an integer of hundreds of digits
        inside = False
    if not inside:
        lo, hi = space.bounds(found)
        kind = "an integer" if space.is_int(found) else "a number"
        raise ValueError(f"{found} takes {kind} from {fmt(lo)} to {fmt(hi)}, not {fmt(x)[:40]}")
    return found, space.clean(found, x)


class Child(BaseModel):
    parent_id: int
    title: str = Field(min_length=1, max_length=200)
    # `[search]` key -> value: set exactly, with no executor turn (read from [{"key", "value"}] too).
    edits: dict[str, Any] = {}
    mechanism: str = ""
    hypothesis: str = ""
    observable: str = ""
    risks: str = ""
    expected_gain: float = 0.0

    @field_validator("title", "mechanism", "hypothesis", "observable", "risks")
    @classmethod
    def _said(cls, v: str, info: ValidationInfo) -> str:
        if (v or info.field_name == "title") and content_free(v):
            raise ValueError(f"{v.strip()[:20]!r} is a placeholder, not an idea: say what the change is")
        return v

    @field_validator("parent_id", mode="before")
    @classmethod
    def _node(cls, v: Any) -> Any:
        return node_number(v)  # 3, "3" and "n3" (as the prompts write nodes) are node 3

    @field_validator("edits", mode="before")
    @classmethod
    def _edits(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None:
            return {}
        pairs = (
            [(x.get("key"), x.get("value")) if isinstance(x, dict) else (x, None) for x in v]
            if isinstance(v, list)
            else list(v.items())
            if isinstance(v, dict)
            else None
        )
        if pairs is None:
            raise ValueError('edits are a list of {"key": <setting>, "value": <its new value>}')
        space: Space | None = (info.context or {}).get("space")
        if space is None:
            if pairs:
                raise ValueError("this study declares no settings to edit: leave edits empty")
            return {}
        return dict(_setting(space, k, x) for k, x in pairs)

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


AGAIN = re.compile(r" \(again, on n\d+\)$")  # a revisit's title mark (a revisit of a revisit keeps one)


def revisits(ctx: IdeationInput) -> list[Proposal]:
    """Return the first change made stale by a merge, to be measured again merged onto the current trunk.

    It needs no model: the child starts from the merge of trunk and that node's commit (where they
    conflict, its edits of settings are set again, or its executor is asked to resolve it), hangs
    under trunk, and its gain is paired against trunk.
    """
    by_id = {n.id: n for n in ctx.nodes}
    trunk = by_id.get(ctx.trunk_node_id)
    if trunk is None or not ctx.takes_children(trunk) or ctx.k < 1:
        return []
    for nid in ctx.revisit[:1]:
        old = by_id.get(nid)
        if old is None:
            continue
        gain = f" ({old.gain:+.4g} on the trunk it was built on)" if old.gain is not None else ""
        hyp = {
            "mechanism": old.mechanism or old.title,
            "hypothesis": f"n{old.number}'s change{gain} still improves the current trunk, n{trunk.number}",
            "observable": f"a dev gain over n{trunk.number}, paired by seed",
            "risks": f"n{trunk.number}'s change may already hold what n{old.number} brought, or clash with it",
        }
        title = cut(f"{AGAIN.sub('', old.title)} (again, on n{trunk.number})", 200)
        # A change of settings is set again on trunk where the merge conflicts: no executor turn.
        return [Proposal(trunk.id, title, hyp, max(old.gain or 0.0, 0.0), dict(old.edits), "revisit", nid)]
    return []


def shown_nodes(ctx: IdeationInput, limit: int = SHOWN_NODES) -> list[NodeEvidence]:
    """Return a bounded view of the tree for a prompt, by priority: the root, trunk, refine and restart
    requests, the best, the recent, then open nodes, each followed by its parent while there is room."""
    nodes = ctx.nodes
    if len(nodes) <= limit:
        return list(nodes)
    sign = 1.0 if ctx.maximize else -1.0
    by_id = {n.id: n for n in nodes}
    measured = sorted((n for n in nodes if n.dev_mean is not None), key=lambda n: -sign * (n.dev_mean or 0.0))
    wanted = [n.id for n in nodes if n.parent_id is None]
    wanted += [ctx.trunk_node_id, *(r.node_id for r in ctx.refine), *ctx.restart]
    wanted += [n.id for n in measured[: limit // 3]] + [
        n.id for n in sorted(nodes, key=lambda n: -n.id)[: limit // 3]
    ]
    wanted += [
        n.id for n in nodes if n.status in (NodeStatus.PROPOSED, NodeStatus.QUEUED, NodeStatus.RUNNING)
    ]
    keep: dict[int, None] = {}
    for i in wanted:
        for j in (i, by_id[i].parent_id if i in by_id else None):
            if j is not None and j in by_id and len(keep) < limit:
                keep[j] = None
    return sorted((by_id[i] for i in keep), key=lambda n: n.id)


@dataclass(frozen=True)
class Detail:
    """How much of the evidence the ideator's prompt holds at one level (`IDEATOR_LEVELS`)."""

    nodes: int  # nodes listed (`shown_nodes`)
    text: int  # characters of each node's mechanism and insight
    failure: int  # characters of each node's failure
    items: int  # entries of each list: pruned lessons, lab memory, findings, the state's lists
    item: int  # characters of each entry
    contents: int | None  # characters of each editable file's text (None: as the map gives them)
    files: int | None  # files of the repository map listed (None: all it gives)
    indent: int | None  # JSON indentation


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


def _cut_all(value: Any, chars: int) -> Any:
    """Return a value with every string in it cut to `chars` characters."""
    if isinstance(value, str):
        return cut(value, chars)
    if isinstance(value, list):
        return [_cut_all(v, chars) for v in value]
    if isinstance(value, dict):
        return {k: _cut_all(v, chars) for k, v in value.items()}
    return value


def _items(values: Any, d: Detail) -> list[Any]:
    """Return the latest `d.items` entries of a list, each text in it cut to `d.item` characters."""
    if not isinstance(values, list):
        return []
    kept = values[-d.items :] if d.items else []
    return [
        cut(v, d.item) if isinstance(v, str)
        else {k: cut(x, d.item) if isinstance(x, str) else x for k, x in v.items()} if isinstance(v, dict)
        else v
        for v in kept
    ]  # fmt: skip


def _repo_view(repo: dict[str, Any], d: Detail) -> dict[str, Any]:
    """Return the repository map at a level: fewer files, editable texts cut, no symbols past level 1."""
    if d.files is None:
        return repo
    out: dict[str, Any] = {
        "files": list(repo.get("files", []))[: d.files],
        "files_total": repo.get("files_total"),
    }
    if d.files >= 60:
        out["python_symbols"] = repo.get("python_symbols", {})
    evaluator = dict(repo.get("evaluator", {}))
    if evaluator:
        printed, keep = str(evaluator.get("dev_output", "")), d.contents or 200  # its end holds the metrics
        out["evaluator"] = {
            **evaluator,
            "dev_output": printed if len(printed) <= keep else "…" + printed[1 - keep :],
        }
    if d.contents:
        for part in ("editable_contents", "protected_preview"):
            out[part] = {path: cut(text, d.contents) for path, text in dict(repo.get(part, {})).items()}
    return {k: v for k, v in out.items() if v}


def _node_view(
    n: NodeEvidence, number: dict[int, int], d: Detail, full: bool, room: bool = True
) -> dict[str, Any]:
    """Return one node as the ideator sees it at a level (empty fields left out past the first);
    `room`: whether it may take children (said only where it may not)."""
    view = {
        "id": number[n.id], "parent_id": number.get(n.parent_id) if n.parent_id is not None else None,
        "depth": n.depth, "status": n.status, "title": cut(n.title, 200 if full else 120),
        "mechanism": cut(n.mechanism, d.text), "dev_mean": n.dev_mean, "dev_n": n.dev_n, "gain": n.gain,
        "gain_lcb": n.gain_lcb,
        "constraints": n.constraints if full else [
            {k: c.get(k) for k in ("name", "verdict", "value")} for c in n.constraints
        ],
        "insight": cut(n.insight, d.text), "failure": cut(n.failure, d.failure),
        **({} if room else {"takes_children": False}),
    }  # fmt: skip
    return view if full else {k: v for k, v in view.items() if v not in ("", None, [])}


def _choices(space: Space, on_trunk: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Return each setting as the ideator sees it: trunk's value and the values it may take."""
    out: dict[str, dict[str, Any]] = {}
    for key in space.keys:
        bounds = dict(zip(("low", "high"), space.bounds(key), strict=True)) if space.is_range(key) else {}
        out[key] = {"trunk": on_trunk.get(key), "values": schemas.offered(space, key), **bounds}
    return out


class _Assigned:
    """Each node's values of the `[search]` keys: the study's, with the edits of its line applied."""

    def __init__(self, space: Space | None, nodes: list[NodeEvidence]) -> None:
        self.space, self.by_id = space, {n.id: n for n in nodes}

    def values(self, node_id: int) -> dict[str, Any]:
        """Return a node's assignment of every key (the edits along its line, root first)."""
        line, seen, at = [], set(), self.by_id.get(node_id)
        while at is not None and at.id not in seen:
            seen.add(at.id)
            line.append(at.edits)
            at = self.by_id.get(at.parent_id) if at.parent_id is not None else None
        merged: dict[str, Any] = dict(self.space.base) if self.space else {}
        for edits in reversed(line):
            merged.update(edits)
        return self.space.full(merged) if self.space else merged

    def of(self, node_id: int, edits: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Return the assignment a node's own edits made (with `edits`: its child's); None without edits."""
        own = edits if edits is not None else self.by_id[node_id].edits if node_id in self.by_id else {}
        if self.space is None or not own:
            return None
        return self.space.full({**self.values(node_id), **(edits or {})})

    def said(self, parent_id: int, edits: dict[str, Any]) -> str:
        """Return what a child's edits do, in words: `set KEY from OLD to NEW` for each."""
        held = self.values(parent_id)
        return "; ".join(f"set {k} from {fmt(held.get(k))} to {fmt(v)}" for k, v in sorted(edits.items()))

    def changed(self, parent_id: int, edits: dict[str, Any]) -> dict[str, Any]:
        """Return the edits that change a value the parent holds."""
        if self.space is None or not edits:
            return {}
        held = self.values(parent_id)
        return {k: v for k, v in edits.items() if fmt(held.get(k)) != fmt(v)}


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
        settings = _Assigned(space, ctx.nodes)
        on_trunk = settings.values(ctx.trunk_node_id)
        choices = _choices(space, on_trunk) if space is not None else {}

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
                "nodes": [_node_view(n, number, d, full, ctx.takes_children(n)) for n in shown],
                "nodes_shown": f"{len(shown)} of {len(ctx.nodes)} (root, trunk, the best, the recent, the open "
                               "and their parents)" if len(shown) < len(ctx.nodes) else f"all {len(ctx.nodes)}",
                **({} if full else {"shortened": "texts and lists are cut to fit the model's context; … marks a cut"}),
                "dropped_ideas": dropped,
                "recent_changes": [
                    {"id": number.get(x["id"]), "executor_report": cut(x["report"], d.text * 2),
                     "diff": cut(x["diff"], d.contents if d.contents is not None else 3000)}
                    for x in data["recent"]
                ] if d.text else [],
                "repository": _repo_view(ctx.repo_map, d),
                "improvement_state": state if full else {k: _items(v, d) for k, v in state.items()},
                "validated_findings": data["validated_findings"] if full else _items(data["validated_findings"], d),
                "pruned_lessons": _items(data["pruned_lessons"], d),
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
                lambda text: _children(text, ctx.trunk_dev_mean, space, needed),
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
            origin, ref = ("refine", c.parent_id) if c.parent_id in refine else ("policy", None)
            if origin == Origin.POLICY and c.parent_id == root and restarts:
                origin, ref = "restart", restarts.pop(0)
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
            view = shown if item is None else {k: _cut_all(v, item) for k, v in shown.items()}
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
            raise Unusable(_errors(exc)) from None

    return parse


def _errors(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'answer'}: {e['msg']}" for e in exc.errors()[:5])


def _children(
    text: str, trunk: float | None = None, space: Space | None = None, edits: bool = False
) -> list[Child]:
    """Return the valid children of an ideator's answer; each is checked on its own.

    A bare list of children, or one child alone, is read as the "children" list; `trunk` (trunk's dev
    mean) is what a percentage gain is a percentage of; `space` the settings edits may set (and that
    every child sets, with `edits`).
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
            got = Child.model_validate(item, context={"trunk": trunk, "space": space})
        except ValidationError as exc:
            wrong.append(f"child {i}: {_errors(exc)}")
            continue
        if edits and not got.edits:
            wrong.append(f"child {i}: edits: set at least one of the settings")
        else:
            out.append(got)
    if raw and not out:
        raise Unusable("no child is valid (" + "; ".join(wrong) + ")")
    return out
