"""`--local-model`: a GGUF file that is not there, or not GGUF, is a clear error naming the setting."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from backend.core import localmodel
from backend.core.config import PROJECT_ROOT


@pytest.mark.parametrize("command", ["up", "run"])
def test_a_missing_or_foreign_gguf_file_stops_before_anything_starts(tmp_path: Path, command: str) -> None:
    text = tmp_path / "notes.gguf"
    text.write_text("not a model\n")
    env = {
        "GROVE_DATA_DIR": str(tmp_path / "data"),
        "GROVE_WORKTREES_DIR": str(tmp_path / "wt"),
        "PATH": "/usr/bin:/bin",
    }
    extra = [] if command == "up" else [str(tmp_path)]
    for path, words in ((tmp_path / "none.gguf", "does not exist"), (text, "is not a GGUF file")):
        done = subprocess.run(
            [sys.executable, "-m", "backend.cli.main", command, *extra, "--local-model-file", str(path)],
            cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        out = " ".join((done.stdout + done.stderr).split())
        assert done.returncode == 2, out
        assert "--local-model" in out and words in out, out
    assert not (tmp_path / "data" / "logs" / "local-model.log").exists()


def test_the_servers_settings_point_every_role_at_it_and_fit_its_context(tmp_path: Path) -> None:
    server = localmodel.LocalServer(
        subprocess.Popen(["true"]), "http://127.0.0.1:9/v1", tmp_path / "log", 4096
    )
    server.proc.wait()
    env = server.env()
    assert env["GROVE_MODEL"] == "openai/local" and env["GROVE_LLM_API_BASE"] == "http://127.0.0.1:9/v1"
    assert int(env["GROVE_LLM_MAX_INPUT_TOKENS"]) + int(env["GROVE_LLM_MAX_OUTPUT_TOKENS"]) == 4096
    assert not localmodel.models_answer("http://127.0.0.1:9/v1", timeout=1)


def test_the_server_dies_with_the_process_that_started_it_however_that_dies(tmp_path: Path) -> None:
    import os
    import select
    import signal

    parent = subprocess.Popen(
        [sys.executable, "-c",
         "import subprocess, sys; from backend.core.localmodel import _die_with_parent\n"
         "child = subprocess.Popen(['sleep', '600'], start_new_session=True, preexec_fn=_die_with_parent)\n"
         "print(child.pid, flush=True); sys.stdin.read()"],
        cwd=PROJECT_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    gone = os.pidfd_open(child)  # readable once the process ends (it is not our child to wait for)
    os.kill(child, 0)  # it runs, in a session of its own
    parent.send_signal(signal.SIGKILL)  # no atexit, no handler: only the kernel can stop it now
    parent.wait(timeout=30)
    ended, _, _ = select.select([gone], [], [], 30)
    os.close(gone)
    if not ended:
        os.kill(child, signal.SIGKILL)
        raise AssertionError("the server outlived the process that started it")
