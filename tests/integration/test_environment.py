"""`[environment] setup`: built once in the sandbox, shared by every evaluation, no network needed."""

from __future__ import annotations

import base64
import hashlib
import http.server
import os
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import select

from backend.cli.runner import run_study
from backend.core import db, gitops
from backend.core.config import Settings
from backend.core.models import Node, Study
from backend.engine import environment
from backend.services.studies import create_study
from tests.support.repos import make_repo, tiny_files

WHEEL = "wheels/tinypkg-0.1-py3-none-any.whl"


def build_wheel(dest: Path, ballast: int = 0) -> None:
    """Write a pure-Python wheel of a package `tinypkg` (what `pip wheel` would make, offline)."""
    files = {
        "tinypkg/__init__.py": b"BONUS = 0.5\n",
        **({"tinypkg/ballast.bin": os.urandom(ballast)} if ballast else {}),
        "tinypkg-0.1.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tinypkg\nVersion: 0.1\n",
        "tinypkg-0.1.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, body in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(body).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(body)}")
    record.append("tinypkg-0.1.dist-info/RECORD,,")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(dest, "w") as z:
        for name, body in files.items():
            z.writestr(name, body)
        z.writestr("tinypkg-0.1.dist-info/RECORD", "\n".join(record) + "\n")


SETUP = (
    'python -m venv "$GROVE_ENV" && "$GROVE_ENV/bin/pip" install --no-index --quiet '
    f"--disable-pip-version-check {WHEEL} && echo built"
)


def study_files(setup: str) -> dict[str, str]:
    files = tiny_files(name="envs", experiments=3)
    files["eval.py"] = (
        files["eval.py"]
        .replace(
            "import json, os, sys, time, tomllib",
            "import json, os, sys, time, tomllib\nfrom tinypkg import BONUS",
        )
        .replace("+ 0.01 * seed", "+ 0.01 * seed + BONUS")
    )
    files["requirements.txt"] = "tinypkg==0.1\n"
    files["grove.toml"] += f"\n[environment]\nsetup = '{setup}'\n"
    return files


def builds_of(settings: Settings, st: Study) -> list[Path]:
    """Return the environment builds a study's folder under `envs/` holds."""
    return sorted((settings.data_dir / "envs" / environment.group_of(settings, st)).iterdir())


def run_to_end(settings: Settings, repo: Path) -> tuple[str, Study]:
    """Create the repository's study, run it to the end, and return its status and row."""
    with db.session(settings.db_url) as s:
        study = create_study(s, settings, (repo / "grove.toml").read_text(), str(repo))
    status = run_study(settings, study.id or 0, approver=lambda s, n: {"approved": True})
    with db.session(settings.db_url) as s:
        st = s.get(Study, study.id)
        assert st is not None
    return status, st


def test_setup_installs_a_local_wheel_once_and_every_evaluation_imports_it(
    settings: Settings, tmp_path: Path
) -> None:
    build_wheel(tmp_path / "r" / WHEEL)  # committed with the rest
    status, st = run_to_end(settings, make_repo(tmp_path / "r", study_files(SETUP)))
    assert status == "finished"
    assert st.baseline_dev and min(st.baseline_dev) >= 1.5  # 10 - 9 + BONUS: the import worked
    envs = list(builds_of(settings, st))
    assert len(envs) == 1  # one build, shared by the baseline, the experiments and the gate
    assert (envs[0] / "ready").exists() and (envs[0] / "setup.stdout").read_text().strip() == "built"
    assert list((envs[0] / "env").glob("lib/python*/site-packages/tinypkg/__init__.py"))


def test_a_failing_setup_fails_the_study_naming_the_step_and_its_log(
    settings: Settings, tmp_path: Path
) -> None:
    status, st = run_to_end(
        settings, make_repo(tmp_path / "r", study_files("echo no such wheel >&2; exit 3"))
    )
    assert status == "failed"
    assert "environment setup exited with code 3" in st.stop_reason
    assert "no such wheel" in st.stop_reason and "setup.stderr" in st.stop_reason


def test_a_setup_that_writes_past_its_disk_limit_is_stopped_and_fails_the_study(
    settings: Settings, tmp_path: Path
) -> None:
    fill = 'i=0; while true; do head -c 1048576 /dev/urandom > "$GROVE_ENV/f$i"; i=$((i+1)); done'
    files = study_files(fill)
    files["grove.toml"] += "disk_mb = 8\n"
    status, st = run_to_end(settings, make_repo(tmp_path / "r", files))
    assert status == "failed"
    assert "environment setup wrote more than 8 MB (environment.disk_mb)" in st.stop_reason
    envs = list(builds_of(settings, st))
    assert envs and all(not (e / "ready").exists() for e in envs)


