"""Without namespaces Grove refuses to run untrusted code; GROVE_SANDBOX=none is loud and recorded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from sqlmodel import select

from backend.core import db
from backend.core.config import PROJECT_ROOT, Settings
from backend.core.models import Event, Study
from tests.support.repos import make_repo, tiny_files


def grove(settings: Settings, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "GROVE_DATA_DIR": str(settings.data_dir), "GROVE_WORKTREES_DIR": str(settings.worktrees_dir),
            **env}  # fmt: skip
    return subprocess.run([sys.executable, "-m", "backend.cli.main", *args], cwd=PROJECT_ROOT, env=full,
                          capture_output=True, text=True, timeout=240)  # fmt: skip


def test_commands_refuse_a_machine_that_cannot_sandbox(settings: Settings, tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r", tiny_files(name="nobox", experiments=2))
    # A bubblewrap the kernel refuses, as in a container without user namespaces.
    refused = tmp_path / "bwrap"
    refused.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    refused.chmod(0o755)
    cases = [
        ("/nonexistent/bwrap", ("run", str(repo), "--auto-approve", "--quiet"), "is not installed"),
        (
            str(refused),
            ("run", str(repo), "--auto-approve", "--quiet"),
            "No permissions to create new namespace",
        ),
        (str(refused), ("worker", "--queues", "cpu"), "No permissions to create new namespace"),
        (str(refused), ("up", "--port", "1", "--no-dashboard"), "No permissions to create new namespace"),
    ]
    for bwrap, args, why in cases:
        res = grove(settings, *args, GROVE_SANDBOX_BWRAP=bwrap)
        assert res.returncode == 2, res.stdout + res.stderr
        assert "cannot sandbox untrusted code" in res.stderr and why in res.stderr
        assert "apt install bubblewrap" in res.stderr and "GROVE_SANDBOX=none" in res.stderr
    with db.session(settings.db_url) as s:
        assert s.exec(select(Study)).first() is None  # nothing was created


def test_unsandboxed_runs_are_warned_about_and_recorded(settings: Settings, tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r", tiny_files(name="trusted", experiments=2))
    res = grove(settings, "run", str(repo), "--auto-approve", "--quiet", GROVE_SANDBOX="none")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "WARNING: GROVE_SANDBOX=none" in res.stderr
    with db.session(settings.db_url) as s:
        study = s.exec(select(Study)).one()
        events = [e.type for e in s.exec(select(Event).where(Event.study_id == study.id))]
    assert study.sandbox == "none" and events.count("study.unsandboxed") == 1
    assert "**unsandboxed** (GROVE_SANDBOX=none)" in Path(study.report_path).read_text()
