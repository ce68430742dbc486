"""Alembic migrations on SQLite and PostgreSQL: they build the schema the models describe."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from sqlalchemy import create_engine, inspect

from backend.core.migrate import alembic_config, upgrade
from tests.support.services import drop_postgres_database, postgres_database


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


def insert_old_study(conn: Any, **given: Any) -> None:
    """Insert a study row as the schema of 0004 has it (every column that has no default)."""
    from sqlalchemy import text

    cols = ["name", "goal", "spec_toml", "source", "repo_path", "status", "base_commit", "trunk_branch",
            "trunk_commit", "seed", "base_values", "baseline_dev", "trunk_dev", "baseline_heldout",
            "trunk_heldout", "test_queries", "improvement_state", "plateau_level", "stop_reason",
            "report_path", "created_at"]  # fmt: skip
    values = {c: "" for c in cols} | {"seed": 0, "test_queries": 0, "plateau_level": 0,
                                       "created_at": "2026-11-01 00:00:00"}  # fmt: skip
    for c in ("base_values", "improvement_state"):
        values[c] = "{}"
    for c in ("baseline_dev", "trunk_dev", "baseline_heldout", "trunk_heldout"):
        values[c] = "[]"
    values |= given
    cols += [c for c in given if c not in cols]
    conn.execute(
        text(f"INSERT INTO study ({', '.join(cols)}) VALUES ({', '.join(':' + c for c in cols)})"), values
    )


def test_stored_review_specs_read_approve_after_upgrade(tmp_path: Path) -> None:
    """Gate mode 'review' only ever behaved as 'approve'; 0005 says so in stored specs."""
    from sqlalchemy import text

    from agents.spec import parse_spec
    from tests.support.repos import tiny_files

    url = f"sqlite:///{tmp_path / 'm.db'}"
    engine = create_engine(url)
    cfg = alembic_config(url)
    spec = tiny_files(mode="approve")["grove.toml"].replace('mode = "approve"', 'mode = "review"')
    assert 'mode = "review"' in spec
    try:
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "0004")
            insert_old_study(conn, name="old", spec_toml=spec)
            command.upgrade(cfg, "head")
            stored = conn.execute(text("SELECT spec_toml FROM study WHERE name = 'old'")).scalar_one()
        assert parse_spec(stored).gate.mode == "approve"
        assert stored.replace('mode = "approve"', 'mode = "review"') == spec  # nothing else changed
    finally:
        engine.dispose()


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_existing_nodes_are_numbered_within_their_study_and_new_ones_follow(
    backend: str, tmp_path: Path
) -> None:
    from sqlalchemy import event, text
    from sqlmodel import Session, select

    from backend.core.models import Node

    name = f"grove_num_{os.getpid()}"
    url = postgres_database(name) if backend == "postgres" else f"sqlite:///{tmp_path / 'm.db'}"
    engine = create_engine(url)
    if backend == "sqlite":  # as Grove's own engine has it: a table rebuild under `node` would fail

        @event.listens_for(engine, "connect")
        def _fk(dbapi_conn: Any, _: Any) -> None:
            dbapi_conn.execute("PRAGMA foreign_keys=ON")

    cfg = alembic_config(url)
    try:
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "0009")
            for sid in (1, 2):
                insert_old_study(conn, id=sid, name=f"s{sid}")
            # The two studies' nodes interleave, as they do when both run at once; children point at
            # their parents and a job at a node, so the migration must leave the table in place.
            for sid, parent in ((1, None), (2, None), (1, 1), (2, 2), (2, 4), (1, 3)):  # ids 1 to 6
                conn.execute(
                    text(
                        "INSERT INTO node (study_id, parent_id, depth, round_no, title, hypothesis, origin, status, "
                        'prior, edits, base_commit, branch, "commit", diff_stats, dev_values, dev_n, constraints, '
                        "verification, summary, attempts, reflection, failure, gate_commit, gated, "
                        "heldout_values, gate_reason, completed_order, cost, created_at, updated_at) VALUES "
                        "(:sid, :parent, 0, 0, '', '{}', 'policy', 'proposed', 0, '{}', '', '', '', '{}', '[]', 0, "
                        "'[]', '{}', '', 0, '', '', '', false, '[]', '', 0, '{}', '2026-11-01 00:00:00', "
                        "'2026-11-01 00:00:00')"
                    ),
                    {"sid": sid, "parent": parent},
                )
            conn.execute(  # the columns of 0009 (the model's table has more)
                text(
                    "INSERT INTO job (study_id, node_id, attempt, kind, status, token, extra_runs, outcome, "
                    "created_at) VALUES (2, 5, 1, 'experiment', 'queued', '', 0, '{}', '2026-11-01 00:00:00')"
                )
            )
            command.upgrade(cfg, "head")
        with Session(engine) as s:
            numbers = {n.id: (n.study_id, n.number) for n in s.exec(select(Node))}
            assert numbers == {1: (1, 1), 2: (2, 1), 3: (1, 2), 4: (2, 2), 5: (2, 3), 6: (1, 3)}
            added = Node(study_id=2, parent_id=5, title="next")
            s.add(added)
            s.commit()
            assert added.number == 4
        with engine.begin() as conn:  # and back, with the same rows in place
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0009")
            assert conn.execute(text("SELECT COUNT(*) FROM node")).scalar_one() == 7
    finally:
        engine.dispose()
        if backend == "postgres":
            drop_postgres_database(name)


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_gate_verdicts_and_failure_blame_are_read_off_old_sentences_once(
    backend: str, tmp_path: Path
) -> None:
    from sqlalchemy import text

    name = f"grove_verdicts_{os.getpid()}"
    url = postgres_database(name) if backend == "postgres" else f"sqlite:///{tmp_path / 'v.db'}"
    engine = create_engine(url)
    cfg = alembic_config(url)
    rows = [  # (gated, gate_reason, failure) -> (gate_passed, blame)
        (
            (True, "passed: held-out gain +0.02 (97.3% lower bound +0.004, n=3) > margin 0", ""),
            (True, "idea"),
        ),
        (
            (
                True,
                "failed: held-out gain -0.01 (95% lower bound \u22120.03, n=3) does not clear margin 0",
                "",
            ),
            (False, "idea"),
        ),
        ((False, "", "AnswerFormatError: 3 answers in a row held no action"), (False, "machinery")),
        ((False, "", "GitError: git worktree add failed"), (False, "machinery")),
        ((False, "", "BudgetExhausted: LLM budget spent: $0.04 of $0.04 charged"), (False, "usd")),
        ((False, "", "BudgetExhausted: LLM budget spent: 120 of 1000 tokens used"), (False, "tokens")),
        ((False, "", "dev evaluation seed 0: exit code 1 (GitError: nothing)"), (False, "idea")),
    ]
    try:
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "0019")
            insert_old_study(conn, id=1, name="s1")
            for number, ((gated, reason, failure), _) in enumerate(rows, 1):
                conn.execute(
                    text(
                        "INSERT INTO node (study_id, number, depth, round_no, title, hypothesis, origin, status, "
                        'prior, edits, base_commit, branch, "commit", diff_stats, dev_values, dev_n, constraints, '
                        "verification, summary, attempts, reflection, failure, gate_commit, gated, "
                        "heldout_values, gate_reason, completed_order, cost, created_at, updated_at) VALUES "
                        "(1, :number, 0, 0, '', '{}', 'policy', 'failed', 0, '{}', '', '', '', '{}', '[]', 0, '[]', '{}', "
                        "'', 1, '', :failure, '', :gated, '[]', :reason, 0, '{}', '2026-11-01 00:00:00', "
                        "'2026-11-01 00:00:00')"
                    ),
                    {"number": number, "failure": failure, "gated": gated, "reason": reason},
                )
            # Node 1 becomes the top of a pruned branch whose lesson a newer version restates; node 2 a
            # pruned node below it, whose insight says nothing of a lesson.
            conn.execute(text("UPDATE node SET status = 'pruned' WHERE id IN (1, 2)"))
            for node_id, version, said in ((1, 1, "x helps"), (1, 2, "PRUNED (no gain). Lesson: x hurts"),
                                           (2, 1, "PRUNED? no")):  # fmt: skip
                conn.execute(
                    text(
                        "INSERT INTO insightversion (study_id, node_id, version, text, cites, created_at) "
                        "VALUES (1, :node, :version, :said, '[]', '2026-11-01 00:00:00')"
                    ),
                    {"node": node_id, "version": version, "said": said},
                )
            command.upgrade(cfg, "head")
            got = conn.execute(text("SELECT gate_passed, blame FROM node ORDER BY id")).all()
            assert [(bool(p), b) for p, b in got] == [want for _, want in rows]
            bounds = conn.execute(text("SELECT heldout_lcb, heldout_level FROM node ORDER BY id")).all()
            assert [tuple(b) for b in bounds] == [(0.004, 0.973), (-0.03, 0.95)] + [(None, None)] * (
                len(rows) - 2
            )
            lessons = conn.execute(text("SELECT lesson FROM node ORDER BY id")).scalars().all()
            assert lessons == ["PRUNED (no gain). Lesson: x hurts"] + [""] * (len(rows) - 1)
            command.downgrade(cfg, "0019")
            assert conn.execute(text("SELECT COUNT(*) FROM node")).scalar_one() == len(rows)
    finally:
        engine.dispose()
        if backend == "postgres":
            drop_postgres_database(name)
