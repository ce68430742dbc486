"""A study's environment setup is study code: boxed, blind to sealed bytes and keys, read-only after."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from agents.spec import parse_spec
from backend.core import db, gitops
from backend.core.config import Settings
from backend.engine import environment, sandbox, workspace
from backend.services.studies import create_study
from tests.support.repos import make_repo, tiny_files

SEALED = "SEALED-BYTES-" + uuid.uuid4().hex
KEY = "sk-canary-" + uuid.uuid4().hex

SETUP = (
    'cat data/test/offset.txt > "$GROVE_ENV/sealed.txt" 2>&1; env > "$GROVE_ENV/env.txt"; '
    'ls -a /grove > "$GROVE_ENV/grove.txt"; mkdir -p "$GROVE_ENV/bin"; '
    'printf "#!/bin/sh\\necho from-env\\n" > "$GROVE_ENV/bin/hello"; chmod +x "$GROVE_ENV/bin/hello"'
)


def test_setup_is_boxed_and_its_result_read_only(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.setenv("GROVE_SECRET_KEY", KEY)
    files = tiny_files(name="envsec")
    files["data/test/offset.txt"] = SEALED + "\n"
    files["grove.toml"] += f"\n[environment]\nsetup = '{SETUP}'\n"
    repo_path = make_repo(tmp_path / "r", files)
    with db.session(settings.db_url) as s:
        study = create_study(s, settings, files["grove.toml"], str(repo_path))
    spec = parse_spec(study.spec_toml)
    repo = gitops.Repo(Path(study.repo_path))
    iso = environment.ensure(settings, study, spec, repo, study.base_commit, workspace.isolation_of(settings))
    env = Path(iso.env_dir)
    assert not iso.env_writable and env.is_dir()
    made = {p.name: p.read_text() for p in env.iterdir() if p.is_file()}
    assert SEALED not in made["sealed.txt"] and "No such file" in made["sealed.txt"]
    assert KEY not in made["env.txt"] and "GROVE_SECRET" not in made["env.txt"]
    assert "GROVE_ENV=/grove/env" in made["env.txt"]
    assert SEALED not in "".join(made.values())
    # An evaluation finds the environment's programs first, and cannot change them.
    tree = tmp_path / "tree"
    tree.mkdir()
    res = sandbox.run(
        'hello; echo pwned > "$GROVE_ENV/bin/hello"; touch "$GROVE_ENV/new"; echo done',
        cwd=tree,
        output_dir=tmp_path / "out",
        limits=sandbox.Limits(timeout=30),
        isolation=iso,
    )
    assert res.stdout_tail.split() == ["from-env", "done"]
    assert "Read-only file system" in res.stderr_tail
    assert (env / "bin" / "hello").read_text().endswith("echo from-env\n") and not (env / "new").exists()
    # A second ensure for the same inputs reuses the build.
    (env / "marker").write_text("kept")
    again = environment.ensure(
        settings, study, spec, repo, study.base_commit, workspace.isolation_of(settings)
    )
    assert again.env_dir == iso.env_dir and (env / "marker").exists()
