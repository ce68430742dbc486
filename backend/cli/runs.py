"""`grove run`: a whole study in this process, with its progress and approvals in the terminal."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from agents.spec import GateMode
from agents.tree.status import NodeStatus, StudyStatus
from backend.cli.app import (
    LOCAL_FILE_HELP,
    LOCAL_HELP,
    app,
    console,
    err,
    override,
    require_sandbox,
    source_of,
    spec_file,
)
from backend.cli.local import local_gguf, serve_local_model
from backend.core.states import JobKind

# Everything else is imported where it is used: `grove submit` and the other client commands start
# without the database, the engine or the graph (benchmarks/cli_start.py measures it).
if TYPE_CHECKING:
    from rich.table import Table


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
    from backend.cli.runner import run_study
    from backend.core import db, gitops
    from backend.core.config import get_settings
    from backend.core.models import Study
    from backend.engine.driver import thread_id
    from backend.services import lifecycle
    from backend.services.studies import StudyExists, create_study, get_by_name

    settings = get_settings()
    settings.ensure_dirs()
    require_sandbox(settings)
    gguf = local_gguf(settings, local_model, local_model_file)
    if gguf is not None:
        serve_local_model(settings, gguf)
    spec_path = spec_file(path)
    text = spec_path.read_text("utf-8")
    try:
        spec = parse_spec(text, str(spec_path))
    except SpecError as exc:
        for issue in exc.issues:
            err.print(f"[red]error:[/] {exc.source}: {issue}")
        raise typer.Exit(1) from None
    if budget is not None:
        text = override(text, "budget", "experiments", budget)
    if gguf is not None and not spec.capabilities.calls_model:
        text = override(text, "policy", "kind", "llm")  # a local model is there to think for the study
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
                study = create_study(
                    s, settings, text, source_of(repo, spec_path), spec_source=str(spec_path)
                )
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
