"""The commands that run the service: up, worker, migrate, janitor."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from backend.cli.app import (
    LOCAL_FILE_HELP,
    LOCAL_HELP,
    app,
    console,
    err,
    require_sandbox,
)
from backend.cli.local import local_gguf

# Everything else is imported where it is used: `grove submit` and the other client commands start
# without the database, the engine or the graph (benchmarks/cli_start.py measures it).
if TYPE_CHECKING:
    pass


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
    import signal
    import time

    from backend.cli.up import Stack, UpError
    from backend.core.config import get_settings
    from backend.core.security import create_token

    settings = get_settings()
    require_sandbox(settings)
    gguf = local_gguf(settings, local_model, local_model_file)
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
        require_sandbox(settings)
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


@app.command("migrate")
def migrate_cmd() -> None:
    """Bring the database (GROVE_DATABASE_URL, or SQLite in the data dir) to the newest schema."""
    from backend.core.config import get_settings
    from backend.core.db import get_engine

    settings = get_settings()
    get_engine(settings.db_url)
    console.print(f"database at the newest schema: {get_engine(settings.db_url).url.render_as_string()}")


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
