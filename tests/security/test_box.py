"""Attacks from inside one sandboxed command, each asserted to fail (docs/security.md, "Attacks tried")."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from agents.executor.tools import Observation
from backend.core import gitops
from backend.core.config import PROJECT_ROOT, Settings
from backend.core.models import Study
from backend.engine import evaluation, sandbox, workspace
from tests.support.repos import make_repo
from tests.support.waiting import wait_for

SEALED = "SEALED-BYTES-" + uuid.uuid4().hex


def box(command: str, tree: Path, **limits: object) -> sandbox.Result:
    """Run a shell command in a box on `tree` and return its result."""
    return sandbox.run(
        command,
        cwd=tree,
        output_dir=tree.parent / f"out-{uuid.uuid4().hex[:6]}",
        limits=sandbox.Limits(**{"timeout": 60.0, **limits}),  # type: ignore[arg-type]
    )


def seen(res: sandbox.Result) -> str:
    """Return everything a run printed, tails and stored files."""
    return res.stdout_tail + res.stderr_tail + res.stdout_path.read_text() + res.stderr_path.read_text()


def dev_tree(settings: Settings, tmp_path: Path) -> tuple[gitops.Repo, Path]:
    """Return Grove's clone of a repository with a sealed file, and a dev worktree of it."""
    origin = make_repo(
        tmp_path / "origin",
        {"eval.py": "print('{\"score\": 1}')\n", "data/test/secret.txt": SEALED + "\n", "model.txt": "m\n"},
    )
    repo = gitops.clone(str(origin), settings.data_dir / "repos" / "victim")
    path = workspace.worktree_path(settings, _study(), "n1-a1")
    workspace.prepare(repo, path, "grove/victim/n1", repo.rev("main"), sealed=["data/test/**"], reason="t")
    return repo, path


def _study() -> Study:
    return Study(name="victim", spec_toml="", source="")


def test_sealed_history_clone_and_data_are_unreachable_from_a_dev_tree(
    settings: Settings, tmp_path: Path
) -> None:
    repo, tree = dev_tree(settings, tmp_path)
    (settings.data_dir / "grove.db").write_text("HELD-OUT 777.125")
    res = box(
        "git show HEAD:data/test/secret.txt; git log -p --all; git cat-file --batch-all-objects --batch;"
        "cat data/test/secret.txt; cat .git; cat .git/config; git config core.fsmonitor 'touch /tmp/x';"
        f"echo hooked > .git/hooks/pre-commit; ls -la {repo.path} {repo.path}/.git/objects;"
        f"cat {settings.data_dir}/grove.db; ls {settings.worktrees_dir} {tmp_path / 'origin'};"
        f"cat {tmp_path / 'origin' / 'data/test/secret.txt'}; echo done",
        tree,
    )
    out = seen(res)
    assert res.stdout_tail.strip().endswith("done")
    assert SEALED not in out and "777.125" not in out
    assert "not a git repository" in out and "No such file or directory" in out
    assert (repo.path / ".git" / "config").read_text().count("fsmonitor") == 0
    assert not (repo.path / ".git" / "hooks" / "pre-commit").exists()


def test_host_processes_and_their_keys_are_invisible(tmp_path: Path) -> None:
    key = "sk-" + uuid.uuid4().hex
    os.environ["OPENAI_API_KEY"] = key
    try:
        res = box(
            "ls /proc | grep -c '^[0-9]'; cat /proc/*/environ | tr '\\0' '\\n'; cat /proc/1/environ;"
            "ls /proc/1/root/ /proc/self/root/root; readlink /proc/1/cwd; ls /proc/1/root/work /root/.grove;"
            f"cat /proc/self/root{tmp_path}/host.txt; echo done",
            tmp_path,
        )
    finally:
        del os.environ["OPENAI_API_KEY"]
    out = seen(res)
    assert res.stdout_tail.strip().endswith("done")
    assert key not in out
    assert int(res.stdout_tail.split()[0]) <= 6  # the box's own processes only


