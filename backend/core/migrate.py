"""Database migrations with Alembic (`grove migrate`; run automatically by embedded deployments)."""

from __future__ import annotations

import fcntl
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import text
from sqlalchemy.engine import Engine

MIGRATIONS = Path(__file__).resolve().parent / "migrations"


def alembic_config(url: str) -> Config:
    """Return an Alembic config for a database URL."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(engine: Engine) -> None:
    """Bring a database to the newest schema; concurrent callers wait for each other."""
    url = engine.url.render_as_string(hide_password=False)
    cfg = alembic_config(url)
    if engine.dialect.name == "sqlite":
        lock = Path(str(engine.url.database) + ".migrate.lock")
        lock.parent.mkdir(parents=True, exist_ok=True)
        with open(lock, "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            with engine.begin() as conn:
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, "head")
        return
    with engine.begin() as conn:
        conn.execute(text("SELECT pg_advisory_xact_lock(7413)"))
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
