"""A run's limits, the machine's isolation settings, a run's result, and the environment a box gets."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from agents.failures import NoEvidence

SAFE_ENV = (
    "PATH", "LANG", "LANGUAGE", "TERM", "TZ", "VIRTUAL_ENV", "PYTHONHASHSEED",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OPENBLAS_CORETYPE",
    "OPENBLAS_L2_SIZE", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "LD_LIBRARY_PATH",
)  # fmt: skip


SECRET = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH)", re.IGNORECASE)


# Where a box sees its tree, its exchange folder, its environment and its scratch folder.
TREE = "/grove/tree"
OUT = "/grove/out"
ENV = "/grove/env"
SCRATCH = "/grove/scratch"


class SandboxUnavailable(RuntimeError, NoEvidence):
    """This machine cannot create the namespaces the sandbox needs."""


@dataclass(frozen=True)
class Limits:
    timeout: float = 600.0
    cpu_seconds: int | None = None
    memory_mb: int | None = 4096
    file_size_mb: int | None = 1024
    processes: int | None = 512
    disk_mb: int | None = 2048  # bytes the command may add to its tree and exchange folder
    tmp_mb: int = 512  # size of the private /tmp
    network: bool = False


class Boxing(StrEnum):
    """Whether commands run in bubblewrap's namespaces or, on a machine without them, unboxed."""

    BWRAP = "bwrap"
    NONE = "none"


@dataclass(frozen=True)
class Isolation:
    """How commands are boxed on this machine (from Grove's settings, never from a spec)."""

    mode: Boxing = Boxing.BWRAP
    bwrap: str = "bwrap"
    binds: tuple[str, ...] = ()  # extra read-only paths (a toolchain outside /usr)
    passthrough: tuple[str, ...] = ()  # extra variable names a box gets (never secret-looking ones)
    network: bool = True  # whether a run whose limits ask for the network may have it
    uid_base: int = 200_000
    uid_slots: int = 1000
    # A study's evaluation environment (`environment.py`): mounted at /grove/env with its `bin/`
    # first on PATH; writable only while its setup builds it.
    env_dir: str = ""
    env_writable: bool = False
    # A writable scratch folder mounted at /grove/scratch (an environment setup's TMPDIR and HOME).
    scratch_dir: str = ""

    def env_path(self) -> str:
        """Return where a command sees the environment: /grove/env in a box, else its real folder."""
        return ENV if self.boxed else self.env_dir

    def scratch_path(self) -> str:
        """Return where a command sees the scratch folder: /grove/scratch in a box, else its real folder."""
        return SCRATCH if self.boxed else self.scratch_dir

    def writable(self) -> list[Path]:
        """Return the folders besides the tree a command may write: the env while it builds, the scratch."""
        return [Path(p) for p in (self.env_dir if self.env_writable else "", self.scratch_dir) if p]

    @property
    def boxed(self) -> bool:
        """Return whether commands run in namespaces."""
        return self.mode != Boxing.NONE


@dataclass
class Result:
    command: str
    exit_code: int | None
    duration: float
    timed_out: bool
    stdout_path: Path
    stderr_path: Path
    stdout_tail: str
    stderr_tail: str
    truncated: bool = False
    signal: int | None = None
    stdout_bytes: int = field(default=0)
    strays: int | None = None  # processes still running when the command ended (all were killed)
    disk_exceeded: bool = False
    exchange: dict[str, bytes] = field(default_factory=dict)  # files collected from /grove/out

    @property
    def ok(self) -> bool:
        """Return whether the command exited 0 within its time and limits."""
        return self.exit_code == 0 and not self.timed_out and not self.disk_exceeded


def scrubbed_env(extra: Mapping[str, str] | None = None, passthrough: tuple[str, ...] = ()) -> dict[str, str]:
    """Return an environment of safe variables only: no API keys, tokens or Grove secrets."""
    env = {k: os.environ[k] for k in (*SAFE_ENV, *passthrough) if k in os.environ}
    env.update({k: v for k, v in os.environ.items() if k.startswith("LC_")})
    env = {k: v for k, v in env.items() if not SECRET.search(k) and not k.startswith("GROVE_")}
    # `python` in an evaluation command means the interpreter Grove runs under, venv included.
    bindir = str(Path(sys.executable).parent)
    path = env.get("PATH", "/usr/local/bin:/usr/bin:/bin").split(os.pathsep)
    env["PATH"] = os.pathsep.join([bindir, *(p for p in path if p != bindir)])
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.update(extra or {})
    return env
