from __future__ import annotations

import hashlib
import shutil
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from agents.spec import parse_spec
from backend.core import db, gitops
from backend.core.config import Settings
from backend.engine import policing, workspace
from backend.services.studies import create_study
from tests.support.repos import git, tiny_files
from tests.support.waiting import wait_for


def test_clone_leaves_the_users_repository_alone(tmp_path: Path, tiny_repo: Path) -> None:
    before = git("log", "--all", "--oneline", cwd=tiny_repo)
    repo = gitops.clone(str(tiny_repo), tmp_path / "clone")
    repo.set_branch("grove/x/trunk", repo.rev("main"))
    (repo.path / "new.txt").write_text("x")
    repo.commit_all(repo.path, "local only")
    assert git("log", "--all", "--oneline", cwd=tiny_repo) == before
    assert git("status", "--porcelain", cwd=tiny_repo) == ""


def test_plain_folder_is_imported_as_a_snapshot(tmp_path: Path) -> None:
    src = tmp_path / "plain"
    src.mkdir()
    (src / "a.txt").write_text("hello")
    repo = gitops.clone(str(src), tmp_path / "clone")
    assert repo.files_at("main") == ["a.txt"]
    assert not (src / ".git").exists()


def test_missing_repository_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        gitops.clone(str(tmp_path / "nope"), tmp_path / "clone")


def test_a_command_past_its_timeout_is_killed_with_its_children_and_its_output_kept(tmp_path: Path) -> None:
    pidfile = tmp_path / "child"
    argv = ["sh", "-c", f"echo started; echo warn >&2; sleep 30 >/dev/null 2>&1 & echo $! > {pidfile}; wait"]
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        gitops.run_captured(argv, cwd=tmp_path, env={"PATH": "/usr/bin:/bin"}, timeout=0.5)
    assert caught.value.output == "started\n" and str(caught.value.stderr) == "warn\n"
    child = pidfile.read_text().strip()

    def gone() -> bool:
        try:
            return " Z " in Path(f"/proc/{child}/stat").read_text()  # dead, not yet reaped
        except FileNotFoundError:
            return True

    wait_for(gone, 10)
    done = gitops.run_captured(["sh", "-c", "echo out; echo err >&2; exit 3"], cwd=None, env={}, timeout=30)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")

    # An exception that lands while it runs (a worker's time limit) kills it, its children with it.
    class TimeLimit(Exception):
        pass

    def limit(*_: object) -> None:
        raise TimeLimit

    pidfile.unlink()
    previous = signal.signal(signal.SIGALRM, limit)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    try:
        with pytest.raises(TimeLimit):  # were it waited for, the test would run past its own time limit
            forever = f"sleep 600 >/dev/null 2>&1 & echo $! > {pidfile}; exec sleep 600"
            gitops.run_captured(
                ["sh", "-c", forever], cwd=tmp_path, env={"PATH": "/usr/bin:/bin"}, timeout=900
            )
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    child = pidfile.read_text().strip()
    wait_for(gone, 10)
    # A git command whose alias runs a shell that hangs: both are killed, and git's error says why.
    with pytest.raises(gitops.GitError, match="timed out after"):
        gitops.git("-c", "alias.wait=!sleep 30", "wait", cwd=tmp_path, timeout=0.5)


def test_a_process_told_to_stop_kills_the_commands_it_runs_with_their_children(tmp_path: Path) -> None:
    pidfile = tmp_path / "child"
    argv = ["sh", "-c", f"sleep 600 >/dev/null 2>&1 & echo $! > {pidfile}; exec sleep 600"]
    done: list[subprocess.CompletedProcess[str]] = []
    runner = threading.Thread(
        target=lambda: done.append(
            gitops.run_captured(argv, cwd=tmp_path, env={"PATH": "/usr/bin:/bin"}, timeout=900)
        )
    )
    runner.start()
    wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), 10)
    child = pidfile.read_text().strip()
    gitops.kill_all()  # what a worker's pool process does as it ends
    runner.join(30)
    assert not runner.is_alive() and done and done[0].returncode == -9

    def gone() -> bool:
        try:
            return " Z " in Path(f"/proc/{child}/stat").read_text()
        except FileNotFoundError:
            return True

    wait_for(gone, 10)


