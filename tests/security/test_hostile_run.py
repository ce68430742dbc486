"""A hostile evaluator through the real `grove run`: every attack fails, nothing secret leaks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sqlmodel import select

from backend.core import db
from backend.core.config import PROJECT_ROOT, Settings
from backend.core.models import Event, Node, ReceiptRow, Study
from tests.security.hostile import attack_lines, expected, hostile_repo


def test_hostile_evaluator_under_grove_run(settings: Settings, tmp_path: Path) -> None:
    h = hostile_repo(tmp_path, "hostile-run", settings.data_dir, settings.worktrees_dir)
    env = {
        **os.environ,
        "GROVE_DATA_DIR": str(settings.data_dir),
        "GROVE_WORKTREES_DIR": str(settings.worktrees_dir),
        "OPENAI_API_KEY": h.key,
        "GROVE_TOKEN": h.token,
    }
    res = subprocess.run(
        [sys.executable, "-m", "backend.cli.main", "run", str(h.repo), "--auto-approve", "--quiet"],
        cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr

    with db.session(settings.db_url) as s:
        study = s.exec(select(Study)).one()
        receipts = list(s.exec(select(ReceiptRow)))
        events = list(s.exec(select(Event)))
        nodes = list(s.exec(select(Node)))
    assert study.status == "finished" and study.sandbox == "bwrap"
    assert any(n.status == "merged" and n.parent_id for n in nodes), "the study still works under attack"
    dev = [r for r in receipts if r.kind == "dev"]
    test = [r for r in receipts if r.kind == "test"]
    assert dev and test
    for r in receipts:
        out = (
            Path(r.stdout_path).read_text() + Path(r.stderr_path).read_text() + r.stdout_tail + r.stderr_tail
        )
        outcomes = attack_lines(out)
        assert set(outcomes) == expected(r.kind), (r.kind, outcomes, out[-2000:])
        assert all(v == "blocked" for v in outcomes.values()), outcomes
        assert "token" not in json.dumps(r.metrics or {}) and (r.metrics or {}).get("score") != 1e9
        for secret in h.secrets:
            assert secret not in out
        if r.kind == "dev":
            assert "777." not in out  # no held-out number in what a dev run printed
        assert "process(es) were still running" in r.stderr_tail  # the setsid orphan was reaped
    public = json.dumps([e.payload for e in events]) + json.dumps([n.model_dump(mode="json") for n in nodes])
    report = Path(study.report_path).read_text()
    for secret in h.secrets:
        assert secret not in public and secret not in report and secret not in res.stdout + res.stderr
    assert "777." not in json.dumps([e.payload for e in events])
    assert h.host_leftovers() == []
    assert "namespaces (bubblewrap)" in report
    assert all(700 < v < 800 for v in study.trunk_heldout + study.baseline_heldout)  # labels untouched