def test_loopback_services_are_unreachable_without_network(tmp_path: Path, redis_url: str) -> None:
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    probe = (
        "import socket\n"
        f"for host, port in (('127.0.0.1', {port}), ('127.0.0.1', 5432), ('127.0.0.1', 8000)):\n"
        "    try:\n"
        "        socket.create_connection((host, port), timeout=2).close(); print('CONNECTED', port)\n"
        "    except OSError as exc:\n"
        "        print('refused', port, exc)\n"
        "import os\n"
        "print('unix socket', os.path.exists('/var/run/postgresql/.s.PGSQL.5432'))\n"
    )
    (tmp_path / "probe.py").write_text(probe)
    closed = box("python probe.py", tmp_path)
    assert closed.ok and "CONNECTED" not in closed.stdout_tail and "unix socket False" in closed.stdout_tail
    opened = box("python probe.py", tmp_path, network=True)  # the same probe does see Redis with network on
    assert f"CONNECTED {port}" in opened.stdout_tail


def test_writes_outside_the_tree_fail_or_stay_in_the_box(settings: Settings, tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    tree = tmp_path / "tree"
    tree.mkdir()
    targets = [Path("/pwned-" + marker), Path("/usr/pwned-" + marker), Path("/tmp/grove-pwned-" + marker),
               settings.data_dir / f"pwned-{marker}", tree.parent / f"pwned-{marker}"]  # fmt: skip
    res = box("; ".join(f"echo x > {t}" for t in targets) + "; echo x > ../escape; echo done", tree)
    assert res.stdout_tail.strip().endswith("done")
    for t in [*targets, tree.parent / "escape"]:
        assert not t.exists(), t


def test_the_boxed_command_runs_under_every_resource_limit(tmp_path: Path) -> None:
    res = box(
        "for f in t v f c p; do echo $f $(ulimit -H -$f) $(ulimit -S -$f); done",
        tmp_path, cpu_seconds=7, memory_mb=300, file_size_mb=3, processes=33,
    )  # fmt: skip
    assert res.exit_code == 0, res.stderr_tail
    got = {line.split()[0]: line.split()[1:] for line in res.stdout_tail.splitlines()}
    # The shell prints -v in KiB and -f in 512-byte blocks; soft and hard limits are the same.
    # The process limit also holds the box's wrapper, its watcher and the shell running the command.
    want = {
        "t": "7",
        "v": str(300 * 1024),
        "f": str(3 * 2048),
        "c": "0",
        "p": str(33 + sandbox.WRAPPER_PROCESSES),
    }
    assert got == {k: [v, v] for k, v in want.items()}


@pytest.mark.parametrize("processes", [1, 2])
def test_the_process_limit_is_what_the_command_itself_may_run(tmp_path: Path, processes: int) -> None:
    if os.geteuid() != 0:  # CI runs as root; an ordinary user's limit also counts Grove's processes
        pytest.skip("as an ordinary user the kernel counts Grove's own processes too (docs/security.md)")

    def children(n: int) -> str:
        return "".join("sleep 0.3 & " for _ in range(n)) + "wait; echo ran"

    fits = box(children(processes), tmp_path, timeout=30, processes=processes)
    assert fits.exit_code == 0 and fits.stdout_tail.strip() == "ran", fits.stderr_tail
    over = box(children(processes + 1), tmp_path, timeout=30, processes=processes)
    assert over.exit_code != 0 and "fork" in over.stderr_tail.lower()


def test_fork_bomb_and_process_flood_are_contained(tmp_path: Path) -> None:
    marker = f"50{uuid.uuid4().int % 10**6}"
    res = box(f"for i in $(seq 300); do sleep {marker} & done; wait", tmp_path, timeout=5, processes=40)
    assert "fork" in res.stderr_tail.lower()  # the process limit refused further forks
    wait_for(lambda: not _alive_with(f"sleep {marker}"), timeout=10)
    bomb = box("f() { f | f & }; f; sleep 2", tmp_path, timeout=5, processes=40)
    assert bomb.timed_out or bomb.exit_code is not None
    if os.geteuid() == 0:
        wait_for(lambda: not _sandbox_uids_alive(), timeout=15)


def _alive_with(marker: str) -> bool:
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and marker in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                return "\nState:\tZ" not in (d / "status").read_text()
        except OSError:
            continue
    return False


def _sandbox_uids_alive() -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        try:
            status = (d / "status").read_text() if d.name.isdigit() else ""
        except OSError:
            continue
        uid = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("Uid:")), 0)
        if uid >= sandbox.Isolation().uid_base and "\nState:\tZ" not in status:
            out.append(int(d.name))
    return out


