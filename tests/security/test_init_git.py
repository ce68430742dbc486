"""`grove init` on a repository handed over with its `.git`: its git config runs nothing, its split holds."""

from __future__ import annotations

import os
import subprocess
import tomllib
from pathlib import Path

from backend.core.config import Settings
from tests.integration.test_init_adapter import SCRIPT
from tests.integration.test_study import grove
from tests.support.repos import make_repo, tiny_files


def test_init_commit_runs_no_filter_signing_program_or_hook_of_the_repository(
    settings: Settings, tmp_path: Path
) -> None:
    repo = make_repo(tmp_path / "hostile", {**SCRIPT, ".gitattributes": "* filter=evil\n"})
    marks = tmp_path / "marks"
    marks.mkdir()
    program = tmp_path / "evil.sh"
    program.write_text(
        f'#!/bin/sh\necho "$0 $* $(ps -o args= -p $(ps -o ppid= -p $PPID))" >> {marks}/ran\ncat\n'
    )
    program.chmod(0o755)
    with open(repo / ".git" / "config", "a") as cfg:
        cfg.write(
            f'[filter "evil"]\n\tclean = {program} clean\n\tsmudge = {program} smudge\n\trequired = true\n'
            f"[commit]\n\tgpgSign = true\n[gpg]\n\tprogram = {program}\n[user]\n\tsigningKey = ABC\n"
            f"[core]\n\tfsmonitor = {program}\n"
        )
    # Something the user staged themselves stays staged and out of Grove's commit.
    (repo / "notes.txt").write_text("mine\n")
    subprocess.run(["git", "-c", "core.fsmonitor=false", "-c", "filter.evil.clean=cat", "add", "notes.txt"],
                   cwd=repo, check=True, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})  # fmt: skip
    before = subprocess.run(["git", "-c", "core.fsmonitor=false", "rev-parse", "HEAD"], cwd=repo,
                            capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip

    hooks = repo / ".git" / "hooks"
    for hook in ("pre-commit", "commit-msg", "post-commit", "reference-transaction", "post-index-change"):
        (hooks / hook).write_text(f"#!/bin/sh\necho {hook} >> {marks}/ran\n")
        (hooks / hook).chmod(0o755)

    made = grove(settings, "init", str(repo), "--commit", "--no-check")
    assert made.returncode == 0, made.stderr + made.stdout
    assert not (marks / "ran").exists(), (marks / "ran").read_text()

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-c", "core.fsmonitor=false", "-c", "core.hooksPath=/dev/null", "-c", "filter.evil.clean=cat",
                               "-c", "filter.evil.smudge=cat", *args], cwd=repo, capture_output=True, text=True)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert git("rev-parse", "HEAD^").strip() == before
    committed = git("show", "--name-only", "--format=", "HEAD").split()
    assert "grove_eval.py" in committed and "notes.txt" not in committed
    # As on disk, byte for byte (no clean filter touched it), and unsigned.
    assert git("show", "HEAD:grove_eval.py") == (repo / "grove_eval.py").read_text()
    assert "gpgsig" not in git("cat-file", "commit", "HEAD")
    assert "A  notes.txt" in git("status", "--porcelain")
    assert not (marks / "ran").exists(), (marks / "ran").read_text()


