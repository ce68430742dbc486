"""From a goal in words and a repository to a drafted grove.toml, each choice explained.

Grove's own analysis (`agents.intake`) drafts first. When the service has a model (`GROVE_MODEL`),
the model reads the repository's map (paths and sizes), its evaluator, configs and README (never
the files the draft seals) with the goal, and may change the metric, the commands, what is
sealed and the search space; each change it makes is checked against the repository and kept
only if it holds, and the notes say what it changed and why.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from agents import configfiles, globs, intake
from agents.policies.llm.answers import json_object
from agents.spec import Level, SpecError, parse_spec
from agents.speccheck import check_against_tree
from backend.core import gitops

PROMPT_BYTES = 24_000


@dataclass
class Drafted:
    spec: str
    notes: list[str]
    model: str | None
    files: dict[str, str]  # files the draft needs beside grove.toml (the evaluator adapter, data splits)


def read_repository(source: str) -> tuple[str, dict[str, str]]:
    """Return a local repository's (or plain folder's) name and text files.

    A URL is refused: cloning belongs to the workers, not to a request (`POST /studies` clones).
    """
    from backend.services.studies import repository_files

    if gitops.is_url(source):
        raise FileNotFoundError(
            f"{source!r} is a URL; a draft reads a repository on this server's disk: clone it under "
            "GROVE_REPO_ROOTS and draft from that path, or start from a template (creating the study clones it)"
        )
    path = Path(source).expanduser().resolve()
    if not path.is_dir():
        raise FileNotFoundError(f"{source!r} does not exist or is not a directory")
    return path.name, repository_files(path)


def draft_study(name: str, files: dict[str, str], goal: str, use_model: bool = True) -> Drafted:
    """Draft a spec for a repository's files and a goal; refine it with the service's model if any."""
    choices = intake.draft(files, name, goal)
    model = os.environ.get("GROVE_MODEL") if use_model else None
    if model:
        choices = _with_model(model, choices, files, goal)
    elif use_model:
        choices.notes.insert(
            0, "model: none is configured on this service (GROVE_MODEL); Grove's own analysis"
        )
    else:
        choices.notes.insert(0, "model: not asked; this draft is Grove's own analysis")
    if choices.writes:
        choices.notes.append(
            f"files: this draft needs {', '.join(sorted(choices.writes))} in the repository; `grove init "
            f"PATH --commit` on the server writes and commits them, or save them from here and commit them"
        )
    return Drafted(intake.render(choices), choices.notes, model, dict(choices.writes))


def _repository_map(choices: intake.Choices, files: dict[str, str]) -> dict[str, Any]:
    """Return what the model may read: every path with its size, and the text of the evaluator,
    the README and the config files only; never a sealed file or one that looks held out."""
    hidden = [p for p in files if globs.match_any(choices.sealed, p) or intake.looks_held_out(p)]
    readable = [p for p in files if p not in hidden]
    configs = [p for p in readable if p.endswith((".toml", ".yaml", ".yml")) and not p.startswith("data/")]
    first = [
        p
        for p in readable
        if p in choices.protected or p in choices.editable or p.lower().startswith("readme")
    ]
    shown: dict[str, str] = {}
    budget = PROMPT_BYTES
    for path in first + configs:
        if path in shown or budget <= 0 or path.startswith("data/"):
            continue
        shown[path] = files[path][: min(6000, budget)]
        budget -= len(shown[path])
    return {
        "files": [{"path": p, "bytes": len(files[p])} for p in sorted(files)][:400],
        "contents": shown,
    }


def _with_model(model: str, c: intake.Choices, files: dict[str, str], goal: str) -> intake.Choices:
    from agents.llm.model import LitellmModel, ModelConfig, ModelError, Unbilled
    from agents.policies.registry import server_endpoint

    base, key = server_endpoint(model)
    llm = LitellmModel(ModelConfig(model=model, api_base=base, api_key=key, retries=1), Unbilled())
    current = {
        "metric": c.metric, "direction": c.direction, "dev": c.dev, "test": c.test,
        "sealed": c.sealed, "search": c.search,
    }  # fmt: skip
    messages = [
        {
            "role": "system",
            "content": "ROLE: intake\nYou turn a research goal and a repository into a Grove study contract. "
            "Grove tunes the repository toward the goal: `dev` scores each change (it prints a JSON line "
            "holding the metric), `test` scores the sealed held-out split, `sealed` globs hide held-out data "
            "from every change, `search` maps 'FILE:dotted.key' of config files to a range "
            '{"low", "high", "log"} or {"values": [...]}. Answer with one JSON object with any of the keys '
            "metric, direction (maximize|minimize), dev, test, sealed, search, and notes: a list of one-line "
            "reasons, one per choice you made.",
        },
        {
            "role": "user",
            "content": json.dumps(
                {"goal": goal, "repository": _repository_map(c, files), "grove_draft": current},
                ensure_ascii=False,
            ),
        },
    ]
    try:
        turn = llm.complete("intake", messages)
    except ModelError as exc:
        c.notes.append(f"model {model}: no answer ({str(exc)[:200]}); the draft is Grove's own analysis")
        return c
    answer = json_object(turn.content)
    if answer is None:
        c.notes.append(f"model {model}: its answer held no JSON object; the draft is Grove's own analysis")
        return c
    return _merge(model, c, answer, files)


def _merge(model: str, c: intake.Choices, answer: dict[str, Any], files: dict[str, str]) -> intake.Choices:
    """Apply each of the model's choices that holds against the repository; note what changed."""
    out = replace(c, notes=list(c.notes), search=dict(c.search), sealed=list(c.sealed))
    raw_notes = answer.get("notes", [])
    said = [
        str(n)[:300]
        for n in (raw_notes if isinstance(raw_notes, list) else [raw_notes])
        if isinstance(n, str)
    ]
    said = said[:12]
    for field_name in ("metric", "dev", "test"):
        value = answer.get(field_name)
        if isinstance(value, str) and value.strip() and value != getattr(out, field_name):
            setattr(out, field_name, value.strip()[:500])
            out.notes.append(f"model {model}: {field_name} = {value.strip()[:200]!r}")
    if answer.get("direction") in ("maximize", "minimize") and answer["direction"] != out.direction:
        out.direction = answer["direction"]
        out.notes.append(f"model {model}: direction = {out.direction!r}")
    sealed = answer.get("sealed")
    if isinstance(sealed, list) and all(isinstance(s, str) for s in sealed):
        # The model may seal more, never less: what Grove's analysis sealed stays sealed.
        more = [s for s in sealed if s not in out.sealed and globs.select([s], list(files))]
        if more:
            out.sealed += more
            out.notes.append(f"model {model}: also sealed {more}")
    search = answer.get("search")
    if isinstance(search, dict):
        for key, dim in list(search.items())[:12]:
            if not isinstance(key, str) or not isinstance(dim, dict):
                continue
            if ":" not in key or "targets" in dim or key.rpartition(":")[0] not in files:
                out.notes.append(
                    f"model {model}: search {intake.one_line(key)[:120]} left out (not FILE:key of a file here)"
                )
                continue
            trial = replace(out, search={key: dim}, editable=sorted({*out.editable, key.rpartition(":")[0]}))
            problem = _problem(trial, files, key)
            if problem:
                out.notes.append(f"model {model}: search {key} left out ({problem})")
                continue
            out.search[key] = dim
            file = key.rpartition(":")[0]
            if file not in out.editable:
                out.editable.append(file)
            if "." not in Path(file).name:
                out.formats.setdefault(file, configfiles.file_format(file, files[file]))  # parsed by _problem
    out.notes += [f"model {model}: {n}" for n in said]
    return out


def _problem(c: intake.Choices, files: dict[str, str], key: str) -> str:
    """Return why a drafted search key does not hold against the files, or ''."""
    try:
        spec = parse_spec(intake.render(c))
    except SpecError as exc:
        return "; ".join(str(i) for i in exc.issues)[:300]
    issues = [
        i
        for i in check_against_tree(spec, list(files), files.__getitem__)
        if i.level == Level.ERROR and key in i.key
    ]
    return "; ".join(i.message for i in issues)[:300]