def test_a_change_with_bytes_that_are_not_utf8_is_read_as_text(tmp_path: Path, tiny_repo: Path) -> None:
    repo = gitops.clone(str(tiny_repo), tmp_path / "clone")
    base = repo.rev("main")
    wt = workspace.prepare(repo, tmp_path / "wt", "grove/t/n1", base, sealed=None, reason="t")
    (wt / "config.toml").write_bytes(b"lr = 0.1\n# caf\xe9 \xff\xfe\n")
    commit = repo.commit_all(wt, "latin-1 \xe9")
    assert commit is not None
    diff = repo.diff(base, commit)  # a node's page and the llm verifier read it
    assert "caf\ufffd" in diff and "lr = 0.1" in diff
    assert repo.changed_files(base, commit) == ["config.toml"]


def test_sealed_files_are_absent_and_never_committed(tmp_path: Path, tiny_repo: Path) -> None:
    repo = gitops.clone(str(tiny_repo), tmp_path / "clone")
    wt = workspace.prepare(
        repo, tmp_path / "wt", "grove/t/n1", repo.rev("main"), sealed=["data/test/**"], reason="t"
    )
    assert not (wt / "data" / "test" / "offset.txt").exists()
    assert not (wt / "data").exists()
    assert git("status", "--porcelain", cwd=wt) == ""
    (wt / "config.toml").write_text("[knob]\nx = 2\n")
    commit = repo.commit_all(wt, "edit")
    assert commit is not None
    assert "data/test/offset.txt" in repo.files_at(commit)
    assert repo.changed_files(repo.rev("main"), commit) == ["config.toml"]
    repo.remove_worktree(wt)
    assert not wt.exists() and repo.worktrees() == []
    assert repo.branch_exists("grove/t/n1")


def test_diff_outside_editable_or_protected_is_refused(tmp_path: Path, tiny_repo: Path) -> None:
    spec = parse_spec(tiny_files()["grove.toml"])
    repo = gitops.clone(str(tiny_repo), tmp_path / "clone")
    base = repo.rev("main")
    for path, why in [("eval.py", "changed protected file eval.py"), ("notes.md", "outside files.editable")]:
        wt = workspace.prepare(repo, tmp_path / "wt", "grove/t/x", base, sealed=spec.files.sealed, reason="t")
        (wt / path).write_text("tampered")
        commit = repo.commit_all(wt, "tamper")
        assert commit is not None
        assert why in policing.diff_violation(repo, base, commit, spec)
        repo.remove_worktree(wt)


def test_a_change_names_both_sides_of_a_rename_and_counts_like_git(tmp_path: Path, tiny_repo: Path) -> None:
    spec = parse_spec(tiny_files()["grove.toml"])
    repo = gitops.clone(str(tiny_repo), tmp_path / "clone")
    base = repo.rev("main")
    wt = workspace.prepare(repo, tmp_path / "wt", "grove/t/r", base, sealed=spec.files.sealed, reason="t")
    (wt / "eval.py").rename(wt / "moved\tname.py")  # the protected evaluator, renamed away
    (wt / "config.toml").write_text("[knob]\nx = 7\nsleep = 0\n")
    (wt / "blob.bin").write_bytes(bytes(range(256)))
    commit = repo.commit_all(wt, "rename")
    assert commit is not None
    change = repo.change(base, commit)
    assert sorted(change.paths) == sorted(["eval.py", "moved\tname.py", "config.toml", "blob.bin"])
    assert sorted(change.paths) == sorted(repo.changed_files(base, commit))
    assert change.stats == {"files": 3, "insertions": 1, "deletions": 1}
    assert policing.violation_of(change.paths, spec) == "changed blob.bin, which is outside files.editable"
    no_blob = [p for p in change.paths if p != "blob.bin"]
    assert policing.violation_of(no_blob, spec) == "changed protected file eval.py"
    repo.remove_worktree(wt)


def test_concurrent_worktree_creation_is_serialised(tmp_path: Path, tiny_repo: Path) -> None:
    repo = gitops.clone(str(tiny_repo), tmp_path / "clone")
    base = repo.rev("main")
    errors: list[BaseException] = []

    def add(i: int) -> None:
        try:
            repo.add_worktree(tmp_path / "wts" / f"n{i}", f"grove/t/n{i}", base, reason=f"job {i}")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=add, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(repo.worktrees()) == 12
    assert all((tmp_path / "wts" / f"n{i}" / "eval.py").exists() for i in range(12))