def test_metrics_link_to_a_grove_file_is_not_read(tmp_path: Path) -> None:
    secret = tmp_path / "up.json"
    secret.write_text('{"score": 99, "token": "grove_must_not_leak"}')
    tree = tmp_path / "tree"
    tree.mkdir()
    for iso in (sandbox.Isolation(), sandbox.Isolation(mode="none")):
        r = evaluation.evaluate(
            kind="dev", command=f'ln -s {secret} "$GROVE_METRICS_FILE"; echo \'{{"score": 1}}\'', worktree=tree,
            output_dir=tmp_path / "out", seed=0, metric="score", commit="c", limits=sandbox.Limits(timeout=30),
            evaluator_fingerprint="", isolation=iso,
        )  # fmt: skip
        assert r.ok and r.metrics == {"score": 1}, (iso, r)
        assert "grove_must_not_leak" not in str(r.to_dict())


def test_repository_links_to_host_files_resolve_to_nothing(settings: Settings, tmp_path: Path) -> None:
    from agents.executor.tools import Toolbox

    secret = tmp_path / "host-secret.txt"
    secret.write_text(SEALED)
    origin = make_repo(tmp_path / "origin", {"eval.py": "print(1)\n"})
    os.symlink(secret, origin / "leak.txt")
    subprocess.run(["git", "add", "leak.txt"], cwd=origin, check=True)
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "link"], cwd=origin, check=True
    )
    repo = gitops.clone(str(origin), settings.data_dir / "repos" / "links")
    tree = workspace.prepare(repo, tmp_path / "wt", "b", repo.rev("main"), sealed=None, reason="t")
    assert (tree / "leak.txt").is_symlink()
    res = box("cat leak.txt; echo done", tree)
    assert SEALED not in seen(res) and "No such file" in res.stderr_tail
    tools = Toolbox(root=tree, editable=["*"], runtime=_NoRuntime())
    assert tools.call("read", {"path": "leak.txt"}).startswith("refused")
    assert tools.call("grep", {"pattern": "SEALED"}) == "no matches"
    assert tools.call("write", {"path": "leak.txt", "content": "x"}).startswith("refused")
    assert secret.read_text() == SEALED


class _NoRuntime:
    def run(self, command: str, timeout: float) -> tuple[int | None, str]:
        raise AssertionError("not used")

    def evaluate_dev(self) -> Observation:
        raise AssertionError("not used")


def test_nested_repository_config_cannot_run_a_program_in_groves_git(
    settings: Settings, tmp_path: Path
) -> None:
    repo, tree = dev_tree(settings, tmp_path)
    marker = Path(f"/tmp/grove-fsmonitor-{uuid.uuid4().hex}")
    nested = (
        f"git init -q sub && git -C sub config core.fsmonitor 'touch {marker}; false' && "
        f"git -C sub config filter.x.clean 'sh -c \"touch {marker}; cat\"' && echo '* filter=x' > sub/.gitattributes && "
        "echo m > sub/f && git -C sub add f && git -C sub -c user.name=x -c user.email=x@x commit -qm x && "
        "echo changed > sub/f && mkfifo pipe && python -c \"import socket; socket.socket(socket.AF_UNIX).bind('sock')\" && "
        "echo ok"
    )
    res = box(nested, tree)
    assert res.ok and "ok" in res.stdout_tail, res.stderr_tail
    # After the box: no nested repository, FIFO or socket is left for Grove's own tools and git.
    assert not (tree / "sub" / ".git").exists() and (tree / "sub" / "f").exists()
    assert not (tree / "pipe").exists() and not (tree / "sock").exists()
    assert repo.commit_all(tree, "an executor's change") is not None
    for args in (("status",), ("diff", "HEAD~1"), ("add", "-A")):
        gitops.git(*args, cwd=tree, check=False)
    assert not marker.exists()

    # The same nested repository, built outside a box, does run its program under git: the attack
    # is real, and what stops it is that no nested repository survives a box.
    outside = tmp_path / "outside"
    outside.mkdir()
    subprocess.run(
        ["sh", "-c", nested.replace("mkfifo pipe", "true")], cwd=outside, check=True, capture_output=True
    )
    marker.unlink(missing_ok=True)
    gitops.git("add", "-A", cwd=outside / "sub", check=False)
    try:
        assert marker.exists()
    finally:
        marker.unlink(missing_ok=True)


