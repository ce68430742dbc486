"""What the ideator is shown and how its answer becomes children: node views, revisits, priors, and the checks of proposed children."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field, ValidationError, ValidationInfo, field_validator

from agents.policies.base import (
    IdeationInput,
    NodeEvidence,
    Proposal,
)
from agents.policies.llm import schemas
from agents.policies.llm.answers import (
    json_list,
    json_object,
    node_number,
    number,
)
from agents.policies.llm.fitting import cut
from agents.policies.space import Space, fmt
from agents.tree.status import NodeStatus, Origin

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
        return [
            Proposal(trunk.id, title, hyp, max(old.gain or 0.0, 0.0), dict(old.edits), Origin.REVISIT, nid)
        ]
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


def cut_all(value: Any, chars: int) -> Any:
    """Return a value with every string in it cut to `chars` characters."""
    if isinstance(value, str):
        return cut(value, chars)
    if isinstance(value, list):
        return [cut_all(v, chars) for v in value]
    if isinstance(value, dict):
        return {k: cut_all(v, chars) for k, v in value.items()}
    return value


def items_of(values: Any, d: Detail) -> list[Any]:
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


def repo_view(repo: dict[str, Any], d: Detail) -> dict[str, Any]:
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


def node_view(
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


def choices_of(space: Space, on_trunk: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Return each setting as the ideator sees it: trunk's value and the values it may take."""
    out: dict[str, dict[str, Any]] = {}
    for key in space.keys:
        bounds = dict(zip(("low", "high"), space.bounds(key), strict=True)) if space.is_range(key) else {}
        out[key] = {"trunk": on_trunk.get(key), "values": schemas.offered(space, key), **bounds}
    return out


class Assigned:
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


def parent_lines(parent: dict[str, Any]) -> list[str]:
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


def errors_of(exc: ValidationError) -> str:
    """Return what was wrong with a structured answer, field by field (the first five)."""
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'answer'}: {e['msg']}" for e in exc.errors()[:5])


def children_of(
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
            wrong.append(f"child {i}: {errors_of(exc)}")
            continue
        if edits and not got.edits:
            wrong.append(f"child {i}: edits: set at least one of the settings")
        else:
            out.append(got)
    if raw and not out:
        raise Unusable("no child is valid (" + "; ".join(wrong) + ")")
    return out