def locked_worktree(tmp_path: Path, tiny_repo: Path) -> tuple[gitops.Repo, str, Path]:
    """Clone the tiny repository and add a locked worktree of main on `grove/t/n1`; return clone, base, path."""
    repo = gitops.clone(str(tiny_repo), tmp_path / "clone")
    base = repo.rev("main")
    path = tmp_path / "wts" / "n1"
    repo.add_worktree(path, "grove/t/n1", base, reason="job 1")
    return repo, base, path


def test_a_worktree_is_removed_and_recreated_whatever_state_it_was_left_in(
    tmp_path: Path, tiny_repo: Path
) -> None:
    repo, base, path = locked_worktree(tmp_path, tiny_repo)
    (path / "config.toml").write_text("[knob]\nx = 3\n")  # dirty, and locked by add_worktree
    (path / "scratch").mkdir()
    repo.remove_worktree(path)
    assert not path.exists() and repo.worktrees() == []
    assert repo.branch_exists("grove/t/n1")  # the branch stays
    # Its folder deleted behind git's back: git's record of it goes too, and the path can be reused.
    repo.add_worktree(path, "grove/t/n1", base, reason="job 2")
    git("rm", "-rfq", "--cached", ".", cwd=path)  # a worktree a crashed job left half-changed
    shutil.rmtree(path)
    assert len(repo.worktrees()) == 1
    repo.add_worktree(path, "grove/t/n1", base, reason="job 3")
    assert [w["worktree"] for w in repo.worktrees()] == [str(path.resolve())]
    assert (path / "eval.py").exists() and "x = 0" in (path / "config.toml").read_text()
    repo.remove_worktree(path)
    repo.remove_worktree(path)  # twice is harmless
    assert repo.worktrees() == [] and not path.exists()


def test_commit_all_commits_every_change_and_nothing_when_clean(tmp_path: Path, tiny_repo: Path) -> None:
    repo = gitops.clone(str(tiny_repo), tmp_path / "clone")
    base = repo.rev("main")
    wt = repo.add_worktree(tmp_path / "wts" / "n1", "grove/t/n1", base)
    assert repo.commit_all(wt, "nothing") is None and repo.rev("grove/t/n1") == base
    git("init", "-q", "nested", cwd=wt)  # only a nested repository: nothing of this tree changed
    git("commit", "-q", "--allow-empty", "-m", "x", cwd=wt / "nested")
    assert repo.commit_all(wt, "a nested repository") is None
    shutil.rmtree(wt / "nested")
    git("reset", "-q", cwd=wt)
    (wt / "config.toml").write_text("[knob]\nx = 2\n")
    (wt / "new.txt").write_text("new\n")
    commit = repo.commit_all(wt, "edit")
    assert commit is not None and commit == repo.rev("grove/t/n1") != base
    assert sorted(repo.changed_files(base, commit)) == ["config.toml", "new.txt"]
    assert repo.commit_all(wt, "again") is None
    (wt / "new.txt").write_text("newer\n")
    lock = repo.path / ".git" / "refs" / "heads" / "grove" / "t" / "n1.lock"
    lock.write_text("")  # the branch cannot move: a failed commit is an error, not "nothing to commit"
    with pytest.raises(gitops.GitError):
        repo.commit_all(wt, "locked")
    lock.unlink()


def _loose_objects(repo: gitops.Repo) -> int:
    fields = dict(line.split(": ", 1) for line in repo.git("count-objects", "-v").splitlines())
    return int(fields["count"])


def test_a_commit_leaves_maintenance_for_later_and_maintain_packs_when_due(
    tmp_path: Path, tiny_repo: Path
) -> None:
    repo = gitops.clone(str(tiny_repo), tmp_path / "clone")
    # Due at more than one loose object in objects/17 (git estimates from that one folder).
    repo.git("config", "gc.auto", "1")
    repo.git("config", "gc.autoDetach", "false")
    wt = repo.add_worktree(tmp_path / "wts" / "n1", "grove/t/n1", repo.rev("main"))
    planted = 0
    for i in range(100_000):
        body = f"filler {i}\n".encode()
        if hashlib.sha1(b"blob %d\0" % len(body) + body).hexdigest().startswith("17"):
            (wt / f"filler{planted}.txt").write_bytes(body)
            planted += 1
            if planted == 3:
                break
    assert repo.commit_all(wt, "three blobs in objects/17") is not None
    assert _loose_objects(repo) >= 3  # gc was due, but the commit did not start one
    repo.remove_worktree(wt)
    repo.git("config", "maintenance.auto", "false")  # an operator who turned it off is obeyed
    repo.maintain()
    assert _loose_objects(repo) >= 3
    repo.git("config", "--unset", "maintenance.auto")
    repo.maintain()
    assert _loose_objects(repo) == 0


