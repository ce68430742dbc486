from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from backend.engine import sandbox
from backend.engine.sandbox import process
from tests.support.waiting import wait_for

BOXED = sandbox.Isolation()
NONE = sandbox.Isolation(mode="none")


def host_processes_with(marker: str) -> list[int]:
    """Return host pids whose command line holds `marker` (zombies excluded)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (d / "status").read_text()
        except OSError:
            continue
        if marker in cmd and "\nState:\tZ" not in state:
            found.append(int(d.name))
    return found


@pytest.mark.parametrize("iso", [BOXED, NONE], ids=["bwrap", "none"])
def test_timeout_kills_every_process_of_the_run(tmp_path: Path, iso: sandbox.Isolation) -> None:
    marker = f"30{uuid.uuid4().int % 10**6}"
    res = sandbox.run(
        f"sleep {marker} & sleep {marker}",
        cwd=tmp_path,
        output_dir=tmp_path / "out",
        limits=sandbox.Limits(timeout=1.0),
        isolation=iso,
    )
    assert res.timed_out and res.exit_code is None and not res.ok
    wait_for(lambda: not host_processes_with(f"sleep {marker}"), timeout=10)


def test_detached_children_die_with_the_box_and_the_receipt_says_so(tmp_path: Path) -> None:
    marker = f"40{uuid.uuid4().int % 10**6}"
    res = sandbox.run(
        f"setsid sleep {marker} & (setsid sh -c 'sleep {marker}' &) ; echo started",
        cwd=tmp_path,
        output_dir=tmp_path / "out",
        limits=sandbox.Limits(timeout=30),
    )
    # Two sleeps at least (a shell may still stand between the second and its sleep).
    assert res.ok and res.strays is not None and res.strays >= 2
    note = f"{res.strays} process(es) were still running"
    assert note in res.stderr_tail and note in res.stderr_path.read_text()
    assert not host_processes_with(f"sleep {marker}")


@pytest.mark.parametrize("iso", [BOXED, NONE], ids=["bwrap", "none"])
def test_memory_hog_is_stopped(tmp_path: Path, iso: sandbox.Isolation) -> None:
    res = sandbox.run(
        ["python3", "-c", "x = bytearray(2 * 1024**3); print('allocated')"],
        cwd=tmp_path,
        output_dir=tmp_path / "out",
        limits=sandbox.Limits(timeout=30, memory_mb=256),
        isolation=iso,
    )
    assert res.exit_code != 0
    assert "MemoryError" in res.stderr_tail
    assert "allocated" not in res.stdout_tail


@pytest.mark.parametrize("iso", [BOXED, NONE], ids=["bwrap", "none"])
def test_cpu_limit_kills_a_spinning_process(tmp_path: Path, iso: sandbox.Isolation) -> None:
    res = sandbox.run(
        ["python3", "-c", "while True: pass"],
        cwd=tmp_path,
        output_dir=tmp_path / "out",
        limits=sandbox.Limits(timeout=60, cpu_seconds=1),
        isolation=iso,
    )
    assert not res.timed_out and res.signal is not None  # SIGXCPU or SIGKILL from RLIMIT_CPU


@pytest.mark.parametrize("iso", [BOXED, NONE], ids=["bwrap", "none"])
def test_environment_is_scrubbed(tmp_path: Path, iso: sandbox.Isolation) -> None:
    os.environ["OPENAI_API_KEY"] = "sk-secret-1"
    os.environ["GROVE_ADMIN_TOKEN"] = "grove-secret-2"
    os.environ["MY_SERVICE_PASSWORD"] = "pw-secret-3"
    try:
        res = sandbox.run(
            "env; pwd", cwd=tmp_path, output_dir=tmp_path / "out", env={"GROVE_SEED": "4"}, isolation=iso
        )
    finally:
        for k in ("OPENAI_API_KEY", "GROVE_ADMIN_TOKEN", "MY_SERVICE_PASSWORD"):
            del os.environ[k]
    out = res.stdout_path.read_text()
    assert res.ok
    for secret in ("sk-secret-1", "grove-secret-2", "pw-secret-3", "OPENAI_API_KEY"):
        assert secret not in out
    assert "GROVE_SEED=4" in out
    assert out.strip().endswith(sandbox.TREE if iso.boxed else str(tmp_path))


def test_output_is_stored_capped_with_a_tail(tmp_path: Path) -> None:
    res = sandbox.run(
        ["python3", "-c", "import sys; sys.stdout.write('a' * 300000 + 'THE-END')"],
        cwd=tmp_path,
        output_dir=tmp_path / "out",
        output_cap=100_000,
        tail_bytes=100,
    )
    assert res.ok and res.truncated
    stored = res.stdout_path.read_text()
    assert stored.startswith("a" * 1000) and "output truncated, 300007 bytes" in stored
    assert len(stored) < 100_200
    assert res.stdout_tail.endswith("THE-END") and len(res.stdout_tail) == 100


def test_python_is_groves_interpreter(tmp_path: Path) -> None:
    res = sandbox.run(
        "python -c 'import sys; print(sys.executable)'", cwd=tmp_path, output_dir=tmp_path / "o"
    )
    assert res.ok and Path(res.stdout_tail.strip()).parent == Path(sys.executable).parent


def test_the_tree_is_writable_and_stays_groves_after_the_run(tmp_path: Path) -> None:
    (tmp_path / "model.txt").write_text("old")
    res = sandbox.run(
        "cat model.txt && echo && echo new > model.txt && mkdir -p sub && echo x > sub/made.txt && id -u",
        cwd=tmp_path,
        output_dir=tmp_path / "o",
    )
    assert res.ok, res.stderr_tail
    assert res.stdout_tail.startswith("old")
    if os.geteuid() == 0:
        assert int(res.stdout_tail.split()[-1]) >= BOXED.uid_base  # never root inside
    assert (tmp_path / "model.txt").read_text() == "new\n"
    for p in (tmp_path, tmp_path / "model.txt", tmp_path / "sub", tmp_path / "sub" / "made.txt"):
        assert p.stat().st_uid == os.geteuid()


def test_exchange_files_are_collected_but_links_are_not_followed(tmp_path: Path) -> None:
    secret = tmp_path.parent / f"grove-secret-{uuid.uuid4().hex}.json"
    secret.write_text('{"token": "must-not-leak"}')
    try:
        res = sandbox.run(
            f'echo \'{{"m": 1}}\' > "$OUT_DIR/good.json"; ln -s {secret} "$OUT_DIR/link.json"',
            cwd=tmp_path,
            output_dir=tmp_path / "o",
            env={"OUT_DIR": "{out}"},
            collect=("good.json", "link.json"),
            isolation=NONE,
        )
    finally:
        secret.unlink()
    assert res.ok
    assert res.exchange == {"good.json": b'{"m": 1}\n'}


def test_writing_past_the_disk_cap_stops_the_run(tmp_path: Path) -> None:
    res = sandbox.run(
        "for i in $(seq 100); do head -c 1048576 /dev/zero > f$i; done; sleep 30",
        cwd=tmp_path,
        output_dir=tmp_path / "o",
        limits=sandbox.Limits(timeout=60, disk_mb=5),
    )
    assert res.disk_exceeded and not res.ok and not res.timed_out
    assert "wrote more than 5 MB" in res.stderr_tail


def test_private_tmp_is_size_capped(tmp_path: Path) -> None:
    res = sandbox.run(
        "head -c 8388608 /dev/zero > /tmp/big",
        cwd=tmp_path,
        output_dir=tmp_path / "o",
        limits=sandbox.Limits(timeout=30, tmp_mb=2),
    )
    assert res.exit_code != 0 and "No space left" in res.stderr_tail


def test_check_refuses_a_machine_without_bubblewrap() -> None:
    with pytest.raises(sandbox.SandboxUnavailable, match=r"apt install bubblewrap.*GROVE_SANDBOX=none"):
        sandbox.check(sandbox.Isolation(bwrap="/nonexistent/bwrap"))
    sandbox.check(BOXED)


def test_a_worker_warms_the_check_with_a_success_only(tmp_path: Path) -> None:
    real = subprocess.run(["sh", "-c", "command -v bwrap"], capture_output=True, text=True).stdout.strip()
    bwrap = tmp_path / "bwrap"
    refuse = "#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n"
    bwrap.write_text(refuse)
    bwrap.chmod(0o755)
    iso = sandbox.Isolation(bwrap=str(bwrap))
    sandbox.warm(iso)  # boxes cannot be made now: nothing is kept
    bwrap.write_text(f'#!/bin/sh\nexec {real} "$@"\n')  # the operator fixed the machine
    sandbox.check(iso)  # tested again, and kept
    bwrap.write_text(refuse)
    sandbox.check(iso)  # the success is what later jobs see


def test_an_interpreter_under_the_hosts_tmp_still_runs_in_the_box(tmp_path: Path) -> None:
    # CI clones the project (and its venv) under /tmp; the box's own /tmp must not hide it.
    venv = tmp_path / "venv"
    import venv as venv_module

    venv_module.create(venv, with_pip=False, symlinks=True)
    res = sandbox.run(
        [str(venv / "bin" / "python"), "-c", "import sys; print(sys.prefix)"],
        cwd=tmp_path,
        output_dir=tmp_path / "o",
        isolation=sandbox.Isolation(binds=(str(venv),)),
    )
    assert res.ok, res.stderr_tail
    assert res.stdout_tail.strip() == str(venv)


def test_killing_the_wrapper_is_noted_and_still_ends_everything(tmp_path: Path) -> None:
    marker = f"60{uuid.uuid4().int % 10**6}"
    res = sandbox.run(f"setsid sleep {marker} & kill -9 $PPID", cwd=tmp_path, output_dir=tmp_path / "out")
    assert res.strays is None and "wrapper was killed" in res.stderr_tail
    assert not host_processes_with(f"sleep {marker}")


def test_a_run_is_reaped_through_a_pidfd_the_moment_it_exits(tmp_path: Path) -> None:
    import subprocess

    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    fd = process._pidfd(proc.pid)
    assert fd is not None, "this Linux offers pidfds, so runs must not fall back to polling"
    try:
        assert not process._ended(fd, 0.05)
        with pytest.raises(subprocess.TimeoutExpired):
            process._wait(proc, 0.05, fd)
        assert proc.stdin is not None
        proc.stdin.close()
        process._wait(proc, 30, fd)
        assert proc.returncode == 0
    finally:
        os.close(fd)
        proc.kill()
        proc.wait()


def test_a_boxed_run_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    iso = BOXED  # (unboxed, only the shell dies with it: GROVE_SANDBOX=none is for trusted code)
    marker = f"31{uuid.uuid4().int % 10**6}"
    script = (  # the marker comes through the environment: the runner's own command line must not hold it
        "import os; from pathlib import Path; from backend.engine import sandbox\n"
        "sandbox.run('sleep ' + os.environ['MARK'], cwd=Path(os.environ['TREE']), output_dir=Path(os.environ['OUT']),\n"
        "            limits=sandbox.Limits(timeout=600), isolation=sandbox.Isolation(mode=os.environ['MODE']))\n"
    )
    env = {
        **os.environ,
        "MARK": marker,
        "TREE": str(tmp_path),
        "OUT": str(tmp_path / "out"),
        "MODE": iso.mode,
    }
    runner = subprocess.Popen(
        [sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[2], env=env
    )
    try:
        wait_for(lambda: host_processes_with(f"sleep {marker}"), timeout=30)
        assert runner.poll() is None
        runner.send_signal(signal.SIGKILL)  # a worker killed: no timeout will watch the box any more
        runner.wait(timeout=10)
        wait_for(lambda: not host_processes_with(f"sleep {marker}"), timeout=10)
    finally:
        runner.kill()
        for pid in host_processes_with(f"sleep {marker}"):
            os.kill(pid, signal.SIGKILL)


def test_a_box_dies_with_the_process_that_started_it_even_while_it_starts(tmp_path: Path) -> None:
    # Killed within milliseconds of starting the box: before the lifeline, about one start in three
    # left the box running with nobody to end it; and with bubblewrap killed by a parent-death
    # signal while it set the box up, about one in thirty left the box's first process waiting.
    script = (  # a worker holds many descriptors: the lifeline gets a number above 9
        "import os; from pathlib import Path; from backend.engine import sandbox\n"
        "spare = [os.open('/dev/null', os.O_RDONLY) for _ in range(20)]\n"
        "sandbox.run('sleep ' + os.environ['MARK'], cwd=Path(os.environ['TREE']), output_dir=Path(os.environ['OUT']),\n"
        "            limits=sandbox.Limits(timeout=600), isolation=sandbox.Isolation())\n"
    )
    markers = []
    try:
        for i in range(40):
            marker = f"32{uuid.uuid4().int % 10**6}"
            markers.append(marker)
            env = {**os.environ, "MARK": marker, "TREE": str(tmp_path), "OUT": str(tmp_path / f"out{i}")}
            runner = subprocess.Popen(
                [sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[2], env=env
            )
            # Its first process names the command: the box is being set up now.
            wait_for(lambda marker=marker: host_processes_with(f"sleep {marker}"), timeout=30, every=0.002)
            runner.send_signal(signal.SIGKILL)
            runner.wait(timeout=10)
        for marker in markers:
            wait_for(lambda marker=marker: not host_processes_with(f"sleep {marker}"), timeout=10)
    finally:
        for marker in markers:
            for pid in host_processes_with(f"sleep {marker}"):
                os.kill(pid, signal.SIGKILL)


def test_the_command_runs_as_given_whatever_descriptors_grove_holds(tmp_path: Path) -> None:
    spare = [os.open("/dev/null", os.O_RDONLY) for _ in range(20)]  # the box's lifeline gets a high number
    try:
        res = sandbox.run(
            'cat; echo "args $# $0"',
            cwd=tmp_path,
            output_dir=tmp_path / "out",
            limits=sandbox.Limits(timeout=60),
        )
    finally:
        for fd in spare:
            os.close(fd)
    # stdin is /dev/null (cat ends at once), nothing was added to the command, nothing complained
    assert res.ok and res.stdout_tail == "args 0 /bin/sh\n" and res.stderr_tail == "", res
    assert res.strays == 0


@pytest.mark.parametrize("iso", [BOXED, NONE], ids=["bwrap", "none"])
def test_a_run_cut_short_in_grove_leaves_no_process_and_no_descriptor(
    tmp_path: Path, iso: sandbox.Isolation
) -> None:
    """A worker's time limit raises inside the wait (a signal handler): the run is ended and closed all the same."""

    class CutShort(Exception):
        pass

    def cut(signum: int, frame: object) -> None:
        raise CutShort

    marker = f"31{uuid.uuid4().int % 10**6}"

    def interrupt_once_running() -> None:
        wait_for(lambda: bool(host_processes_with(f"sleep {marker}")), timeout=30)
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGUSR1)

    before = sorted(os.listdir("/proc/self/fd"))
    previous = signal.signal(signal.SIGUSR1, cut)
    try:
        sender = threading.Thread(target=interrupt_once_running)
        sender.start()
        with pytest.raises(CutShort):
            sandbox.run(
                f"sleep {marker}", cwd=tmp_path, output_dir=tmp_path / "out", limits=sandbox.Limits(timeout=120),
                isolation=iso,
            )  # fmt: skip
        sender.join()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    wait_for(lambda: not host_processes_with(f"sleep {marker}"), timeout=10)
    assert sorted(os.listdir("/proc/self/fd")) == before