def test_environments_keyed_by_an_edited_file_build_side_by_side(settings: Settings, tmp_path: Path) -> None:
    files = tiny_files(name="envkeys", experiments=4)
    setup = 'cp config.toml "$GROVE_ENV/built-from.toml"'
    files["grove.toml"] += f"\n[environment]\nsetup = '{setup}'\ninputs = [\"config.toml\"]\n"
    status, st = run_to_end(settings, make_repo(tmp_path / "r", files))
    assert status == "finished"
    with db.session(settings.db_url) as s:
        nodes = list(s.exec(select(Node).where(Node.study_id == st.id, Node.parent_id != None)))  # noqa: E711
    assert len(nodes) >= 4 and all(n.status != "failed" for n in nodes), [(n.id, n.failure) for n in nodes]
    built = {p.read_text() for b in builds_of(settings, st) for p in b.glob("env/built-from.toml")}
    clone = gitops.Repo(Path(st.repo_path))
    used = {clone.read_at(c, "config.toml") for c in [st.base_commit, *(n.commit for n in nodes if n.commit)]}
    assert len(used) >= 3 and built == used  # every config evaluated had its own build


@pytest.fixture
def index(tmp_path: Path) -> Iterator[tuple[str, list[str]]]:
    """Serve a folder holding a 12 MB wheel of `tinypkg` on loopback; yield its URL and the paths asked for."""
    root = tmp_path / "index"
    build_wheel(root / "tinypkg-0.1-py3-none-any.whl", ballast=12 * 1024 * 1024)
    asked: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, directory=str(root), **kw)

        def do_GET(self) -> None:
            asked.append(self.path)
            super().do_GET()

        def log_message(self, *a: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", asked
    finally:
        server.shutdown()
        server.server_close()


def test_a_download_larger_than_the_box_tmp_installs_and_a_second_study_reuses_the_build(
    settings: Settings, tmp_path: Path, index: tuple[str, list[str]]
) -> None:
    url, asked = index
    setup = (
        'python -m venv "$GROVE_ENV" && "$GROVE_ENV/bin/pip" install --no-index --quiet '
        f"--disable-pip-version-check --find-links {url} tinypkg==0.1 && echo built"
    )
    files = study_files(setup)
    # The box's /tmp holds 4 MB; pip downloads the 12 MB wheel into the setup's scratch folder.
    files["grove.toml"] += "network = true\n\n[sandbox]\ntmp_mb = 4\n"
    repo = make_repo(tmp_path / "r", files)
    online = settings.model_copy(update={"sandbox_network": True})
    status, first = run_to_end(online, repo)
    assert status == "finished", first.stop_reason
    assert first.baseline_dev and min(first.baseline_dev) >= 1.5  # the big package imported
    wheel = [p for p in asked if p.endswith(".whl")]
    assert len(wheel) == 1
    [build] = builds_of(online, first)
    assert not (build / environment.SCRATCH).exists()  # the download is gone with the setup
    # A second study of the same repository, its evaluator changed: the build is reused.
    spec = (repo / "grove.toml").read_text().replace('name = "envs"', 'name = "envs-again"')
    (repo / "grove.toml").write_text(spec)
    (repo / "eval.py").write_text((repo / "eval.py").read_text().replace("+ BONUS", "+ 2 * BONUS"))
    gitops.git("commit", "-qam", "evaluator changed", cwd=repo)
    status, second = run_to_end(online, repo)
    assert status == "finished", second.stop_reason
    assert second.baseline_dev and min(second.baseline_dev) >= 2.0  # the changed evaluator ran
    assert builds_of(online, second) == [build] and len([p for p in asked if p.endswith(".whl")]) == 1
    assert (build / "setup.stdout").read_text().strip() == "built"


def test_a_build_is_shared_by_the_researchers_commits_and_never_by_a_candidates(tmp_path: Path) -> None:
    from agents.spec import parse_spec

    files = tiny_files(name="keys")
    files["requirements.txt"] = "tinypkg==0.1\n"
    repo_path = make_repo(tmp_path / "r", files)
    repo = gitops.Repo(repo_path)

    def commit(path: str, text: str, message: str) -> str:
        (repo_path / path).write_text(text)
        gitops.git("commit", "-qam", message, cwd=repo_path)
        return repo.rev("HEAD")

    base = repo.rev("HEAD")
    evaluator_changed = commit("eval.py", files["eval.py"] + "\n# scored differently\n", "evaluator")
    node = commit("requirements.txt", "tinypkg==0.2\n", "a candidate's dependency change")
    gitops.git("checkout", "-q", "-b", "other", evaluator_changed, cwd=repo_path)
    twin = commit("requirements.txt", "tinypkg==0.2\n", "the same dependency change, other code")
    spec = parse_spec(files["grove.toml"] + "\n[environment]\nsetup = 'pip install -r requirements.txt'\n")
    shared, built_on = environment.key_of(spec, repo, evaluator_changed, base)
    assert (shared, built_on) == (environment.key_of(spec, repo, base, base)[0], base)
    # A second study whose base has the evaluator change shares the first study's build.
    assert environment.key_of(spec, repo, evaluator_changed, evaluator_changed)[0] == shared
    # A candidate that changes the dependency files gets a build of its own commit, shared with no one.
    mine, on = environment.key_of(spec, repo, node, base)
    assert on == node and mine != shared
    assert environment.key_of(spec, repo, twin, base)[0] not in (mine, shared)
    # A setup that installs the repository's own code keeps a build per commit.
    own = parse_spec(files["grove.toml"] + "\n[environment]\nsetup = 'pip install -e \".[dev]\"'\n")
    assert (
        environment.key_of(own, repo, base, base)[0]
        != environment.key_of(own, repo, evaluator_changed, evaluator_changed)[0]
    )