def test_grep_tool_survives_a_catastrophic_pattern(tmp_path: Path) -> None:
    from agents.executor.tools import Toolbox

    (tmp_path / "a.txt").write_text("a" * 60 + "!\n")
    tools = Toolbox(root=tmp_path, editable=["*"], runtime=_NoRuntime())
    assert "grep stopped: the pattern took over" in tools.call("grep", {"pattern": "(a|aa)+$"})
    assert tools.call("grep", {"pattern": "a!$"}).startswith("a.txt:1:")


def test_a_metrics_line_after_50_mb_of_output_is_found(tmp_path: Path) -> None:
    r = evaluation.evaluate(
        kind="dev", worktree=tmp_path, output_dir=tmp_path / "out", seed=0, metric="score", commit="c",
        command="python -c \"import sys; sys.stdout.write('x' * 50_000_000 + chr(10)); print('{\\\"score\\\": 2}')\"",
        limits=sandbox.Limits(timeout=60), evaluator_fingerprint="",
    )  # fmt: skip
    assert r.ok and r.metrics == {"score": 2}, r.reason
    assert Path(r.stdout_path).stat().st_size < 6_000_000


def test_namespaces_mounts_and_keyrings_are_denied_inside_the_box(tmp_path: Path) -> None:
    probe = (
        "import ctypes, os, subprocess, threading\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "def try_(name, fn):\n"
        "    try:\n"
        "        fn(); print(name, 'ALLOWED')\n"
        "    except (OSError, subprocess.CalledProcessError) as exc:\n"
        "        print(name, 'denied', exc)\n"
        "def call(nr, *args):\n"
        "    if libc.syscall(nr, *args) == -1:\n"
        "        raise OSError(ctypes.get_errno(), 'denied')\n"
        "def check(rc):\n"
        "    if rc == -1:\n"
        "        raise OSError(ctypes.get_errno(), 'denied')\n"
        "try_('unshare-user', lambda: check(libc.unshare(0x10000000)))\n"
        "try_('unshare-mount', lambda: check(libc.unshare(0x00020000)))\n"
        "keyring = {'x86_64': 248, 'aarch64': 217}[os.uname().machine]\n"
        "try_('add-key', lambda: call(keyring, b'user', b'grove-leak', b'secret', 6, -2))\n"
        "try_('unshare-cmd', lambda: subprocess.run(['unshare', '-Ur', 'true'], check=True, capture_output=True))\n"
        "clone, clone3 = {'x86_64': (56, 435), 'aarch64': (220, 435)}[os.uname().machine]\n"
        "def fork_into_new_user_namespace():\n"
        "    rc = libc.syscall(clone, 0x10000000 | 17, 0, 0, 0, 0)  # CLONE_NEWUSER | SIGCHLD\n"
        "    if rc == 0:\n"
        "        os._exit(0)\n"
        "    if rc > 0:\n"
        "        os.waitpid(rc, 0)\n"
        "    check(rc)\n"
        "try_('clone-new-user', fork_into_new_user_namespace)\n"
        "libc.syscall(clone3, 0, 0); print('clone3 errno', ctypes.get_errno())\n"
        "try_('ptrace-wrapper', lambda: check(libc.ptrace(16, 2, 0, 0)))  # PTRACE_ATTACH to the stray counter\n"
        "pidfd = libc.syscall(434, os.getpid(), 0)  # pidfd_open: allowed\n"
        "try_('pidfd-getfd', lambda: call(438, pidfd, 1, 0))  # another process's descriptor (here its own)\n"
        "params = ctypes.create_string_buffer(120)\n"
        "try_('io-uring', lambda: call(425, 1, params))\n"
        "import socket\n"
        "try_('vsock', lambda: socket.socket(40, socket.SOCK_STREAM).close())  # AF_VSOCK: to the hypervisor\n"
        "t = threading.Thread(target=lambda: None); t.start(); t.join(); print('threads ok')\n"
        "print(subprocess.run(['echo', 'children ok'], capture_output=True, text=True).stdout.strip())\n"
        "socket.socket(socket.AF_UNIX).close(); socket.socket(socket.AF_INET).close(); print('sockets ok')\n"
    )
    (tmp_path / "probe.py").write_text(probe)
    res = box("python probe.py", tmp_path)
    out = res.stdout_tail
    assert res.ok, res.stderr_tail
    assert "ALLOWED" not in out and out.count("denied") >= 8, out
    assert "pidfd-getfd denied [Errno 1]" in out, out
    assert "vsock denied [Errno 1]" in out, out  # EPERM from the filter, not a host without vsock
    assert "clone3 errno 38" in out  # ENOSYS: the C library falls back to clone, whose flags are checked
    assert "threads ok" in out and "children ok" in out and "sockets ok" in out


