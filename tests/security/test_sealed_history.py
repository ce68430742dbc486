"""Workers that run experiments never receive a sealed byte: not in trunk, not in its history, not by sha.

A study's trunk starts from a parentless copy of the repository's base without the sealed files;
the base itself stays under `refs/grove/sealed/<name>`, which the worker git route serves only to a
sealed job on a token with the sealed role. Protocol v0 takes wants of advertised tips only, so
asking for the sealed commit's sha by name is refused as well.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from backend.api.main import create_app
from backend.core import db
from backend.core.config import Settings
from backend.core.gitops import git_env
from backend.core.models import Job, Node, Study
from backend.core.security import create_token
from backend.engine.jobstore import token_hash
from backend.services.studies import create_study
from tests.support.repos import git, make_repo, tiny_files
from tests.support.services import serve
from tests.support.waiting import free_port

SECRET = "777.125"  # the tiny study's sealed offset (data/test/offset.txt)


@dataclass
class Site:
    settings: Settings
    url: str
    study: Study
    jobs: dict[str, int]
    plain: str  # a worker token (the fleet's)
    trusted: str  # a worker token with the sealed role


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Site]:
    root = tmp_path_factory.mktemp("sealedhistory")
    settings = Settings(data_dir=root / "data", worktrees_dir=root / "wt", redis_url=redis_url)
    settings.ensure_dirs()
    repo = make_repo(root / "repo", tiny_files(name="vault"))
    with db.session(settings.db_url) as s:
        study = create_study(s, settings, (repo / "grove.toml").read_text(), str(repo))
        node = Node(study_id=study.id or 0, parent_id=study.trunk_node_id, depth=1, title="x", status="running",
                    base_commit=study.trunk_commit, branch=f"grove/{study.name}/n9")  # fmt: skip
        s.add(node)
        s.flush()
        jobs = [
            Job(study_id=study.id or 0, node_id=node.id or 0, attempt=attempt, kind=kind, status="running",
                token=token_hash(f"{kind}-token-0123456789abcdef"))
            for kind, attempt in (("experiment", 1), ("gate", 0))
        ]  # fmt: skip
        s.add_all(jobs)
        s.flush()
        ids = {j.kind: j.id or 0 for j in jobs}
        s.refresh(study)
        s.expunge(study)
    port = free_port()
    server, thread = serve(create_app(settings), port)
    plain = create_token(settings, ["worker"], "fleet")
    trusted = create_token(settings, ["worker", "sealed"], "vault")
    yield Site(settings, f"http://127.0.0.1:{port}", study, ids, plain, trusted)
    server.should_exit = True
    thread.join(timeout=10)


def fetch_git(
    site: Site, *args: str, cwd: Path, kind: str, token: str, protocol: str = "2"
) -> subprocess.CompletedProcess[str]:
    """Run git against the worker route as a worker holding the `kind` job (asking for `protocol`)."""
    extra = (
        ("protocol.http.allow", "always"),
        ("protocol.version", protocol),
        ("http.extraHeader", f"Authorization: Bearer {token}"),
        ("http.extraHeader", f"X-Grove-Job: {site.jobs[kind]}:{kind}-token-0123456789abcdef"),
    )
    env = {**git_env(extra), "GIT_TERMINAL_PROMPT": "0"}
    return subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def all_bytes(repo: Path) -> bytes:
    """Return every object of a repository, and its files, as one blob of bytes."""
    objects = subprocess.run(
        ["git", "cat-file", "--batch-all-objects", "--batch"], cwd=repo, capture_output=True, timeout=60
    ).stdout
    files = b"".join(p.read_bytes() for p in repo.rglob("*") if p.is_file() and ".git" not in p.parts)
    return objects + files


def test_trunk_starts_from_a_copy_of_base_without_the_sealed_files(site: Site) -> None:
    repo = Path(site.study.repo_path)
    trunk = site.study.trunk_commit
    assert site.study.sealed_commit and site.study.sealed_commit != trunk
    assert git("rev-list", trunk, cwd=repo).split() == [trunk], "no parent: no history holding them"
    assert "data/test" not in git("ls-tree", "-r", "--name-only", trunk, cwd=repo)
    assert (
        git("rev-parse", f"refs/grove/sealed/{site.study.name}", cwd=repo).strip() == site.study.sealed_commit
    )
    # Everything else is as base has it.
    changed = git("diff", "--name-only", site.study.sealed_commit, trunk, cwd=repo).split()
    assert changed == ["data/test/offset.txt"]


@pytest.mark.parametrize("protocol", ["0", "2"])
def test_an_experiment_job_clones_no_sealed_byte_and_cannot_ask_for_the_base(
    site: Site, tmp_path: Path, protocol: str
) -> None:
    url = f"{site.url}/api/v1/worker/git/{site.study.id}"
    got = fetch_git(site, "clone", "-q", "--mirror", url, "mirror", cwd=tmp_path, kind="experiment",
                    token=site.plain, protocol=protocol)  # fmt: skip
    assert got.returncode == 0, got.stderr
    mirror = tmp_path / "mirror"
    refs = git("for-each-ref", "--format=%(refname)", cwd=mirror).split()
    assert refs and all(r.startswith(f"refs/heads/grove/{site.study.name}/") for r in refs), refs
    assert SECRET.encode() not in all_bytes(mirror)
    # Named by ref or by sha (a v2 client asks; the server answers in v0, advertised tips only).
    for want in (f"refs/grove/sealed/{site.study.name}", site.study.sealed_commit, "refs/heads/main"):
        got = fetch_git(site, "fetch", "-q", url, want, cwd=mirror, kind="experiment", token=site.plain,
                        protocol=protocol)  # fmt: skip
        assert got.returncode != 0, want
    assert SECRET.encode() not in all_bytes(mirror)
    # A sealed-role token does not widen an experiment job's view.
    got = fetch_git(site, "fetch", "-q", url, site.study.sealed_commit, cwd=mirror, kind="experiment",
                    token=site.trusted, protocol=protocol)  # fmt: skip
    assert got.returncode != 0 and SECRET.encode() not in all_bytes(mirror)


def test_a_sealed_job_reaches_the_base_only_on_a_token_with_the_sealed_role(
    site: Site, tmp_path: Path
) -> None:
    url = f"{site.url}/api/v1/worker/git/{site.study.id}"
    ref = f"refs/grove/sealed/{site.study.name}"
    got = fetch_git(site, "ls-remote", url, cwd=tmp_path, kind="gate", token=site.plain)
    assert got.returncode != 0 and "403" in got.stderr
    got = fetch_git(site, "ls-remote", url, cwd=tmp_path, kind="gate", token=site.trusted)
    assert got.returncode == 0 and f"{site.study.sealed_commit}\t{ref}" in got.stdout


def test_a_worker_learns_which_studies_it_may_forget(site: Site) -> None:
    import httpx

    r = httpx.post(f"{site.url}/api/v1/worker/studies/ended", json={"names": [site.study.name, "gone"]},
                   headers={"Authorization": f"Bearer {site.plain}"})  # fmt: skip
    assert r.status_code == 200 and r.json() == {"ended": ["gone"]}
    r = httpx.post(f"{site.url}/api/v1/worker/studies/ended", json={"names": ["x"] * 1001},
                   headers={"Authorization": f"Bearer {site.plain}"})  # fmt: skip
    assert r.status_code == 422 and "names" in r.text


def _bundle(repo: Path, ref: str, commit: str, prerequisites: list[str], objects: list[str]) -> bytes:
    """Write a git bundle by hand: any prerequisite lines, one head, a pack of exactly `objects`."""
    pack = subprocess.run(["git", "pack-objects", "--stdout"], cwd=repo, input="\n".join(objects).encode() + b"\n",
                          capture_output=True, check=True, timeout=60).stdout  # fmt: skip
    head = (
        "# v2 git bundle\n"
        + "".join(f"-{p} base\n" for p in prerequisites)
        + f"{commit} refs/heads/{ref}\n\n"
    )
    return head.encode() + pack


@pytest.mark.parametrize("named", [True, False], ids=["prerequisite", "unnamed"])
def test_a_bundle_cannot_lead_a_study_branch_to_the_sealed_base(
    site: Site, tmp_path: Path, named: bool
) -> None:
    """A commit whose parent is the sealed base (its sha leaked, say) is refused, named or not."""
    import httpx

    url = f"{site.url}/api/v1/worker/git/{site.study.id}"
    assert fetch_git(site, "clone", "-q", "--bare", url, "mine", cwd=tmp_path, kind="experiment",
                     token=site.plain).returncode == 0  # fmt: skip
    mine = tmp_path / "mine"
    tree = git("rev-parse", f"{site.study.trunk_commit}^{{tree}}", cwd=mine).strip()
    body = f"tree {tree}\nparent {site.study.sealed_commit}\nauthor a <a@b> 0 +0000\ncommitter a <a@b> 0 +0000\n\nx\n"
    commit = subprocess.run(["git", "hash-object", "-t", "commit", "-w", "--literally", "--stdin"], cwd=mine,
                            input=body, capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    ref = f"grove/{site.study.name}/n9"
    data = _bundle(mine, ref, commit, [site.study.sealed_commit] if named else [], [commit])
    clone = Path(site.study.repo_path)
    before = git("for-each-ref", f"refs/heads/{ref}", cwd=clone)
    r = httpx.post(
        f"{site.url}/api/v1/worker/jobs/{site.jobs['experiment']}/publish",
        params={"token": "experiment-token-0123456789abcdef", "ref": ref, "commit": commit},
        content=data, headers={"Authorization": f"Bearer {site.plain}"}, timeout=60,
    )  # fmt: skip
    assert r.status_code == 422 and "study" in r.text, r.text
    assert git("for-each-ref", f"refs/heads/{ref}", cwd=clone) == before
    assert SECRET.encode() not in all_bytes(mine)
    # The same job publishing a commit on its own trunk is taken.
    body = f"tree {tree}\nparent {site.study.trunk_commit}\nauthor a <a@b> 0 +0000\ncommitter a <a@b> 0 +0000\n\ny\n"
    good = subprocess.run(["git", "hash-object", "-t", "commit", "-w", "--stdin"], cwd=mine,
                          input=body, capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    r = httpx.post(
        f"{site.url}/api/v1/worker/jobs/{site.jobs['experiment']}/publish",
        params={"token": "experiment-token-0123456789abcdef", "ref": ref, "commit": good},
        content=_bundle(mine, ref, good, [site.study.trunk_commit], [good]),
        headers={"Authorization": f"Bearer {site.plain}"}, timeout=60,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    assert git("rev-parse", f"refs/heads/{ref}", cwd=clone).strip() == good


def test_a_job_that_is_not_sealed_reads_no_sealed_commit_and_no_held_out_number(site: Site) -> None:
    import httpx

    with db.session(site.settings.db_url) as s:
        study = s.get(Study, site.study.id)
        assert study is not None and study.repository_key
        study.trunk_heldout, study.baseline_heldout = [0.5], [0.25]
        node = s.get(Node, study.trunk_node_id)
        assert node is not None
        node.heldout_values, node.heldout_gain, node.gate_reason = [0.5], 0.25, "passed: LCB 0.1"
        node.gate_passed, node.heldout_lcb, node.heldout_level = True, 0.1, 0.95
        s.add_all([study, node])
    got = {}
    for kind, token in (("experiment", site.plain), ("gate", site.trusted)):
        call = f"{site.url}/api/v1/worker/jobs/{site.jobs[kind]}/call"
        auth = {"Authorization": f"Bearer {token}"}
        body = {"token": f"{kind}-token-0123456789abcdef"}
        st = httpx.post(f"{call}/study", json={**body, "args": {}}, headers=auth)
        nd = httpx.post(
            f"{call}/node", json={**body, "args": {"node_id": site.study.trunk_node_id}}, headers=auth
        )
        assert st.status_code == nd.status_code == 200, (st.text, nd.text)
        got[kind] = st.json() | nd.json()
    seen = {k: got["experiment"][k] for k in ("sealed_commit", "repository_key", "trunk_heldout",
                                               "baseline_heldout", "heldout_values", "heldout_gain", "gate_reason",
                                               "gate_passed", "heldout_lcb", "heldout_level")}  # fmt: skip
    assert seen == {"sealed_commit": "", "repository_key": "", "trunk_heldout": [], "baseline_heldout": [],
                    "heldout_values": [], "heldout_gain": None, "gate_reason": "", "gate_passed": False,
                    "heldout_lcb": None, "heldout_level": None}  # fmt: skip
    # A sealed job (on a sealed-role token) reads them all.
    assert got["gate"]["trunk_heldout"] == [0.5] and got["gate"]["heldout_gain"] == 0.25
    assert got["gate"]["heldout_lcb"] == 0.1 and got["gate"]["gate_passed"] is True
    assert got["gate"]["sealed_commit"] == site.study.sealed_commit


def test_a_study_made_before_trunk_left_sealed_files_out_is_fetched_only_by_sealed_jobs(
    site: Site, tmp_path: Path
) -> None:
    """Its trunk's history holds the sealed files: a job that is not sealed gets 409, not a byte."""

    def as_before(sealed_commit: str, base_commit: str) -> None:
        with db.session(site.settings.db_url) as s:
            study = s.get(Study, site.study.id)
            assert study is not None
            study.sealed_commit, study.base_commit = sealed_commit, base_commit
            s.add(study)

    url = f"{site.url}/api/v1/worker/git/{site.study.id}"
    as_before("", site.study.sealed_commit)
    try:
        got = fetch_git(
            site, "clone", "-q", "--mirror", url, "old", cwd=tmp_path, kind="experiment", token=site.plain
        )
        assert got.returncode != 0 and "409" in got.stderr, got.stderr
        got = fetch_git(site, "ls-remote", url, cwd=tmp_path, kind="gate", token=site.trusted)
        assert got.returncode == 0, got.stderr
    finally:
        as_before(site.study.sealed_commit, site.study.base_commit)
    got = fetch_git(site, "ls-remote", url, cwd=tmp_path, kind="experiment", token=site.plain)
    assert got.returncode == 0, got.stderr
