"""A worker's disk: past the high-water mark, environment builds no job uses go, least recently used first."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from backend.core.config import PROJECT_ROOT, Settings
from backend.engine import housekeeping
from tests.integration.test_environment import SETUP, WHEEL, build_wheel, run_to_end, study_files
from tests.support.repos import make_repo

HOLD = """
import fcntl, sys
fh = open(sys.argv[1], "a")
fcntl.flock(fh, fcntl.LOCK_SH)
print("held", flush=True)
sys.stdin.read()
"""


def build(settings: Settings, study: str, key: str, idle_s: float) -> Path:
    """Make an environment build as `environment.ensure` leaves it, last used `idle_s` ago."""
    root = settings.data_dir / "envs" / study / key
    (root / "env" / "bin").mkdir(parents=True)
    (root / "env" / "bin" / "python").write_text("#!/bin/sh\n")
    (root / "lock").touch()
    (root / "ready").touch()
    then = time.time() - idle_s
    os.utime(root / "ready", (then, then))
    return root


def used_by_another_process(root: Path) -> subprocess.Popen[str]:
    """Start a process that uses the build (its shared lock, as a running evaluation holds it)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(root / "lock")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_past_the_mark_unused_builds_go_oldest_first_and_a_build_in_use_stays(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data", worktrees_dir=tmp_path / "wt", disk_high_water=0.0)
    in_use = build(settings, "a", "k0", idle_s=400)  # the oldest, but a job is using it
    old, mid = build(settings, "a", "k1", idle_s=300), build(settings, "b", "k2", idle_s=200)
    new = build(settings, "b", "k3", idle_s=100)
    user = used_by_another_process(in_use)
    try:
        assert housekeeping.make_room(settings) == [old, mid, new]
        assert (in_use / "ready").exists() and (in_use / "env" / "bin" / "python").exists()
        assert not (settings.data_dir / "envs" / "b").exists(), "a study's folder with no build left goes too"
    finally:
        assert user.stdin is not None
        user.stdin.close()
        user.wait(timeout=30)
    assert housekeeping.make_room(settings) == [in_use], "once its job has ended, it may go"


def test_below_the_mark_nothing_goes(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data", worktrees_dir=tmp_path / "wt", disk_high_water=1.0)
    builds = [build(settings, "a", f"k{i}", idle_s=100 * i) for i in range(3)]
    assert housekeeping.make_room(settings) == []
    assert all((b / "ready").exists() for b in builds)
    assert housekeeping.builds(settings) == builds[::-1], "least recently used first"


def test_a_finished_study_leaves_its_build_free_and_grove_janitor_removes_it_past_the_mark(
    settings: Settings, tmp_path: Path
) -> None:
    build_wheel(tmp_path / "r" / WHEEL)
    status, _ = run_to_end(settings, make_repo(tmp_path / "r", study_files(SETUP)))
    assert status == "finished"
    (built,) = housekeeping.builds(settings)
    env = {
        **os.environ,
        "GROVE_DATA_DIR": str(settings.data_dir),
        "GROVE_WORKTREES_DIR": str(settings.worktrees_dir),
    }
    env.pop("GROVE_WORKER_TOKEN", None)
    cli = [sys.executable, "-m", "backend.cli.main", "janitor"]
    kept = subprocess.run(cli, env=env, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert kept.returncode == 0, kept.stderr
    assert (built / "ready").exists(), "below the default mark (90%) a build stays"
    # The jobs that used it have ended, so nothing holds it: past the mark it goes.
    gone = subprocess.run(
        [*cli, "--high-water", "0"], env=env, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120
    )
    assert gone.returncode == 0, gone.stderr
    assert "removed 1 environment builds" in gone.stdout and not built.exists()
    # As a remote worker it needs the worker's token: a clear error, nothing removed.
    refused = subprocess.run(
        [*cli, "--worker"], env=env, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120
    )
    assert refused.returncode == 2 and "GROVE_WORKER_TOKEN" in refused.stderr


def test_grove_janitor_removes_builds_unused_for_the_idle_days_but_not_one_in_use(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data", worktrees_dir=tmp_path / "wt")
    day = 86400.0
    stale, in_use = build(settings, "a", "k0", idle_s=40 * day), build(settings, "a", "k1", idle_s=45 * day)
    fresh = build(settings, "b", "k2", idle_s=2 * day)
    env = {
        **os.environ,
        "GROVE_DATA_DIR": str(settings.data_dir),
        "GROVE_WORKTREES_DIR": str(settings.worktrees_dir),
        "GROVE_DISK_HIGH_WATER": "1.0",  # no room to make: only the idle rule removes anything
    }
    env.pop("GROVE_WORKER_TOKEN", None)
    user = used_by_another_process(in_use)
    try:
        cli = [sys.executable, "-m", "backend.cli.main", "janitor"]
        done = subprocess.run(cli, env=env, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert "removed 1 environment builds unused for 30 days" in done.stdout
        assert not stale.exists() and (in_use / "ready").exists() and (fresh / "ready").exists()
        shorter = subprocess.run(
            [*cli, "--env-days", "1"], env=env, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120
        )
        assert shorter.returncode == 0, shorter.stderr
        assert not fresh.exists() and not (settings.data_dir / "envs" / "b").exists()
        assert (in_use / "ready").exists()
    finally:
        assert user.stdin is not None
        user.stdin.close()
        user.wait(timeout=30)
