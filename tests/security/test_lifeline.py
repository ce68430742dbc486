"""The box's lifeline stays Grove's: the command holds no copy of it and cannot open it again.

Grove's end of the lifeline is what ends a box when Grove's process dies. The command must hold
no descriptor of it (it used to keep the number Grove passed it at), and no process of the box
may become a second holder of Grove's end by opening a descriptor again through /proc/<pid>/fd:
where Grove runs as an ordinary user, the box's uid is Grove's own, and a pipe could be opened
again that way, keeping the box alive after Grove's death.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from backend.core.config import PROJECT_ROOT
from tests.support.waiting import wait_for

# Runs in the box (a shell: the box may hold no Python where Grove runs as an ordinary user): list
# its own descriptors, then open every pipe and socket that a process of the box held when it
# started (but its own stdout and stderr) for writing, keeping each in a process of its own, and
# wait for $1 seconds.
PROBE = r"""
sh -c 'ls -l /proc/$PPID/fd'  # the shell holds nothing more (no pipe, no redirection) while ls looks
out=$(readlink /proc/$$/fd/1); err=$(readlink /proc/$$/fd/2)
pids=$(ls /proc | grep -E '^[0-9]+$')
for pid in $pids; do
  for p in /proc/$pid/fd/*; do
    t=$(readlink "$p") || continue
    case "$t" in pipe:*|socket:*) ;; *) continue ;; esac
    if [ "$t" != "$out" ] && [ "$t" != "$err" ] && (exec 9>"$p") 2>/dev/null; then
      sleep "$1" 9>"$p" &
      echo "reopened $p $t"
    fi
  done
done
echo probed
exec sleep "$1"
"""

# Runs as the Grove process: boxes PROBE with many descriptors open (the lifeline once got a high
# number), and prints what the box printed.
RUNNER = r"""
import os, sys
from pathlib import Path
from backend.engine import sandbox
spare = [os.open("/dev/null", os.O_RDONLY) for _ in range(20)]
tree = Path(sys.argv[1])
res = sandbox.run(["/bin/sh", "-c", sys.argv[2], "probe", sys.argv[3]], cwd=tree,
                  output_dir=tree.parent / "out", limits=sandbox.Limits(timeout=120))
print(res.stdout_tail, end="")
print(res.stderr_tail, file=sys.stderr, end="")
"""


@pytest.fixture(params=["root", "user"])
def grove_user(request: pytest.FixtureRequest) -> Iterator[tuple[list[str], Path]]:
    """Run the Grove process as root (the box drops to a leased uid) or as an ordinary user (a user namespace)."""
    if request.param == "root" and os.geteuid() != 0:
        pytest.skip("needs root: Grove then drops each box to a uid of its own")
    top = Path(tempfile.mkdtemp(prefix="grove-lifeline-"))
    (top / "tree").mkdir()
    as_user: list[str] = []
    if request.param == "user" and os.geteuid() == 0:
        for p in (top, top / "tree"):
            os.chown(p, 65534, 65534)
        as_user = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
    yield as_user, top / "tree"
    shutil.rmtree(top, ignore_errors=True)


def start(as_user: list[str], tree: Path, seconds: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*as_user, sys.executable, "-c", RUNNER, str(tree), PROBE, seconds], cwd=PROJECT_ROOT,
        env={"PATH": os.environ["PATH"], "PYTHONPATH": str(PROJECT_ROOT)}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def probing(marker: str) -> list[int]:
    """Return host pids of a box's probe that sleeps `marker` seconds (zombies excluded)."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
            if (
                d.name.isdigit()
                and marker.encode() in argv
                and "\nState:\tZ" not in (d / "status").read_text()
            ):
                found.append(int(d.name))
        except OSError:
            continue
    return found


def test_the_command_holds_no_copy_of_the_lifeline_and_cannot_open_it_again(
    grove_user: tuple[list[str], Path],
) -> None:
    as_user, tree = grove_user
    runner = start(as_user, tree, "0")
    out, err = runner.communicate(timeout=180)
    assert runner.returncode == 0, err
    assert "probed" in out, (out, err)
    own = {int(m[1]): m[2] for m in re.finditer(r" (\d+) -> (\S+)$", out, re.M)}
    # stdin is /dev/null, stdout and stderr Grove's capture pipes: nothing else, whatever Grove held.
    assert set(own) == {0, 1, 2} and own[0] == "/dev/null", out
    assert "reopened" not in out, out


def test_a_box_whose_command_grabs_every_descriptor_it_can_still_dies_with_grove(
    grove_user: tuple[list[str], Path],
) -> None:
    as_user, tree = grove_user
    marker = f"7{uuid.uuid4().int % 10**6}"
    runner = start(as_user, tree, marker)
    try:
        out = tree.parent / "out" / "run.stdout"
        wait_for(lambda: out.exists() and "probed" in out.read_text(), timeout=60)  # it holds what it got
        assert probing(marker)
        runner.send_signal(signal.SIGKILL)  # Grove's process dies: its end of the lifeline is closed
        runner.wait(timeout=10)
        wait_for(lambda: not probing(marker), timeout=10)
    finally:
        runner.kill()
        runner.wait(timeout=10)
        for pid in probing(marker):
            os.kill(pid, signal.SIGKILL)