def test_commit_all_commits_on_a_branch_with_no_commit_yet(tmp_path: Path) -> None:
    git("init", "-q", "-b", "main", "new", cwd=tmp_path)
    (tmp_path / "new" / "a.txt").write_text("a\n")
    repo = gitops.Repo(tmp_path / "new")
    commit = repo.commit_all(repo.path, "first")
    assert commit is not None and repo.rev("main") == commit
    assert repo.commit_all(repo.path, "again") is None


def test_a_worktree_git_no_longer_recognises_is_still_removed_and_its_branch_freed(
    tmp_path: Path, tiny_repo: Path
) -> None:
    repo, base, path = locked_worktree(tmp_path, tiny_repo)
    (path / ".git").write_text("gitdir: /nowhere\n")  # half-deleted, or rewritten by a crashed run
    repo.remove_worktree(path)
    assert not path.exists() and repo.worktrees() == []
    repo.set_branch("grove/t/n1", base)  # no longer checked out anywhere
    other = repo.add_worktree(tmp_path / "wts" / "elsewhere", "grove/t/n1", base, reason="job 2")
    assert (other / "eval.py").exists()


def test_janitor_removes_stale_worktrees(settings: Settings, tiny_repo: Path) -> None:
    with db.session(settings.db_url) as s:
        study = create_study(s, settings, tiny_files()["grove.toml"], str(tiny_repo))
    repo = workspace.repo_of(study)
    path = workspace.worktree_path(settings, study, "n99-a1")
    workspace.prepare(repo, path, "grove/tiny/n99", study.base_commit, sealed=None, reason="left over")
    assert path.exists()
    removed = workspace.janitor(settings)
    assert removed == [path] and not path.exists() and repo.worktrees() == []


def test_a_branch_checked_out_in_one_worktree_is_refused_to_another(tmp_path: Path, tiny_repo: Path) -> None:
    repo = gitops.clone(str(tiny_repo), tmp_path / "clone")
    base = repo.rev("main")
    first = repo.add_worktree(tmp_path / "wts" / "n1-a1", "grove/t/n1", base, reason="job 1")
    (first / "config.toml").write_text("[knob]\nx = 7\n")
    kept = repo.commit_all(first, "first attempt")
    with pytest.raises(gitops.GitError, match="already checked out"):
        repo.add_worktree(tmp_path / "wts" / "n1-a2", "grove/t/n1", base, reason="job 2")
    assert repo.rev("grove/t/n1") == kept and not (tmp_path / "wts" / "n1-a2").exists()
    # git itself reads the worktree as one of its own: locked, with the reason given.
    listed = {Path(w["worktree"]).name: w for w in repo.worktrees()}
    assert listed["n1-a1"]["branch"] == "refs/heads/grove/t/n1" and listed["n1-a1"]["locked"] == "job 1"
    assert git("status", "--porcelain", cwd=first) == ""


def test_the_operators_own_git_config_changes_no_checkout(
    tmp_path: Path, tiny_repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / ".gitconfig").write_text("[core]\n\tautocrlf = true\n")  # would write CRLF line ends
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home))
    repo = gitops.clone(str(tiny_repo), tmp_path / "clone")
    wt = repo.add_worktree(tmp_path / "wts" / "n1", "grove/t/n1", repo.rev("main"))
    assert b"\r" not in (wt / "config.toml").read_bytes()
    assert repo.commit_all(wt, "nothing") is None