def test_a_second_init_keeps_the_split_and_never_seals_the_dev_rows(
    settings: Settings, tmp_path: Path
) -> None:
    repo = make_repo(tmp_path / "twice", SCRIPT)
    first = grove(settings, "init", str(repo), "--commit", "--no-check")
    assert first.returncode == 0, first.stderr + first.stdout
    spec = tomllib.loads((repo / "grove.toml").read_text())
    split = {
        p: (repo / p).read_text() for p in ("grove/dev/data/points.csv", "grove/heldout/data/points.csv")
    }
    # The data grows meanwhile: a fresh split would move held-out rows into dev.
    with open(repo / "data" / "points.csv", "a") as fh:
        fh.write("9.9,7\n")
    subprocess.run(["git", "commit", "-qam", "more rows"], cwd=repo, check=True,
                   env={**os.environ, "GIT_AUTHOR_NAME": "a", "GIT_AUTHOR_EMAIL": "a@a", "GIT_COMMITTER_NAME": "a",
                        "GIT_COMMITTER_EMAIL": "a@a"})  # fmt: skip
    second = grove(settings, "init", str(repo), "--commit", "--no-check", "--force")
    assert second.returncode == 0, second.stderr + second.stdout
    again = tomllib.loads((repo / "grove.toml").read_text())
    assert again["files"]["sealed"] == spec["files"]["sealed"] == ["data/points.csv", "grove/heldout/**"]
    assert {p: (repo / p).read_text() for p in split} == split
    assert "kept the split" in " ".join(second.stdout.split())
    # The second init found its files committed as they are: no new commit.
    log = subprocess.run(
        ["git", "log", "--format=%s"], cwd=repo, capture_output=True, text=True
    ).stdout.split("\n")
    assert log[:2] == ["more rows", "Grove: evaluator adapter and data split"]


def test_promote_to_a_local_origin_runs_none_of_its_hooks(settings: Settings, tmp_path: Path) -> None:
    from backend.core import db
    from backend.services.studies import create_study, promote

    origin = make_repo(tmp_path / "origin", tiny_files(name="hooked"))
    marks = tmp_path / "ran"
    for hook in ("pre-receive", "update", "post-receive", "post-update", "reference-transaction"):
        path = origin / ".git" / "hooks" / hook
        path.write_text(f"#!/bin/sh\necho {hook} >> {marks}\n")
        path.chmod(0o755)
    with db.session(settings.db_url) as s:
        study = create_study(s, settings, (origin / "grove.toml").read_text(), str(origin))
        clone = Path(study.repo_path)
        # Trunk with one merged change, as a finished study would have it.
        git = ["git", "-c", "user.name=g", "-c", "user.email=g@g", "-c", "core.hooksPath=/dev/null"]
        work = tmp_path / "work"
        subprocess.run([*git, "worktree", "add", "-q", str(work), study.trunk_commit], cwd=clone, check=True)
        (work / "config.toml").write_text("[knob]\nx = 3\nsleep = 0\n")
        subprocess.run([*git, "commit", "-qam", "x = 3"], cwd=work, check=True)
        trunk = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=work, capture_output=True, text=True
        ).stdout.strip()
        study.trunk_commit = trunk
        s.add(study)
        s.flush()
        assert promote(s, study, "op") == "grove/hooked"
    assert not marks.exists(), marks.read_text()
    pushed = subprocess.run(["git", "rev-parse", "grove/hooked"], cwd=origin, capture_output=True, text=True)
    assert pushed.returncode == 0 and len(pushed.stdout.strip()) == 40


def test_init_commit_in_a_subfolder_commits_the_files_where_they_are(
    settings: Settings, tmp_path: Path
) -> None:
    mono = make_repo(tmp_path / "mono", {f"sub/{k}": v for k, v in SCRIPT.items()} | {"README": "mono\n"})
    made = grove(settings, "init", str(mono / "sub"), "--commit", "--no-check")
    assert made.returncode == 0, made.stderr + made.stdout
    shown = subprocess.run(["git", "show", "--name-only", "--format=", "HEAD"], cwd=mono, capture_output=True,
                           text=True, check=True).stdout.split()  # fmt: skip
    assert "sub/grove_eval.py" in shown and all(p.startswith("sub/") for p in shown), shown
    status = subprocess.run(["git", "status", "--porcelain"], cwd=mono, capture_output=True, text=True).stdout
    assert "grove_eval.py" not in status and "adapter.json" not in status, status


def test_a_plain_folder_imports_a_link_as_a_link(tmp_path: Path) -> None:
    from backend.core import gitops

    secret = tmp_path / "elsewhere" / "labels.csv"
    secret.parent.mkdir()
    secret.write_text("the held-out labels\n")
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "train.py").write_text("print(1)\n")
    os.symlink(secret.parent, plain / "loot")
    repo = gitops.clone(str(plain), tmp_path / "clone")
    listing = repo.git("ls-tree", "-r", "HEAD")
    assert "120000" in listing and "loot" in listing
    assert "held-out" not in repo.git("log", "-p", "--all")