def test_sealed_files_cannot_be_swapped_in_a_sealed_run(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "labels.csv").write_text("REAL\n")
    (tmp_path / "top.csv").write_text("REAL\n")
    res = sandbox.run(
        "echo FAKE > data/labels.csv; mv data data_old; mkdir -p data && echo FAKE > data/labels.csv;"
        "echo FAKE > top.csv; mv top.csv x.csv; rm -f top.csv; echo FAKE > data/new.csv; cat data/labels.csv top.csv",
        cwd=tmp_path,
        output_dir=tmp_path.parent / "o-swap",
        readonly=("data/labels.csv", "top.csv"),
    )
    assert res.stdout_tail.split() == ["REAL", "REAL"], res.stdout_tail + res.stderr_tail
    assert (tmp_path / "data" / "labels.csv").read_text() == "REAL\n" and not (tmp_path / "data_old").exists()


def test_one_attempts_commands_share_one_disk_budget(tmp_path: Path) -> None:
    start = sandbox.usage(tmp_path)
    for i in range(3):
        res = sandbox.run(
            f"head -c 3000000 /dev/zero > f{i}; sleep 2", cwd=tmp_path, output_dir=tmp_path.parent / f"o-disk{i}",
            limits=sandbox.Limits(timeout=30, disk_mb=5), disk_base=start,
        )  # fmt: skip
        assert res.disk_exceeded == (i >= 1), (i, res.stderr_tail)


def test_a_tree_too_deep_for_recursive_walks_is_cut_back_after_the_box(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "keep.txt").write_text("k")
    res = box(
        "python -c \"import os\nfor _ in range(1500):\n    os.mkdir('d'); os.chdir('d')\n"
        "os.mkdir('.git'); os.mkfifo('pipe')\"; echo made",
        tree,
    )
    try:
        assert res.ok and "made" in res.stdout_tail, res.stderr_tail
        # Past MAX_DEPTH the folder went; what is left is shallow enough for any walk.
        depth = 0
        d = tree
        while (d / "d").is_dir():
            d, depth = d / "d", depth + 1
        assert depth < sandbox.MAX_DEPTH and (tree / "keep.txt").read_text() == "k"
        evaluation.fingerprint(tree, ["**"])
        if os.geteuid() == 0:
            assert all(p.stat().st_uid == 0 for p in [tree, tree / "d", d])
    finally:
        subprocess.run(["rm", "-rf", str(tree)], check=False)


