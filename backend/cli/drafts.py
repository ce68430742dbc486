"""`grove init` and `grove validate`: draft a spec for a repository, and check one before a study runs."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from backend.cli.app import (
    app,
    console,
    err,
    require_sandbox,
    source_of,
    spec_file,
)

# Everything else is imported where it is used: `grove submit` and the other client commands start
# without the database, the engine or the graph (benchmarks/cli_start.py measures it).
if TYPE_CHECKING:
    from agents.spec import Spec, SpecIssue
    from backend.core import gitops
    from backend.core.config import Settings
    from backend.engine import evaluation


@app.command("init")
def init_cmd(
    path: Annotated[Path, typer.Argument(help="the repository (or plain folder) to study")] = Path("."),
    goal: Annotated[str, typer.Option(help="what should improve, in words")] = "",
    force: Annotated[bool, typer.Option("--force", help="overwrite an existing grove.toml")] = False,
    stdout: Annotated[bool, typer.Option("--stdout", help="print the draft instead of writing it")] = False,
    commit: Annotated[
        bool, typer.Option("--commit", help="commit the adapter files it writes (not grove.toml)")
    ] = False,
    check: Annotated[
        bool,
        typer.Option(
            help="run the draft as `grove validate` does (dev once, each knob moved) and drop no-op knobs"
        ),
    ] = True,
    probe_seconds: Annotated[float, typer.Option(help="time the knob probes may take in all")] = 300.0,
) -> None:
    """Look at a repository and write a commented grove.toml, explaining each choice, then check it."""
    from agents import intake
    from backend.services.studies import repository_files

    root = path.expanduser().resolve()
    if not root.is_dir():
        err.print(f"[red]error:[/] {path}: not a folder")
        raise typer.Exit(2)
    choices = intake.draft(repository_files(root), root.name, goal)
    text = intake.render(choices)
    if stdout:
        sys.stdout.write(text)
        return
    dest = root / "grove.toml"
    if dest.is_symlink():
        err.print(
            f"[red]error:[/] {dest} is a symbolic link; Grove writes only a plain file (--stdout prints it)"
        )
        raise typer.Exit(1)
    if dest.exists() and not force:
        err.print(f"[red]error:[/] {dest} exists; pass --force to overwrite it, or --stdout to see the draft")
        raise typer.Exit(1)
    clash = [p for p in choices.writes if (root / p).exists() or (root / p).is_symlink()]
    if clash and not force:
        err.print(f"[red]error:[/] {', '.join(clash)} exist; pass --force to overwrite them")
        raise typer.Exit(1)
    for rel, body in {**choices.writes, "grove.toml": text}.items():
        _write_plain(root, rel, body, force)
    console.print(f"wrote {dest}; what was chosen and why:")
    for note in choices.notes:
        console.print(f"  - {escape(intake.one_line(note))}")
    if choices.writes:
        added = sorted({p.split("/")[0] for p in choices.writes})
        console.print(
            f"also wrote {', '.join(added)}: the evaluator adapter, its settings and the data split"
        )
        if commit:
            from backend.core import gitops

            # The repository's own git config (filters, hooks, signing) runs nothing here.
            gitops.commit_foreign(root, sorted(choices.writes), "Grove: evaluator adapter and data split")
            console.print("committed them (`git show --stat HEAD` lists them)")
        else:
            console.print(
                f"commit them so studies see them: git add {' '.join(added)} && git commit -m 'Grove adapter' "
                "(or run init with --commit)"
            )
    if not check:
        console.print(
            f"next: edit it, then `grove validate {path}` (it runs dev once), then `grove run {path}`"
        )
        return
    if choices.writes and not commit:
        console.print(f"then `grove validate {path}` runs the draft once; then `grove run {path}`")
        return
    if not (root / ".git").exists():
        console.print(
            f"{root} is not a git repository: `git init` and commit it, then `grove validate {path}`"
        )
        return
    console.print("checking the draft as `grove validate` does:")
    try:
        checked = _validated(dest, None, False, probe_seconds)
    except typer.Exit:
        err.print(f"the draft did not pass its check (above): edit {dest}, then run `grove validate {path}`")
        raise
    gone = intake.drop(choices, checked.noop)
    if gone:
        _write_plain(root, "grove.toml", intake.render(choices), True)
        console.print(f"dropped from the search in {dest}: {', '.join(gone)}")
    r = checked.base
    took = f"; a dev run takes {r.duration:.1f}s" if r is not None else ""
    console.print(f"next: edit it if you like, then `grove run {path}`{took}")


def _write_plain(root: Path, rel: str, body: str, force: bool) -> None:
    """Write a file under `root` without following a symbolic link anywhere on its path."""
    dest = root / rel
    for parent in reversed(dest.relative_to(root).parents):
        if (root / parent).is_symlink():
            err.print(f"[red]error:[/] {root / parent} is a symbolic link; Grove writes only plain files")
            raise typer.Exit(1)
    dest.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_TRUNC if force else os.O_EXCL)
    with os.fdopen(os.open(dest, flags, 0o644), "w", encoding="utf-8") as fh:
        fh.write(body)


@app.command("validate")
def validate_cmd(
    path: Annotated[Path, typer.Argument(help="grove.toml, or a folder holding one")],
    repo: Annotated[
        str | None, typer.Option(help="repository (path or URL); default: the spec's folder")
    ] = None,
    static: Annotated[
        bool, typer.Option("--static", help="check only; do not build the environment or run dev on base")
    ] = False,
    probe: Annotated[
        bool, typer.Option(help="move each [search] knob once and report those that change no metric")
    ] = True,
    probe_seconds: Annotated[float, typer.Option(help="time the knob probes may take in all")] = 300.0,
) -> None:
    """Check a spec against its repository, then run its dev command once on base; exit 1 on errors."""
    spec_path = spec_file(path)
    _validated(spec_path, repo, static, probe_seconds if probe else 0.0)


@dataclass
class _Checked:
    """What `grove validate` saw: the dev run on base, and the knobs that moved nothing."""

    base: evaluation.Receipt | None = None
    noop: dict[str, str] = field(default_factory=dict)  # key -> what was tried


def _validated(spec_path: Path, repo: str | None, static: bool, probe_seconds: float) -> _Checked:
    from agents.spec import SpecError
    from backend.core import gitops
    from backend.core.config import get_settings
    from backend.engine.environment import SetupFailed
    from backend.services.studies import validate

    settings = get_settings()
    warnings: list[SpecIssue] = []
    seen: list[_Checked] = []

    def trial(spec: Spec, clone: gitops.Repo, base: str) -> None:
        for w in warnings:
            err.print(f"[yellow]warning:[/] {spec_path}: {w}")
        warnings.clear()
        console.print(
            f"static checks ok; running `{spec.evaluate.dev}` once on {spec.study.base} ({base[:10]})"
        )
        settings.ensure_dirs()
        require_sandbox(settings)
        seen.append(_trial(settings, spec, clone, base, probe_seconds, source_of(repo, spec_path)))

    try:
        spec = validate(
            spec_path.read_text("utf-8"), source_of(repo, spec_path), str(spec_path), warnings,
            trial=None if static else trial, settings=settings,
        )  # fmt: skip
    except SpecError as exc:
        for issue in exc.issues:
            err.print(f"[red]error:[/] {exc.source}: {issue}")
        raise typer.Exit(1) from None
    except (FileNotFoundError, gitops.GitError) as exc:
        err.print(f"[red]error:[/] repository: {exc}")
        raise typer.Exit(1) from None
    except SetupFailed as exc:
        err.print(f"[red]error:[/] {spec_path}: [environment] {exc}")
        raise typer.Exit(1) from None
    for w in warnings:
        err.print(f"[yellow]warning:[/] {spec_path}: {w}")
    checked = seen[0] if seen else _Checked()
    r = checked.base
    if r is not None and not r.ok:
        err.print(f"[red]error:[/] evaluate.dev on base: {r.reason} after {r.duration:.1f}s")
        tail = (r.stderr_tail or r.stdout_tail).strip()
        if tail:
            err.print(escape(tail[-1500:]))
        raise typer.Exit(1)
    if r is not None:
        value = (r.metrics or {}).get(spec.objective.metric)
        console.print(
            f"dev on base: {spec.objective.metric} = {value} in {r.duration:.1f}s "
            f"(metrics: {', '.join(sorted(r.metrics or {}))})"
        )
    for key, tried in checked.noop.items():
        err.print(
            f"[yellow]warning:[/] {spec_path}: search.{key}: {tried} changed no metric: the evaluator "
            "does not seem to read it, so every experiment editing it would be a no-op"
        )
    console.print(f"[green]ok[/] {spec_path}: study {spec.study.name!r}, policy {spec.policy_kind}")
    return checked


def _until_refused(runs: Iterator[evaluation.Receipt]) -> Iterator[evaluation.Receipt]:
    """Yield the trial runs until one is refused (a knob file that is a link), saying so."""
    try:
        yield from runs
    except ValueError as exc:
        err.print(f"[yellow]warning:[/] knob probes stopped: {escape(str(exc))}")


def _trial(
    settings: Settings, spec: Spec, clone: gitops.Repo, base: str, probe_seconds: float, source: str
) -> _Checked:
    """Run dev once on base, then each searched knob moved far, within `probe_seconds`."""
    import time

    from agents import knobs
    from backend.core import gitops
    from backend.engine.trial import trial_runs

    def read(file: str) -> str:
        try:
            if clone.resolve_at(base, file) != file:
                raise ValueError(f"{file} is a link")
            return clone.read_at(base, file)
        except gitops.GitError as exc:
            raise FileNotFoundError(file) from exc

    probes = knobs.probes(spec, read) if probe_seconds > 0 else []
    variants: list[dict[str, str]] = [{}]
    slots: list[tuple[int, int]] = []
    for p in probes:
        pair = []
        for texts in (p.reference, p.texts):
            if texts not in variants:
                variants.append(texts)
            pair.append(variants.index(texts))
        slots.append((pair[0], pair[1]))
    checked = _Checked()
    receipts: list[evaluation.Receipt] = []
    started = time.monotonic()
    with contextlib.closing(trial_runs(settings, spec, clone, base, variants, source)) as runs:
        for receipt in _until_refused(runs):
            receipts.append(receipt)
            if len(receipts) == 1:
                checked.base = receipt
                started = time.monotonic()
                if not receipt.ok or not probes:
                    break
                console.print(f"moving each of {len(probes)} searched knobs once to see that it matters")
            elif time.monotonic() - started > probe_seconds:
                break
    unprobed = []
    for p, (ref, moved) in zip(probes, slots, strict=True):
        if moved >= len(receipts) or ref >= len(receipts):
            unprobed.append(p.key)
            continue
        tried = f"{p.before!r} → {p.after!r}"
        after = receipts[moved]
        if not knobs.moved(receipts[ref].metrics, after.metrics):
            checked.noop[p.key] = tried
        elif not after.ok:
            console.print(f"  {p.key}: {tried}: the run failed ({after.reason})")
        else:
            metric = spec.objective.metric
            was = (receipts[ref].metrics or {}).get(metric)
            console.print(f"  {p.key}: {tried}: {metric} {was} → {(after.metrics or {}).get(metric)}")
    if unprobed:
        console.print(f"  not probed within {probe_seconds:g}s: {', '.join(unprobed)}")
    return checked
