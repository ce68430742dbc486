"""Learning jobs, API tokens, exported trajectories and lab memory."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from backend.cli.app import (
    app,
    console,
    err,
    study_named,
)
from backend.core.states import JobStatus

# Everything else is imported where it is used: `grove submit` and the other client commands start
# without the database, the engine or the graph (benchmarks/cli_start.py measures it).
if TYPE_CHECKING:
    from sqlmodel import Session


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


@app.command("export-trajectories")
def export_trajectories_cmd(
    name: str,
    out: Annotated[Path | None, typer.Option(help="JSONL file to write (default: standard output)")] = None,
) -> None:
    """Export a study's executor trajectories as JSONL (prompt, rollout, feedback) for distillation."""
    import json

    from backend.core.config import get_settings
    from backend.services.trajectories import export_records

    st = study_named(name)
    lines = [json.dumps(r, default=str) for r in export_records(get_settings(), st.id or 0)]
    text = "\n".join(lines) + ("\n" if lines else "")
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text, "utf-8")
        console.print(f"wrote {len(lines)} trajectories to {out}")


memory_app = typer.Typer(help="Lab memory: what finished studies left for later ones.", no_args_is_help=True)


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