def test_a_commit_message_and_a_change_read_as_git_writes_and_counts_them(
    tmp_path: Path, tiny_repo: Path
) -> None:
    repo, base, wt = locked_worktree(tmp_path, tiny_repo)
    (wt / "config.toml").write_text("[knob]\nx = 2\n")
    lines = "".join(f"line {i}\n" for i in range(40))
    (wt / "notes.txt").write_text(lines)
    (wt / "blob.bin").write_bytes(bytes(range(256)) * 4)
    first = repo.commit_all(wt, "\n\nGrove n1: a title   \n\n\n\nwhat changed  \n\n")
    assert first is not None
    assert git("log", "-1", "--format=%B", first, cwd=repo.path) == "Grove n1: a title\n\nwhat changed\n\n"
    assert git("log", "-1", "--format=%an <%ae>", first, cwd=repo.path).strip() == "Grove <grove@localhost>"
    (wt / "notes.txt").rename(wt / "renamed.txt")
    (wt / "renamed.txt").write_text(lines + "one more\n")
    second = repo.commit_all(wt, "rename")
    assert second is not None
    for old, new in ((base, first), (first, second), (base, second)):
        change = repo.change(old, new)
        numstat = git("diff", "--numstat", "-z", old, new, cwd=repo.path)
        fields = [f for f in numstat.split("\0") if f]
        counted = [f.split("\t") for f in fields if "\t" in f]
        assert change.stats == {
            "files": len(counted),
            "insertions": sum(int(a) for a, _, _ in counted if a.isdigit()),
            "deletions": sum(int(d) for _, d, _ in counted if d.isdigit()),
        }
        assert sorted(change.paths) == sorted(p for f in fields for p in [f.split("\t")[-1]] if p)
        listed = git("diff", "--name-only", "--no-renames", "-z", old, new, cwd=repo.path)
        assert repo.changed_files(old, new) == [p for p in listed.split("\0") if p]
    assert sorted(repo.change(first, second).paths) == ["notes.txt", "renamed.txt"]
    repo.remove_worktree(wt)  # the folder and git's record of it go; the branch is free again
    assert (
        not wt.exists() and repo.worktrees() == [] and not any((repo.path / ".git" / "worktrees").iterdir())
    )
    assert repo.add_worktree(tmp_path / "wts" / "again", "grove/t/n1", second).exists()


def test_a_gate_merge_is_made_without_a_worktree_as_git_merge_no_ff_makes_it(
    tmp_path: Path, tiny_repo: Path
) -> None:
    repo = gitops.clone(str(tiny_repo), tmp_path / "clone")
    base = repo.rev("main")

    def node(name: str, at: str, files: dict[str, str]) -> str:
        wt = repo.add_worktree(tmp_path / "wts" / name, f"grove/t/{name}", at)
        for rel, text in files.items():
            (wt / rel).write_text(text)
        commit = repo.commit_all(wt, name)
        repo.remove_worktree(wt)
        assert commit is not None
        return commit

    first = node("n1", base, {"config.toml": "[knob]\nx = 1\n"})
    # On trunk itself: git would fast-forward; --no-ff makes a merge commit of the node's tree.
    merged = repo.merge_onto("grove/t/gate/n1", base, first, "Grove: merge n1 (x = 1)")
    assert repo.rev("grove/t/gate/n1") == merged
    assert git("log", "-1", "--format=%P", merged, cwd=repo.path).split() == [base, first]
    assert git("rev-parse", f"{merged}^{{tree}}", cwd=repo.path) == git(
        "rev-parse", f"{first}^{{tree}}", cwd=repo.path
    )
    assert git("log", "-1", "--format=%B", merged, cwd=repo.path) == "Grove: merge n1 (x = 1)\n\n"
    # Trunk moved meanwhile: the two changes are combined as git combines them.
    second = node("n2", base, {"notes.txt": "a note\n"})
    both = repo.merge_onto("grove/t/gate/n2", merged, second, "Grove: merge n2")
    cli = repo.add_worktree(tmp_path / "wts" / "cli", "grove/t/cli", merged)
    git("-c", "user.name=a", "-c", "user.email=a@a", "merge", "-q", "--no-ff", "-m", "m", second, cwd=cli)
    assert git("rev-parse", f"{both}^{{tree}}", cwd=repo.path) == git("rev-parse", "HEAD^{tree}", cwd=cli)
    # Both changed the same line: a conflict, and nothing written.
    third = node("n3", base, {"config.toml": "[knob]\nx = 3\n"})
    with pytest.raises(gitops.MergeConflict, match=r"config\.toml"):
        repo.merge_onto("grove/t/gate/n3", merged, third, "Grove: merge n3")
    assert not repo.branch_exists("grove/t/gate/n3")
    # Trunk moves only forward, and never onto a branch a worktree has out.
    assert (
        repo.is_ancestor(base, both)
        and not repo.is_ancestor(both, base)
        and not repo.is_ancestor("nope", both)
    )
    repo.set_branch("grove/t/trunk", both)
    assert repo.rev("grove/t/trunk") == both
    repo.add_worktree(tmp_path / "wts" / "held", "grove/t/held", base)
    with pytest.raises(gitops.GitError, match="checked out"):
        repo.set_branch("grove/t/held", both)


