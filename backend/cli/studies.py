"""The commands on a study that runs in the service: submit, pause, resume, stop, report, promote."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from agents.tree.status import StudyStatus
from backend.cli.app import (
    app,
    console,
    err,
    override,
    spec_file,
    study_named,
)

# Everything else is imported where it is used: `grove submit` and the other client commands start
# without the database, the engine or the graph (benchmarks/cli_start.py measures it).
if TYPE_CHECKING:
    from sqlmodel import Session


@app.command("report")
def report_cmd(name: str) -> None:
    """Print a study's REPORT.md."""
    from backend.core import db
    from backend.core.config import get_settings
    from backend.services import report

    settings = get_settings()
    st = study_named(name)
    with db.session(settings.db_url) as s:
        text = report.render(s, st.id or 0)
    console.print(text, markup=False)


@app.command("promote")
def promote_cmd(name: str) -> None:
    """Push a study's trunk to its origin repository as branch `grove/<study>`."""
    from backend.core import db, gitops
    from backend.core.config import get_settings
    from backend.services.studies import NotPromotable, promote

    st = study_named(name)
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
    sid = study_named(name).id or 0
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
    spec_path = spec_file(path)
    try:
        url, tok = connection(settings, api, token)
        repository = repo or str(git_repository(settings, spec_path.parent))
        client = Grove(url, tok, timeout=60)
        text = spec_path.read_text("utf-8")
        if name:
            text = override(text, "study", "name", name)
        if budget is not None:
            text = override(text, "budget", "experiments", budget)
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
