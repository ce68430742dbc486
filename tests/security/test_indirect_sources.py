"""A repository source is judged by the folders git really reads: gitfiles, commondir and alternates."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from backend.api.main import create_app
from backend.core import db
from backend.core.config import Settings
from backend.core.models import Study
from backend.core.security import create_token
from backend.services.studies import create_study
from tests.support.repos import make_repo, tiny_files
from tests.support.services import serve
from tests.support.waiting import free_port


def grove_with_a_victim(tmp_path: Path) -> tuple[Settings, Study]:
    """Return settings as `grove up` makes them (the roots hold Grove's data folder) and a study in them."""
    settings = Settings(
        data_dir=tmp_path / ".grove", worktrees_dir=tmp_path / "worktrees", repo_roots=str(tmp_path)
    )
    settings.ensure_dirs()
    victim = make_repo(tmp_path / "victim", tiny_files(name="victim"))
    with db.session(settings.db_url) as s:
        study = create_study(s, settings, (victim / "grove.toml").read_text(), str(victim))
    return settings, study


@contextmanager
def api(settings: Settings) -> Iterator[Callable[[str, Path], httpx.Response]]:
    """Serve the API and yield a function that posts a thief's spec with a repository to a study route."""
    port = free_port()
    server, thread = serve(create_app(settings), port)
    headers = {"Authorization": f"Bearer {create_token(settings, ['operator'], 'op')}"}
    spec = tiny_files(name="thief")["grove.toml"]

    def post(route: str, source: Path, text: str = spec) -> httpx.Response:
        body = {"spec": text, "repository": str(source)}
        return httpx.post(f"http://127.0.0.1:{port}/api/v1{route}", json=body, headers=headers, timeout=60)

    try:
        yield post
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def refused_as_groves_own(resp: httpx.Response) -> None:
    assert resp.status_code == 422, resp.text
    detail = resp.json()["detail"]
    assert detail["errors"][0]["key"] == "repository" and "inside Grove's own folder" in detail["message"], (
        detail
    )


def test_a_gitfile_commondir_or_alternates_into_groves_folders_is_refused(tmp_path: Path) -> None:
    settings, study = grove_with_a_victim(tmp_path)
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
    with api(settings) as post:
        for source in (gitfile, linked, borrower):
            for route in ("/studies/validate", "/studies"):
                resp = post(route, source)
                refused_as_groves_own(resp)
                assert "gitfile" in resp.json()["detail"]["message"]
        # A plain repository under the roots is still fine.
        alt.unlink()
        ok = post("/studies/validate", borrower)
        assert ok.status_code == 200, ok.text


def test_git_is_asked_where_it_reads_and_links_in_object_folders_are_followed(tmp_path: Path) -> None:
    settings, study = grove_with_a_victim(tmp_path)
    objects = Path(study.repo_path) / ".git" / "objects"
    allowed = tmp_path / "allowed"
    cases = []
    # Alternates of alternates: git reads `<alternate>/info/alternates`.
    mid = allowed / "mid-objects"
    (mid / "info").mkdir(parents=True)
    (mid / "info" / "alternates").write_text(f"{objects}\n")
    chained = make_repo(allowed / "chained", tiny_files(name="chained"))
    (chained / ".git" / "objects" / "info" / "alternates").write_text(f"{mid}\n")
    cases.append(chained)
    # A C-quoted alternates line, which git unquotes: `\057` is a slash.
    quoted = make_repo(allowed / "quoted", tiny_files(name="quoted"))
    rel = os.path.relpath(objects, quoted / ".git" / "objects")
    (quoted / ".git" / "objects" / "info" / "alternates").write_text('"' + rel.replace("/", "\\057") + '"\n')
    cases.append(quoted)
    # The bad alternate first, then more lines than anyone would read by hand.
    padded = make_repo(allowed / "padded", tiny_files(name="padded"))
    pad = "".join(f"{allowed / 'none'}{i}\n" for i in range(70))
    (padded / ".git" / "objects" / "info" / "alternates").write_text(f"{objects}\n{pad}")
    cases.append(padded)
    # A linked object folder, and a linked pack.
    linked = make_repo(allowed / "linked-objects", tiny_files(name="lo"))
    shutil.rmtree(linked / ".git" / "objects")
    os.symlink(objects, linked / ".git" / "objects")
    cases.append(linked)
    packed = make_repo(allowed / "linked-pack", tiny_files(name="lp"))
    subprocess.run(["git", "-C", str(Path(study.repo_path)), "repack", "-adq"], check=True)
    for pack in (objects / "pack").glob("pack-*"):
        os.symlink(pack, packed / ".git" / "objects" / "pack" / pack.name)
    cases.append(packed)
    with api(settings) as post:
        for source in cases:
            refused_as_groves_own(post("/studies/validate", source))


def test_a_partial_clone_cannot_make_groves_git_run_its_fetch_program(tmp_path: Path) -> None:
    settings, _ = grove_with_a_victim(tmp_path)
    lazy = make_repo(tmp_path / "allowed" / "lazy", tiny_files(name="lazy"))
    tree = subprocess.run(
        ["git", "rev-parse", "HEAD:data"], cwd=lazy, capture_output=True, text=True, check=True
    )
    sha = tree.stdout.strip()
    (lazy / ".git" / "objects" / sha[:2] / sha[2:]).unlink()  # a tree the promisor would have to send
    mark = tmp_path / "PWNED"
    for key, value in (("core.repositoryFormatVersion", "1"), ("extensions.partialClone", "origin"),
                       ("remote.origin.url", str(tmp_path / "allowed" / "lazy")), ("remote.origin.promisor", "true"),
                       ("remote.origin.uploadpack", f"touch {mark}; git-upload-pack")):  # fmt: skip
        subprocess.run(["git", "config", key, value], cwd=lazy, check=True)
    with api(settings) as post:
        resp = post("/studies/validate", lazy, (lazy / "grove.toml").read_text())
        assert 400 <= resp.status_code < 500 and "repository" in resp.text, resp.text
    assert not mark.exists()
