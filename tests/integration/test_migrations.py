"""Alembic migrations on SQLite and PostgreSQL: they build the schema the models describe."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from alembic import command
from sqlalchemy import create_engine, inspect

from backend.core.migrate import alembic_config, upgrade
from tests.conftest import drop_postgres_database, postgres_database


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_upgrade_from_empty_matches_the_models_and_round_trips(backend: str, tmp_path: Path) -> None:
    name = f"grove_mig_{os.getpid()}"
    url = postgres_database(name) if backend == "postgres" else f"sqlite:///{tmp_path / 'm.db'}"
    engine = create_engine(url)
    try:
        upgrade(engine)
        tables = set(inspect(engine).get_table_names())
        assert {
            "study",
            "node",
            "job",
            "receipt",
            "event",
            "approval",
            "insightversion",
            "api_token",
        } <= tables
        assert "alembic_version" in tables
        with engine.begin() as conn:
            cfg = alembic_config(url)
            cfg.attributes["connection"] = conn
            command.check(cfg)  # raises if the models and the migrations disagree
            command.downgrade(cfg, "base")
        assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
        upgrade(engine)
        upgrade(engine)  # idempotent
        assert "study" in inspect(engine).get_table_names()
    finally:
        engine.dispose()
        if backend == "postgres":
            drop_postgres_database(name)