def test_the_trees_git_link_cannot_be_read_removed_or_replaced(settings: Settings, tmp_path: Path) -> None:
    repo, tree = dev_tree(settings, tmp_path)
    pwned = Path(f"/tmp/grove-pwned-{uuid.uuid4().hex}")
    takeover = (
        "cat .git; rm -f .git; echo x > .git; mv .git g2; ln -f model.txt .git;"
        "git init -q x && mv x/.git stash; "
        f"git --git-dir=stash config filter.x.clean 'sh -c \"touch {pwned}; cat\"';"
        "echo '* filter=x' > .gitattributes; printf 'gitdir: stash\\n' > gf; ln -f gf .git;"
        "git init -q --bare b; mv b/* . 2>/dev/null; echo changed > model.txt; echo done"
    )
    res = box(takeover, tree)
    assert "done" in res.stdout_tail and str(repo.path) not in seen(res), res.stdout_tail + res.stderr_tail
    assert (tree / ".git").read_text().startswith("gitdir: ") and (tree / ".git").stat().st_nlink == 1
    repo.commit_all(tree, "after the takeover attempt")
    for args in (("status",), ("add", "-A"), ("diff", "HEAD")):
        gitops.git(*args, cwd=tree, check=False)
    assert not pwned.exists()


def test_hard_links_cannot_reach_a_read_only_file_in_a_later_run(tmp_path: Path) -> None:
    (tmp_path / "eval.py").write_text("REAL\n")
    res = box("mkdir -p __pycache__ && ln eval.py __pycache__/e && echo linked", tmp_path)
    assert "linked" in res.stdout_tail, res.stderr_tail
    assert (tmp_path / "eval.py").stat().st_nlink == 1  # the link was broken after the box
    later = sandbox.run(
        "echo FAKE > __pycache__/e; echo FAKE > eval.py; cat eval.py",
        cwd=tmp_path, output_dir=tmp_path.parent / "o-hard", readonly=("eval.py",),
    )  # fmt: skip
    assert later.stdout_tail.strip() == "REAL" and (tmp_path / "eval.py").read_text() == "REAL\n"


def test_hard_links_to_a_sparse_file_cannot_make_grove_fill_the_disk(tmp_path: Path) -> None:
    make = (
        "truncate -s 200M big && echo data >> big && for i in $(seq 1 50); do ln big link$i; done; echo made"
    )
    res = box(make, tmp_path, disk_mb=20)
    assert "made" in res.stdout_tail, res.stderr_tail
    left = [p for p in tmp_path.iterdir() if p.name == "big" or p.name.startswith("link")]
    # Every name left is a file of its own, the data kept, and breaking the links wrote next to nothing.
    assert left and all(p.stat().st_nlink == 1 for p in left)
    assert all(p.stat().st_size == 200 * 1024 * 1024 + 5 for p in left)
    assert sandbox.usage(tmp_path) < 20 * 1024 * 1024
    with open(left[0], "rb") as fh:
        fh.seek(200 * 1024 * 1024)
        assert fh.read() == b"data\n"


@pytest.mark.parametrize(
    ("name", "levels", "disk_mb", "note"),
    [
        ("d" * 250, 20, 5, ""),  # past the path length limit: the walk goes by descriptors
        # Deeper than the walk could hold a descriptor per level (1024 is a common limit): the run
        # is stopped for its nesting, not let write below what the walk can count.
        ("d", 1100, 100, f"more than {sandbox.MAX_DEPTH} levels deep"),
    ],
)
def test_the_disk_cap_counts_files_past_path_and_descriptor_limits(
    tmp_path: Path, name: str, levels: int, disk_mb: int, note: str
) -> None:
    deep = f"python -c \"import os\nfor i in range({levels}):\n    os.mkdir('{name}'); os.chdir('{name}')\n"
    deep += "open('big', 'wb').write(bytes(20 * 1024 * 1024))\nimport time; time.sleep(60)\""
    res = box(deep, tmp_path, disk_mb=disk_mb, timeout=120)  # only the disk watch ends the run in time
    try:
        assert res.disk_exceeded and not res.timed_out, res.stderr_tail
        assert note in res.stderr_tail
    finally:
        subprocess.run(["rm", "-rf", str(tmp_path / name)], check=False)


