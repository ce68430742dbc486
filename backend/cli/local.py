"""The local model a command may run the llm policy on: the packaged GGUF, served by llama.cpp on loopback."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.markup import escape

from backend.cli.app import (
    console,
    err,
)

# Everything else is imported where it is used: `grove submit` and the other client commands start
# without the database, the engine or the graph (benchmarks/cli_start.py measures it).
if TYPE_CHECKING:
    from backend.core.config import Settings


def local_gguf(settings: Settings, local_model: bool, local_model_file: Path | None) -> Path | None:
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


def serve_local_model(settings: Settings, gguf: Path) -> None:
    """Start llama.cpp's server on `gguf` for this process's roles; it stops when the process ends."""
    import atexit
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
