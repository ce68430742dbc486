"""A repository source is judged by the folders git really reads: gitfiles, commondir and alternates."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx

from backend.api.main import create_app
from backend.core import db
from backend.core.config import Settings
from backend.core.security import create_token
from backend.services.studies import create_study
from tests.conftest import free_port, make_repo, serve, tiny_files


def test_a_gitfile_commondir_or_alternates_into_groves_folders_is_refused(tmp_path: Path) -> None:
    # As `grove up` sets it: the repository root is the folder Grove runs in, its data folder inside.
    settings = Settings(
        data_dir=tmp_path / ".grove", worktrees_dir=tmp_path / "worktrees", repo_roots=str(tmp_path)
    )
    settings.ensure_dirs()
    victim = make_repo(tmp_path / "victim", tiny_files(name="victim"))
    with db.session(settings.db_url) as s:
        study = create_study(s, settings, (victim / "grove.toml").read_text(), str(victim))
    clone_git = Path(study.repo_path) / ".git"
    assert clone_git.is_dir()
    allowed = tmp_path / "allowed"
    # 1. A work tree whose `.git` is a one-line file naming the victim's clone.
    gitfile = allowed / "gitfile"
    gitfile.mkdir(parents=True)
    (gitfile / ".git").write_text(f"gitdir: {clone_git}\n")
    # 2. A linked-worktree git directory inside the roots whose commondir is the victim's clone.
    linked = allowed / "linked"
    linked.mkdir()
    wt_git = allowed / "linked-gitdir"
    wt_git.mkdir()
    (wt_git / "commondir").write_text(f"{clone_git}\n")
    (wt_git / "HEAD").write_text(f"ref: refs/heads/grove/{study.name}/trunk\n")
    (linked / ".git").write_text(f"gitdir: {wt_git}\n")
    # 3. A repository of its own, borrowing the victim's objects through alternates (relative form).
    borrower = make_repo(allowed / "borrower", tiny_files(name="borrower"))
    alt = borrower / ".git" / "objects" / "info" / "alternates"
    alt.write_text("# a comment\n" + os.path.relpath(clone_git / "objects", alt.parent.parent) + "\n")
    assert (
        subprocess.run(["git", "-C", str(borrower), "cat-file", "-e", study.base_commit or ""]).returncode
        == 0
    )
    port = free_port()
    server, thread = serve(create_app(settings), port)
    try:
        url = f"http://127.0.0.1:{port}/api/v1"
        headers = {"Authorization": f"Bearer {create_token(settings, ['operator'], 'op')}"}
        spec = tiny_files(name="thief")["grove.toml"]
        for source in (gitfile, linked, borrower):
            for path in ("/studies/validate", "/studies"):
                resp = httpx.post(
                    f"{url}{path}", json={"spec": spec, "repository": str(source)}, headers=headers
                )
                assert resp.status_code == 422, (source, resp.text)
                detail = resp.json()["detail"]
                assert detail["errors"][0]["key"] == "repository", detail
                assert "inside Grove's own folder" in detail["message"] and "gitfile" in detail["message"]
        # A plain repository under the roots is still fine.
        (alt).unlink()
        ok = httpx.post(
            f"{url}/studies/validate", json={"spec": spec, "repository": str(borrower)}, headers=headers
        )
        assert ok.status_code == 200, ok.text
    finally:
        server.should_exit = True
        thread.join(timeout=10)