CLOSED_FOLDER = """
import os, sys
from pathlib import Path
from backend.engine import sandbox
from backend.engine.sandbox import disk
root = Path(sys.argv[1])
(root / "ev").mkdir()
(root / "ev" / "eval.py").write_text("REAL")
(root / "d").mkdir()
(root / "d" / "data").write_bytes(bytes(1 << 20))
os.link(root / "ev" / "eval.py", root / "d" / "e")
os.chmod(root / "d", 0)
os.chmod(root / "ev", 0)  # neither name of the evaluator's file can be reached by a walk
print("uncounted", sandbox.usage(root) >= sandbox.TOO_DEEP)
disk._reclaim(root, None)
print("unlinked", os.stat(root / "ev" / "eval.py").st_nlink == 1)
"""


def test_a_folder_closed_to_its_owner_is_neither_uncounted_nor_left_linked(tmp_path: Path) -> None:
    # Where Grove runs as an ordinary user, a box's files are its own, and `chmod 000` stops its
    # own walks: the disk watch must not go blind, nor a hard link to an evaluator survive.
    tree = Path(tempfile.mkdtemp(prefix="grove-closed-"))
    try:
        as_user: list[str] = []
        if os.geteuid() == 0:
            os.chown(tree, 65534, 65534)
            as_user = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
        out = subprocess.run(
            [*as_user, sys.executable, "-c", CLOSED_FOLDER, str(tree)], cwd=PROJECT_ROOT,
            env={"PATH": os.environ["PATH"], "PYTHONPATH": str(PROJECT_ROOT)}, capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert "uncounted True" in out.stdout and "unlinked True" in out.stdout, out.stdout
    finally:
        subprocess.run(["chmod", "-R", "u+rwx", str(tree)], check=False)
        shutil.rmtree(tree, ignore_errors=True)


def test_a_command_that_kills_its_wrapper_and_watcher_leaves_nothing(tmp_path: Path) -> None:
    marker = f"51{uuid.uuid4().int % 10**6}"
    # Kill every process of the box but pid 1, itself and its sleep: the wrapper and the watcher go,
    # and bwrap exits with the wrapper, leaving the box's pid 1 and the rest behind.
    attack = (
        f"sleep {marker} & s=$!; for p in /proc/[0-9]*; do i=${{p#/proc/}}; "
        '[ "$i" != 1 ] && [ "$i" != $$ ] && [ "$i" != "$s" ] && kill -9 "$i" 2>/dev/null; done; wait'
    )
    started = time.monotonic()
    res = box(attack, tmp_path, timeout=60)
    assert time.monotonic() - started < 30 and res.strays is None  # the wrapper never reported
    wait_for(lambda: not _alive_with(f"sleep {marker}"), timeout=5)


def test_a_command_that_kills_its_watcher_still_ends_at_its_time_limit(tmp_path: Path) -> None:
    marker = f"52{uuid.uuid4().int % 10**6}"
    # pid 1 is bwrap's, 2 the wrapper, 3 the watcher: the lifeline then has nobody to act on it.
    attack = (
        f"sleep {marker} & s=$!; for p in /proc/[0-9]*; do i=${{p#/proc/}}; "
        '[ "$i" != 1 ] && [ "$i" != 2 ] && [ "$i" != $$ ] && [ "$i" != "$s" ] && kill -9 "$i" 2>/dev/null; '
        "done; wait"
    )
    started = time.monotonic()
    res = box(attack, tmp_path, timeout=2)
    assert res.timed_out and time.monotonic() - started < 30
    wait_for(lambda: not _alive_with(f"sleep {marker}"), timeout=5)