def test_a_sha256_repository_is_run_by_git_itself_where_libgit2_cannot_read_it(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    git("init", "-q", "--object-format=sha256", "-b", "main", cwd=src)
    (src / "config.toml").write_text("[knob]\nx = 1\n")
    git("add", "-A", cwd=src)
    git("-c", "user.name=a", "-c", "user.email=a@a", "commit", "-qm", "init", cwd=src)
    repo = gitops.clone(str(src), tmp_path / "clone")
    base = repo.rev("main")
    assert len(base) == 64
    repo.set_branch("grove/t/trunk", base)
    wt = repo.add_worktree(tmp_path / "wts" / "n1", "grove/t/n1", base)
    (wt / "config.toml").write_text("[knob]\nx = 2\n")
    commit = repo.commit_all(wt, "Grove n1: x = 2")
    assert commit is not None and len(commit) == 64 and repo.rev("grove/t/n1") == commit
    assert repo.changed_files(base, commit) == ["config.toml"]
    assert repo.change(base, commit).stats == {"files": 1, "insertions": 1, "deletions": 1}
    assert repo.is_ancestor(base, commit) and not repo.is_ancestor(commit, base)
    merged = repo.merge_onto("grove/t/gate/n1", base, commit, "Grove: merge n1")
    assert git("log", "-1", "--format=%P", merged, cwd=repo.path).split() == [base, commit]
    repo.remove_worktree(wt)
    other = repo.add_worktree(tmp_path / "wts" / "n2", "grove/t/n2", base)
    (other / "config.toml").write_text("[knob]\nx = 3\n")
    rival = repo.commit_all(other, "Grove n2: x = 3")
    assert rival is not None
    with pytest.raises(gitops.MergeConflict):  # git's own merge, in a worktree of its own
        repo.merge_onto("grove/t/gate/n2", merged, rival, "Grove: merge n2")
    assert repo.rev("grove/t/gate/n2") == merged
    repo.remove_worktree(other)
    assert repo.worktrees() == []


def test_files_git_re_encodes_at_checkout_are_checked_out_and_committed_by_git_itself(
    tmp_path: Path,
) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / ".gitattributes").write_text("*.txt working-tree-encoding=UTF-16LE\n")
    text = "héllo\n".encode("utf-16-le")
    (src / "sub" / "data.txt").write_bytes(text)
    (src / "other").write_text("x\n")
    git("init", "-q", "-b", "main", cwd=src)
    git("add", "-A", cwd=src)
    git("-c", "user.name=a", "-c", "user.email=a@a", "commit", "-qm", "init", cwd=src)
    repo = gitops.clone(str(src), tmp_path / "clone")
    base = repo.rev("main")
    wt = repo.add_worktree(tmp_path / "wts" / "n1", "grove/t/n1", base)
    assert (wt / "sub" / "data.txt").read_bytes() == text  # as git writes it, not the stored UTF-8
    (wt / "other").write_text("y\n")
    commit = repo.commit_all(wt, "edit other")
    assert commit is not None and repo.changed_files(base, commit) == ["other"]


def test_a_file_that_became_a_link_is_one_changed_path_as_git_counts_it(
    tmp_path: Path, tiny_repo: Path
) -> None:
    repo, base, wt = locked_worktree(tmp_path, tiny_repo)
    (wt / "config.toml").unlink()
    (wt / "config.toml").symlink_to("eval.py")
    commit = repo.commit_all(wt, "a link")
    assert commit is not None
    assert repo.changed_files(base, commit) == ["config.toml"]
    numstat = git("diff", "--numstat", base, commit, cwd=repo.path).strip().splitlines()
    assert repo.change(base, commit).stats["files"] == len(numstat) == 1


def test_a_missing_repository_is_a_git_error_not_a_library_one(tmp_path: Path) -> None:
    (tmp_path / "nothing").mkdir()
    repo = gitops.Repo(tmp_path / "nothing")
    with pytest.raises(gitops.GitError, match="diff"):
        repo.change("a" * 40, "b" * 40)
    with pytest.raises(gitops.GitError, match="diff"):
        repo.changed_files("a" * 40, "b" * 40)
