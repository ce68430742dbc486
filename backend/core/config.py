"""Service settings from `GROVE_*` environment variables."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

PROJECT_ROOT = Path(__file__).resolve().parents[2]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GROVE_", extra="ignore", populate_by_name=True)

    data_dir: Path = Path(".grove")
    worktrees_dir: Path = PROJECT_ROOT / "worktrees"
    database_url: str | None = None
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Longest an experiment may hold a worker; Redis redelivers unacked tasks after this.
    visibility_timeout: int = 12 * 3600
    # Added to a job's own time (evaluations, the executor's minutes) for its Celery hard time limit.
    task_margin_seconds: int = 300
    # Names of lab memories studies may share across repositories (`[memory] name`), comma-separated.
    memory_names: str = ""
    # Let GET endpoints answer without a token (mutations always need one).
    public_reads: bool = False
    # A job's lease in Redis; a job whose worker died is re-sent once its lease lapses.
    lease_seconds: float = 30.0
    reconcile_seconds: float = 15.0
    # Where `grove submit` finds the API (defaults to what `grove up` wrote in the data dir).
    api_url: str | None = None
    token: str | None = None
    # A worker on a machine without the database: it reaches the study's records and repository
    # through the API at `api_url` with this token (role `worker`).
    worker_token: str | None = None
    # On the API: a shared secret it accepts as a `worker` token (at least 32 characters), so a
    # deployment can hand its workers one GROVE_WORKER_TOKEN without issuing one first.
    fleet_token: str | None = None
    # How untrusted commands are boxed: "bwrap" (namespaces) or "none" (trusted local use only).
    sandbox: Literal["bwrap", "none"] = "bwrap"
    sandbox_bwrap: str = "bwrap"
    # Whether a spec's `[sandbox] network = true` is honoured (the box then shares the host's network).
    sandbox_network: bool = False
    # Whether environment setup boxes get this machine's package-index settings (pip.conf, PIP_*,
    # UV_*, CA bundle variables); values holding credentials in a URL never pass.
    setup_package_settings: bool = True
    # `grove janitor` removes environment builds no job has used for this many days.
    env_idle_days: float = Field(default=30.0, ge=0.0)
    # When Grove runs as root, boxes run as uids base..base+999, one per run; keep the range unused.
    sandbox_uid_base: int = 200_000
    # Extra read-only paths a box may see, e.g. a toolchain outside /usr (comma separated).
    sandbox_bind: str = ""
    # Extra variable names passed through to sandboxed commands (comma separated).
    sandbox_env_passthrough: str = ""
    output_cap_bytes: int = 5_000_000
    tail_bytes: int = 4_000
    stale_worktree_hours: float = 24.0
    # Before each job a worker makes room once the file system of its data folder is fuller than
    # this share: it drops the copies of studies that ended, then unused environment builds.
    disk_high_water: float = Field(default=0.9, ge=0.0, le=1.0)
    # Requests with a larger body get 413; each token may hold this many event streams open.
    max_body_bytes: int = 2_000_000
    # A worker's bundle of a job's commits may be this large; a job's calls (its records) and its
    # git fetch requests this large. Every other route takes `max_body_bytes`, a run's full output
    # `output_cap_bytes`.
    max_upload_bytes: int = 512_000_000
    max_call_bytes: int = 16_000_000
    sse_per_token: int = 8
    # Folders under which the API accepts local repository paths (comma separated; none by default).
    repo_roots: str = ""
    # Hosts (names, addresses or CIDR networks, comma separated) repository URLs given over the API
    # may name although they resolve inside this server's network; if set, no other host is accepted.
    # GROVE_GIT_ALLOWED_HOSTS is its older name.
    repo_hosts: str = Field(
        default="", validation_alias=AliasChoices("GROVE_REPO_HOSTS", "GROVE_GIT_ALLOWED_HOSTS")
    )
    # A clone is killed when the host sent nothing within the first of these, and after the second.
    clone_first_byte_timeout: float = 60.0
    clone_timeout: float = 600.0
    # Called (POST, JSON) when a gate-passed node starts waiting for a human decision.
    notify_url: str = ""
    # The dashboard's address, for links in notifications (e.g. https://grove.example.com).
    dashboard_url: str = ""

    @property
    def db_url(self) -> str:
        """Return the database URL, defaulting to SQLite under the data directory."""
        if self.database_url:
            url = self.database_url
            for prefix in ("postgres://", "postgresql://"):
                if url.startswith(prefix):
                    return "postgresql+psycopg://" + url.removeprefix(prefix)
            return url
        return f"sqlite:///{(self.data_dir / 'grove.db').resolve()}"

    @property
    def is_postgres(self) -> bool:
        """Return whether the database is PostgreSQL."""
        return self.db_url.startswith("postgresql")

    @property
    def checkpoint_path(self) -> Path:
        """Return the SQLite file of the coordinator's LangGraph checkpoints."""
        return self.data_dir / "checkpoints.db"

    def ensure_dirs(self) -> None:
        """Create the data and worktree directories; the data directory is its owner's alone (0700)."""
        private_dir(self.data_dir)
        for d in (self.worktrees_dir, self.data_dir / "repos", self.data_dir / "outputs"):
            d.mkdir(parents=True, exist_ok=True)


def private_dir(path: Path) -> None:
    """Create a folder only its owner can enter (0700), or take group and others' rights off one of ours.

    Grove's data folder holds the database, tokens, clones with sealed files and held-out outputs.
    """
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid == os.getuid() and st.st_mode & 0o077:
        os.chmod(path, st.st_mode & 0o700)


@lru_cache
def get_settings() -> Settings:
    """Return the process-wide settings."""
    return Settings()
