"""The `grove` command line: validate, run, pause, resume, stop, report, promote, serve, work.

Each group of commands lives in its own module and registers itself on the one Typer `app`
(`backend/cli/app.py`) when imported here. Everything else is imported where it is used: `grove
submit` and the other client commands start without the database, the engine or the graph
(benchmarks/cli_start.py measures it).
"""

from __future__ import annotations

from backend.cli import admin, drafts, runs, service, studies
from backend.cli.app import app

COMMANDS = (drafts, runs, studies, service, admin)  # imported for the commands they register on `app`
# The order `grove --help` lists them in (token and memory are groups, listed after the commands).
ORDER = ("init", "validate", "run", "report", "promote", "pause", "resume", "stop", "up", "worker", "submit",
         "learn", "migrate", "export-trajectories", "janitor")  # fmt: skip

app.registered_commands.sort(key=lambda c: ORDER.index(c.name) if c.name in ORDER else len(ORDER))
app.add_typer(admin.token_app, name="token")
app.add_typer(admin.memory_app, name="memory")

__all__ = ["COMMANDS", "app"]

if __name__ == "__main__":
    app()
