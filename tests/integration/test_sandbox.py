from __future__ import annotations

import os
from pathlib import Path

from backend.engine import sandbox
from tests.conftest import wait_for


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state


def test_timeout_kills_the_whole_group_including_grandchildren(tmp_path: Path) -> None:
    res = sandbox.run(
        "sleep 300 & echo $! > grandchild.pid; sleep 300",
        cwd=tmp_path,
        output_dir=tmp_path / "out",
        limits=sandbox.Limits(timeout=1.0),
    )
    assert res.timed_out and res.exit_code is None and not res.ok
    pid = int((tmp_path / "grandchild.pid").read_text())
    wait_for(lambda: not alive(pid), timeout=10)


def test_memory_hog_is_stopped(tmp_path: Path) -> None:
    res = sandbox.run(
        ["python3", "-c", "x = bytearray(2 * 1024**3); print('allocated')"],
        cwd=tmp_path,
        output_dir=tmp_path / "out",
        limits=sandbox.Limits(timeout=30, memory_mb=256),
    )
    assert res.exit_code != 0
    assert "MemoryError" in res.stderr_tail
    assert "allocated" not in res.stdout_tail


def test_cpu_limit_kills_a_spinning_process(tmp_path: Path) -> None:
    res = sandbox.run(
        ["python3", "-c", "while True: pass"],
        cwd=tmp_path,
        output_dir=tmp_path / "out",
        limits=sandbox.Limits(timeout=60, cpu_seconds=1),
    )
    assert not res.timed_out and res.signal is not None  # SIGXCPU or SIGKILL from RLIMIT_CPU


def test_environment_is_scrubbed(tmp_path: Path) -> None:
    os.environ["OPENAI_API_KEY"] = "sk-secret-1"
    os.environ["GROVE_ADMIN_TOKEN"] = "grove-secret-2"
    os.environ["MY_SERVICE_PASSWORD"] = "pw-secret-3"
    try:
        res = sandbox.run("env; pwd", cwd=tmp_path, output_dir=tmp_path / "out", env={"GROVE_SEED": "4"})
    finally:
        for k in ("OPENAI_API_KEY", "GROVE_ADMIN_TOKEN", "MY_SERVICE_PASSWORD"):
            del os.environ[k]
    out = res.stdout_path.read_text()
    assert res.ok
    for secret in ("sk-secret-1", "grove-secret-2", "pw-secret-3", "OPENAI_API_KEY"):
        assert secret not in out
    assert "GROVE_SEED=4" in out
    assert out.strip().endswith(str(tmp_path))


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
    import sys

    res = sandbox.run(
        "python -c 'import sys; print(sys.executable)'", cwd=tmp_path, output_dir=tmp_path / "o"
    )
    assert res.ok and Path(res.stdout_tail.strip()).parent == Path(sys.executable).parent
