"""Whole studies with real git, real job processes and real SQLite."""

from __future__ import annotations

import http.server
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, ClassVar

import pytest
from sqlmodel import col, select

from agents.policies.base import IdeationInput, Proposal
from agents.policies.search import SearchPolicy
from backend.api.serializers import study_public
from backend.cli.runner import run_study
from backend.core import db
from backend.core.config import PROJECT_ROOT, Settings
from backend.core.models import Event, Job, Node, ReceiptRow, Study
from backend.services import notify
from backend.services.studies import create_study
from tests.support.repos import git, make_repo, tiny_files
from tests.support.waiting import wait_for


def grove_env(settings: Settings) -> dict[str, str]:
    return {
        **os.environ,
        "GROVE_DATA_DIR": str(settings.data_dir),
        "GROVE_WORKTREES_DIR": str(settings.worktrees_dir),
    }


def grove(settings: Settings, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "backend.cli.main", *args],
        cwd=PROJECT_ROOT,
        env=grove_env(settings),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def spawn_run(settings: Settings, repo: Path) -> subprocess.Popen[str]:
    """Start `grove run` in the background."""
    return subprocess.Popen(
        [sys.executable, "-m", "backend.cli.main", "run", str(repo), "--auto-approve", "--quiet"],
        cwd=PROJECT_ROOT,
        env=grove_env(settings),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def rows(settings: Settings, model: Any, *where: Any) -> list[Any]:
    with db.session(settings.db_url) as s:
        return list(s.exec(select(model).where(*where)))


def the_study(settings: Settings) -> Study:
    return rows(settings, Study)[0]


def test_grove_run_merges_into_trunk_and_writes_report(settings: Settings, tiny_repo: Path) -> None:
    before = git("log", "--all", "--format=%H %D", cwd=tiny_repo)
    res = grove(settings, "run", str(tiny_repo), "--auto-approve", "--quiet")
    assert res.returncode == 0, res.stderr + res.stdout
    st = the_study(settings)
    assert st.status == "finished" and st.trunk_commit != st.base_commit
    merged = rows(settings, Node, Node.status == "merged", col(Node.parent_id).is_not(None))
    assert merged, "expected at least one merge"
    clone = Path(st.repo_path)
    trunk_cfg = git("show", f"{st.trunk_branch}:config.toml", cwd=clone)
    assert "x = 0" not in trunk_cfg
    # Trunk is exactly the merged commit the gate tested: a merge of old trunk and the node.
    last = merged[-1]
    assert st.trunk_commit == last.gate_commit
    parents = git("rev-list", "--parents", "-n1", st.trunk_commit, cwd=clone).split()
    assert len(parents) == 3 and parents[2] == last.commit
    tests = rows(settings, ReceiptRow, ReceiptRow.node_id == last.id, ReceiptRow.kind == "test")
    assert (
        len(tests) == 2
        and {r.commit for r in tests} == {last.gate_commit}
        and {r.seed for r in tests} == {0, 1}
    )
    devs = rows(settings, ReceiptRow, ReceiptRow.node_id == last.id, ReceiptRow.kind == "dev")
    assert [r.seed for r in devs] == [0, 1] and all(r.commit == last.commit for r in devs)
    report = Path(st.report_path).read_text()
    assert "## Baseline → final" in report and f"| n{last.number} |" in report
    assert "measured nodes with the highest gain LCB" in report  # the table says what it shows
    assert git("log", "--all", "--format=%H %D", cwd=tiny_repo) == before
    # Every node of the finished study is in a final or evaluated state, none left running.
    assert not rows(settings, Node, col(Node.status).in_(["queued", "running", "proposed"]))
    types = [e.type for e in rows(settings, Event)]
    for t in ("study.created", "study.started", "node.proposed", "node.queued", "node.running",
              "node.evaluated", "node.gate_passed", "node.merged", "insight.updated", "study.finished"):  # fmt: skip
        assert t in types, t


class RecordingPolicy(SearchPolicy):
    """The search policy, keeping a copy of every ideation input it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs: list[dict[str, Any]] = []

    def ideate(self, ctx: IdeationInput) -> list[Proposal]:
        self.inputs.append(json.loads(json.dumps(ctx.to_dict(), default=str)))
        return super().ideate(ctx)


def numbers_and_keys(value: Any, out: tuple[list[float], list[str]]) -> tuple[list[float], list[str]]:
    if isinstance(value, dict):
        for k, v in value.items():
            out[1].append(str(k))
            numbers_and_keys(v, out)
    elif isinstance(value, list):
        for v in value:
            numbers_and_keys(v, out)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        out[0].append(float(value))
    elif isinstance(value, str):
        import re

        out[0].extend(float(m) for m in re.findall(r"-?\d+\.?\d*", value))
    return out


def test_heldout_numbers_never_reach_ideation(settings: Settings, tiny_repo: Path) -> None:
    with db.session(settings.db_url) as s:
        study = create_study(s, settings, tiny_files()["grove.toml"], str(tiny_repo))
    policy = RecordingPolicy()
    status = run_study(settings, study.id or 0, approver=lambda s, n: {"approved": True}, policy=policy)
    assert status == "finished"
    st = the_study(settings)
    heldout = st.trunk_heldout + st.baseline_heldout
    assert heldout and min(heldout) > 700  # the sealed split scores near 777; dev scores are at most 10
    assert any(n.heldout_values for n in rows(settings, Node))
    assert len(policy.inputs) >= 2
    for inp in policy.inputs:
        nums, keys = numbers_and_keys(inp, ([], []))
        assert all(abs(v) < 700 for v in nums), "a held-out number reached ideation"
        assert not [k for k in keys if "heldout" in k.lower() or "test" in k.lower()]


class Hook(http.server.BaseHTTPRequestHandler):
    """A webhook receiver on loopback that keeps every JSON body it is sent."""

    bodies: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        size = int(self.headers.get("Content-Length", 0))
        Hook.bodies.append(json.loads(self.rfile.read(size)))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def test_an_opened_approval_calls_the_webhook_without_heldout_numbers(
    settings: Settings, tiny_repo: Path
) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Hook.bodies = []
    hooked = settings.model_copy(
        update={
            "notify_url": f"http://127.0.0.1:{server.server_port}/hook",
            "dashboard_url": "http://grove.test",
        }
    )
    try:
        with db.session(hooked.db_url) as s:
            study = create_study(
                s, hooked, tiny_files(mode="approve", experiments=4)["grove.toml"], str(tiny_repo)
            )
        asked: list[int] = []

        def approver(study_id: int, node_id: int) -> dict[str, Any]:
            asked.append(node_id)
            return {"approved": True, "by": "ada"}

        assert run_study(hooked, study.id or 0, approver=approver) == "finished"
    finally:
        server.shutdown()
        server.server_close()
    assert asked and [b["node_id"] for b in Hook.bodies] == asked
    first = Hook.bodies[0]
    assert first["event"] == "approval.opened" and first["study_id"] == study.id and first["study"] == "tiny"
    assert first["link"] == f"http://grove.test/approvals?study={study.id}" and first["link"] in first["text"]
    nums = [float(m) for m in re.findall(r"-?\d+\.?\d*", json.dumps(Hook.bodies, ensure_ascii=False))]
    assert all(abs(v) < 700 for v in nums), f"a held-out number reached the webhook: {Hook.bodies}"
    sent = rows(hooked, Event, Event.type == "notify.sent")
    assert [e.node_id for e in sent] == asked and sent[0].payload["status"] == 204
    # A webhook that cannot be reached (the server is gone) is an event on the study, never a failure.
    notify.approval_opened(hooked, study.id or 0, asked[0])
    failed = rows(hooked, Event, Event.type == "notify.failed")
    assert len(failed) == 1 and failed[0].payload["error"] == "ConnectError"
    assert "/hook" not in json.dumps([e.payload for e in rows(hooked, Event)])  # no URL, so no secret in it


def test_margin_blocks_a_merge(settings: Settings, tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r", tiny_files(margin=50.0, experiments=4))
    res = grove(settings, "run", str(repo), "--auto-approve", "--quiet")
    assert res.returncode == 0, res.stderr
    st = the_study(settings)
    assert st.trunk_commit == st.base_commit
    gated = rows(settings, Node, Node.gated == True)  # noqa: E712
    assert gated and all(
        n.status == "rejected" and n.gate_reason.startswith("failed: held-out gain") for n in gated
    )
    assert all(len(n.heldout_values) == 2 for n in gated)


def test_sealed_split_query_cap(settings: Settings, tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r", tiny_files(margin=50.0, experiments=6, max_test_runs=1))
    res = grove(settings, "run", str(repo), "--auto-approve", "--quiet")
    assert res.returncode == 0, res.stderr
    st = the_study(settings)
    assert st.test_queries == 2  # the baseline and one gate
    assert len(rows(settings, Node, Node.gated == True)) == 1  # noqa: E712
    tests = rows(settings, ReceiptRow, ReceiptRow.kind == "test")
    assert len(tests) == 4


def test_protected_change_is_rejected(settings: Settings, tmp_path: Path) -> None:
    files = tiny_files(experiments=3)
    files["locked.toml"] = "[a]\nb = 1\n"
    files["grove.toml"] = (
        files["grove.toml"]
        .replace('editable = ["config.toml"]', 'editable = ["*.toml"]')
        .replace('protected = ["eval.py"]', 'protected = ["eval.py", "locked.toml"]')
        .replace(
            '"config.toml:knob.x" = { values = [0, 1, 2, 3, 4, 5] }',
            '"locked.toml:a.b" = { values = [1, 2, 3] }',
        )
    )
    repo = make_repo(tmp_path / "r", files)
    res = grove(settings, "run", str(repo), "--auto-approve", "--quiet")
    assert res.returncode == 0, res.stderr
    nodes = rows(settings, Node, col(Node.parent_id).is_not(None))
    assert nodes and all(
        n.status == "rejected" and "changed protected file locked.toml" in n.failure for n in nodes
    )
    assert the_study(settings).trunk_commit == the_study(settings).base_commit


def test_validate_reports_keys_and_exits_nonzero(settings: Settings, tmp_path: Path) -> None:
    files = tiny_files()
    files["grove.toml"] = files["grove.toml"].replace('sealed = ["data/test/**"]', 'sealed = ["secret/**"]')
    repo = make_repo(tmp_path / "r", files)
    res = grove(settings, "validate", str(repo))
    assert res.returncode == 1
    assert "files.sealed[0]" in res.stderr and "matches no file" in res.stderr
    ok = grove(settings, "validate", str(make_repo(tmp_path / "ok", tiny_files())))
    assert ok.returncode == 0, ok.stderr


def test_crash_and_resume_without_losing_or_duplicating_nodes(settings: Settings, tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r", tiny_files(experiments=8, sleep=0.6, plateau_stop=50))
    proc = spawn_run(settings, repo)

    def integrated() -> int:
        if not (settings.data_dir / "grove.db").exists():
            return 0
        return len(rows(settings, Node, Node.completed_order > 0))

    try:
        wait_for(lambda: integrated() >= 3, timeout=120)
        before = {n.id: (n.title, n.parent_id) for n in rows(settings, Node)}
        running = rows(settings, Job, col(Job.status).in_(["queued", "running"]))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert the_study(settings).status == "running"
    res = grove(settings, "run", str(repo), "--auto-approve", "--quiet")
    assert res.returncode == 0, res.stderr + res.stdout
    assert "resuming study" in res.stdout
    st = the_study(settings)
    assert st.status == "finished"
    after = {n.id: (n.title, n.parent_id) for n in rows(settings, Node)}
    for nid, v in before.items():
        assert after[nid] == v  # nothing lost or rewritten
    children = [n for n in rows(settings, Node) if n.parent_id is not None]
    # A revisit repeats an older node's change on a newer trunk on purpose; anything else is new.
    keys = [json.dumps(n.edits, sort_keys=True) for n in children if n.origin != "revisit"]
    assert len(keys) == len(set(keys)), [(n.id, n.parent_id, n.round_no, n.origin, n.edits) for n in children]
    for r in (n for n in children if n.origin == "revisit"):
        older = next(n for n in children if n.id == r.origin_ref)
        assert older.edits == r.edits and older.base_commit != r.base_commit, "a revisit on the same trunk"
    jobs = rows(settings, Job)
    assert len({(j.node_id, j.attempt) for j in jobs}) == len(jobs) == sum(n.attempts for n in children)
    assert 5 <= len(jobs) <= 8  # the whole space of x (5 values besides the base) or the budget
    assert all(j.status in ("done", "failed") for j in jobs)
    for j in running:  # jobs interrupted by the crash were run again to completion
        assert next(x for x in jobs if x.id == j.id).status == "done"
    assert not rows(settings, Node, col(Node.status).in_(["queued", "running"]))
    assert not settings.worktrees_dir.joinpath("tiny").exists() or not any(
        p for p in settings.worktrees_dir.joinpath("tiny").iterdir()
    )


def test_failed_attempt_is_retried_clean_with_a_reflection(settings: Settings, tmp_path: Path) -> None:
    files = tiny_files(experiments=8, plateau_stop=50)
    files["eval.py"] = files["eval.py"].replace(
        'if sys.argv[1] == "dev":',
        'if x == 5:\n    sys.exit("boom: x=5 is broken")\nif sys.argv[1] == "dev":',
    )
    repo = make_repo(tmp_path / "r", files)
    res = grove(settings, "run", str(repo), "--auto-approve", "--quiet")
    assert res.returncode == 0, res.stderr
    broken = [n for n in rows(settings, Node) if n.edits.get("config.toml:knob.x") == 5]
    assert len(broken) == 1, "the space is small enough that x=5 is always tried"
    node = broken[0]
    assert node.status == "failed" and node.attempts == 2
    assert "exited with code 1" in node.failure and "boom: x=5 is broken" in node.reflection
    jobs = rows(settings, Job, Job.node_id == node.id)
    assert sorted(j.attempt for j in jobs) == [1, 2] and all(j.status == "failed" for j in jobs)
    # Each attempt ran in its own fresh worktree.
    outputs = settings.data_dir / "outputs" / "tiny"
    assert (outputs / f"n{node.id}-a1").is_dir() and (outputs / f"n{node.id}-a2").is_dir()
    state = the_study(settings).improvement_state
    assert any(r["node_id"] == node.id for r in state["rejected_candidates"])


def test_promote_pushes_trunk_as_a_new_branch(settings: Settings, tiny_repo: Path) -> None:
    main_before = git("rev-parse", "main", cwd=tiny_repo)
    with db.session(settings.db_url) as s:
        create_study(s, settings, tiny_files(name="fresh")["grove.toml"], str(tiny_repo))
    early = grove(settings, "promote", "fresh")  # nothing merged yet: nothing to push
    assert early.returncode != 0 and "has nothing new" in early.stderr + early.stdout
    assert "grove/fresh" not in git("branch", "--list", "grove/fresh", cwd=tiny_repo)
    assert grove(settings, "run", str(tiny_repo), "--auto-approve", "--quiet").returncode == 0
    res = grove(settings, "promote", "tiny")
    assert res.returncode == 0, res.stderr
    st = next(x for x in rows(settings, Study) if x.name == "tiny")
    assert st.trunk_commit != st.base_commit
    # Trunk grew from a copy of base without the sealed files: the branch is trunk's files on the
    # repository's own base, its sealed files as they were.
    pushed = git("rev-parse", "grove/tiny", cwd=tiny_repo).strip()
    assert st.sealed_commit == main_before.strip() != st.base_commit
    assert git("rev-parse", "grove/tiny^", cwd=tiny_repo) == main_before
    git("fetch", "-q", st.repo_path, st.trunk_branch, cwd=tiny_repo)
    assert git("diff", "--name-only", "FETCH_HEAD", pushed, cwd=tiny_repo).split() == ["data/test/offset.txt"]
    assert git("ls-tree", "-r", "--name-only", "FETCH_HEAD", cwd=tiny_repo).count("data/test/") == 0
    assert git("diff", "--name-only", main_before.strip(), pushed, "--", "data/test", cwd=tiny_repo) == ""
    assert git("rev-parse", "main", cwd=tiny_repo) == main_before


def test_user_stop_cancels_running_work_and_finishes(settings: Settings, tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r", tiny_files(experiments=8, sleep=3.0, plateau_stop=50))
    proc = spawn_run(settings, repo)
    try:
        wait_for(
            lambda: (
                (settings.data_dir / "grove.db").exists() and rows(settings, Node, Node.status == "running")
            ),
            timeout=120,
        )
        assert grove(settings, "stop", "tiny").returncode == 0
        _, errs = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, errs
    st = the_study(settings)
    assert st.status == "finished" and st.stop_reason == "stopped by user"
    assert not rows(settings, Node, col(Node.status).in_(["queued", "running", "proposed"]))
    assert rows(settings, Node, Node.status == "cancelled")
    assert len(rows(settings, Job)) < 8
    assert "**Ended by:** stopped by a user" in Path(st.report_path).read_text()


UNCLEAR_EVAL = """\
import json, os, sys, tomllib
x = tomllib.load(open("config.toml", "rb"))["knob"]["x"]
seed = int(os.environ.get("GROVE_SEED", "0"))
# Any change is worth +0.1 on every seed; on seed 1 it reads +0.3. Two seeds cannot tell.
score = 10.0 + (0.1 + (0.2 if seed == 1 else 0.0) if x != 0 else 0.0)
print(json.dumps({"score": score if sys.argv[1] == "dev" else score + 700, "size": x}))
"""


def test_an_unclear_gain_gets_more_paired_seeds_charged_to_the_budget(
    settings: Settings, tmp_path: Path
) -> None:
    files = tiny_files(experiments=5, margin=0.0, max_size=5)
    files["eval.py"] = UNCLEAR_EVAL
    spec = files["grove.toml"]
    assert "repeats = 2\n" in spec and "parallel = 2\n" in spec
    files["grove.toml"] = spec.replace("repeats = 2\n", "repeats = 2\nmax_repeats = 6\n", 1).replace(
        "parallel = 2\n", "parallel = 1\n"
    )
    repo = make_repo(tmp_path / "r", files)
    res = grove(settings, "run", str(repo), "--auto-approve", "--quiet")
    assert res.returncode == 0, res.stderr
    st = the_study(settings)
    first = min((n for n in rows(settings, Node) if n.parent_id is not None), key=lambda n: n.id)
    # Looks at 2, 4 and 6 seeds: the node and trunk both got seeds 2..5.
    assert first.dev_n == 6 and first.dev_values[1] == pytest.approx(10.3)
    assert len(st.baseline_dev) == 2 and len(st.trunk_dev) == 6  # trunk keeps its extra seeds
    trunk_runs = rows(settings, ReceiptRow, ReceiptRow.node_id == st.trunk_node_id, ReceiptRow.kind == "dev")
    assert sorted(r.seed for r in trunk_runs) == [0, 1, 2, 3, 4, 5]
    types = [e.type for e in rows(settings, Event, Event.node_id == first.id)]
    assert types.count("node.repeated") == 2
    # The unchanged repository scores 10.0 on every seed, but a change does not: the first node's
    # second seed (its check as a candidate) told the study it is noisy after all.
    assert types.count("evaluator.noisy") == 1 and not st.dev_deterministic
    # The gain is real but small: significant only with six paired seeds, at the last look's level.
    assert first.gain == pytest.approx(0.4 / 3) and first.gain_lcb is not None and first.gain_lcb > 0
    # 8 extra runs (4 of the node, 4 of trunk) cost 4 experiments at 2 runs each: with the job itself,
    # the budget of 5 is spent.
    jobs = rows(settings, Job)
    assert jobs[0].extra_runs == 8
    assert len(jobs) == 1 and "experiment budget spent" in st.stop_reason
    # The report counts what the budget counts, says what the units went on, and which rule ended it.
    report = Path(st.report_path).read_text()
    assert "Experiment budget: 5 of 5 units spent: 1 experiment, 8 extra dev runs" in report
    assert "**Ended by:** the experiment budget was spent (5 of 5 units)" in report
    assert "experiments of a budget of" not in report
    with db.session(settings.db_url) as s:  # the API's summary, which the dashboard shows, counts alike
        body = study_public(s, s.get(Study, st.id))
    assert (body.experiments_used, body.experiments_budget) == (5, 5)
    assert (body.experiments_run, body.extra_dev_runs) == (1, 8)
    # The sealed gate looks again the same way: +0.1 and +0.3 on two test seeds are unclear; on six
    # paired seeds (trunk's too, kept on the study) the gain clears the last look's bound.
    assert len(first.heldout_values) == 6 and len(st.trunk_heldout) == 6
    assert first.status == "merged" and "lower bound" in first.gate_reason
    assert st.test_queries == 2  # the baseline and one gate query, however many seeds it took


def test_a_deterministic_evaluator_is_never_repeated(settings: Settings, tmp_path: Path) -> None:
    files = tiny_files(experiments=6, margin=0.0, max_size=5)
    # Dev gives the same score and size on every seed (held-out keeps its seed noise).
    files["eval.py"] = files["eval.py"].replace(
        "    score = 10 - (x - 3) ** 2 + 0.01 * seed", "    score = 10 - (x - 3) ** 2"
    )
    files["grove.toml"] = files["grove.toml"].replace("repeats = 2\n", "repeats = 2\nmax_repeats = 6\n", 1)
    res = grove(settings, "run", str(make_repo(tmp_path / "r", files)), "--auto-approve", "--quiet")
    assert res.returncode == 0, res.stderr
    st = the_study(settings)
    assert st.dev_deterministic and len(st.baseline_dev) == 2
    (said,) = rows(settings, Event, Event.type == "evaluator.deterministic")
    assert said.payload["metrics"] == ["score", "size"]
    nodes = [n for n in rows(settings, Node) if n.parent_id is not None and n.dev_n]
    # A node claimed before trunk's runs were in ran the usual two seeds; every later one ran one.
    started = {
        j.node_id: j.started_at for j in rows(settings, Job) if j.kind == "experiment" and j.started_at
    }
    after = [n for n in nodes if started[n.id] > said.time]
    # One seed each; a node that beat trunk ran a second as a check, which gave the same values.
    assert len(after) >= 3 and all(n.dev_n in (1, 2) and len(set(n.dev_values)) == 1 for n in after)
    assert sum(n.dev_n == 1 for n in after) >= 2, [(n.number, n.dev_n) for n in nodes]
    assert not rows(settings, Event, col(Event.type).in_(["node.repeated", "evaluator.noisy"]))
    trunk_runs = rows(settings, ReceiptRow, ReceiptRow.node_id == st.trunk_node_id, ReceiptRow.kind == "dev")
    assert len(trunk_runs) == 2, "trunk's seeds were never extended"
    assert all(j.extra_runs == 0 for j in rows(settings, Job))
    # One seed is the whole measurement: its gain is exact, and the gate still decides the merge.
    merged = [n for n in after if n.status == "merged"]
    assert merged and all(n.dev_n == 2 and n.gain is not None and n.gain_lcb == n.gain for n in merged)
    assert "nodes ran one dev seed" in Path(st.report_path).read_text()


def test_a_noisy_constraint_metric_keeps_the_repeats(settings: Settings, tmp_path: Path) -> None:
    files = tiny_files(experiments=3, margin=0.0, max_size=5)
    files["eval.py"] = (
        files["eval.py"]
        .replace("    score = 10 - (x - 3) ** 2 + 0.01 * seed", "    score = 10 - (x - 3) ** 2")
        .replace('"size": x}', '"size": x + 0.001 * seed}')
    )
    res = grove(settings, "run", str(make_repo(tmp_path / "r", files)), "--auto-approve", "--quiet")
    assert res.returncode == 0, res.stderr
    st = the_study(settings)
    assert not st.dev_deterministic and not rows(settings, Event, Event.type == "evaluator.deterministic")
    assert all(n.dev_n == 2 for n in rows(settings, Node) if n.parent_id is not None and n.dev_n)


def test_extra_seeds_stop_where_they_would_overspend_the_budget(settings: Settings, tmp_path: Path) -> None:
    files = tiny_files(experiments=3, margin=0.0, max_size=5)
    files["eval.py"] = UNCLEAR_EVAL
    files["grove.toml"] = (
        files["grove.toml"]
        .replace("repeats = 2\n", "repeats = 2\nmax_repeats = 6\n", 1)
        .replace("parallel = 2\n", "parallel = 1\n")
    )
    res = grove(settings, "run", str(make_repo(tmp_path / "r", files)), "--auto-approve", "--quiet")
    assert res.returncode == 0, res.stderr
    first = min((n for n in rows(settings, Node) if n.parent_id is not None), key=lambda n: n.id)
    # The look at 6 seeds would cost 4 more runs, two experiments: over the budget of 3.
    assert first.dev_n == 4
    jobs = rows(settings, Job)
    assert jobs[0].extra_runs == 4 and len(jobs) == 1


def test_siblings_needing_the_same_trunk_seeds_run_them_once_and_one_is_charged(
    settings: Settings, tmp_path: Path
) -> None:
    # Two first-round siblings, each unclear at 2 seeds, ask for trunk's seeds 2 and 3 at about the
    # same moment (every run takes 0.4 s): one job runs them, the other waits for its values. Seed 1
    # reads +0.15 where the others read +0.1: unclear at two seeds, yet a gain four seeds can confirm,
    # so racing sends both to their second look.
    files = tiny_files(experiments=6, margin=0.0, max_size=5)
    files["eval.py"] = UNCLEAR_EVAL.replace(
        "import json, os, sys, tomllib", "import json, os, sys, time, tomllib\ntime.sleep(0.4)"
    ).replace("(0.2 if seed == 1 else 0.0)", "(0.05 if seed == 1 else 0.0)")
    files["grove.toml"] = files["grove.toml"].replace("repeats = 2\n", "repeats = 2\nmax_repeats = 4\n", 1)
    res = grove(settings, "run", str(make_repo(tmp_path / "r", files)), "--auto-approve", "--quiet")
    assert res.returncode == 0, res.stderr
    st = the_study(settings)
    root = min(n.id or 0 for n in rows(settings, Node))
    trunk_seeds = [
        r.seed for r in rows(settings, ReceiptRow, ReceiptRow.node_id == root, ReceiptRow.kind == "dev")
    ]
    assert sorted(trunk_seeds) == [0, 1, 2, 3], trunk_seeds  # each of trunk's seeds ran once
    first_round = sorted(
        (n for n in rows(settings, Node) if n.parent_id is not None), key=lambda n: n.id or 0
    )[:2]
    assert all(n.dev_n == 4 for n in first_round), [(n.id, n.dev_n) for n in first_round]
    # Every extra dev run, a node's or trunk's, is charged once: to the job that ran it.
    jobs = rows(settings, Job, Job.kind == "experiment")
    extra = rows(settings, ReceiptRow, ReceiptRow.kind == "dev", ReceiptRow.seed >= 2)
    assert sum(j.extra_runs for j in jobs) == len(extra), ([j.extra_runs for j in jobs], len(extra))
    assert len(st.trunk_dev) >= 4


def test_a_changed_spec_is_refused_on_resume_and_a_comment_is_not_a_change(
    settings: Settings, tmp_path: Path
) -> None:
    repo = make_repo(tmp_path / "r", tiny_files(name="changes", experiments=2))
    started = (repo / "grove.toml").read_text()
    with db.session(settings.db_url) as s:
        create_study(s, settings, started, str(repo))
    changed = started.replace("experiments = 2", "experiments = 3").replace("margin = 0.5", "margin = 0.25")
    (repo / "grove.toml").write_text(changed)
    res = grove(settings, "run", str(repo), "--auto-approve", "--quiet")
    said = " ".join(res.stderr.split())
    assert res.returncode == 1, res.stdout
    assert "grove.toml changed since study 'changes' started (keys: budget.experiments, gate.margin)" in said
    assert "use --fresh to start over, or --resume-anyway" in said
    assert the_study(settings).status == "created"  # nothing ran
    (repo / "grove.toml").write_text("# only a comment is new\n" + started)
    res = grove(settings, "run", str(repo), "--auto-approve", "--quiet")
    assert res.returncode == 0, res.stderr + res.stdout
    assert "resuming study 'changes'" in res.stdout and the_study(settings).status == "finished"


def test_validate_reports_every_problem_at_once_and_warns(settings: Settings, tmp_path: Path) -> None:
    files = tiny_files()
    files["grove.toml"] = (
        files["grove.toml"]
        .replace('goal = "Push', 'base = "master"\ngoal = "Push')
        .replace('sealed = ["data/test/**"]', 'sealed = ["secret/**"]')
        .replace(
            '"config.toml:knob.x" = { values = [0, 1, 2, 3, 4, 5] }',
            '"config.toml:knob.x" = { values = [0, 1, 2, 3, 4, 5] }\n"config.toml:knob.nope" = { values = [1, 2] }',
        )
    )
    repo = make_repo(tmp_path / "r", files)
    git("branch", "dev", cwd=repo)
    res = grove(settings, "validate", str(repo))
    said = " ".join(res.stderr.split())
    assert res.returncode == 1
    # The missing base, the glob and the search key: all in one run, the branches that exist named.
    assert (
        "study.base: 'master' is not a branch or commit of the repository (its branches: dev, main)" in said
    )
    assert "files.sealed[0]" in said and "key 'knob.nope' not found in config.toml" in said
    # A current value outside its range is a warning: the spec is valid.
    files = tiny_files()
    files["grove.toml"] = files["grove.toml"].replace(
        "{ values = [0, 1, 2, 3, 4, 5] }", "{ low = 1, high = 5 }"
    )
    res = grove(settings, "validate", str(make_repo(tmp_path / "warn", files)))
    said = " ".join(res.stderr.split())
    assert res.returncode == 0, said
    assert "warning:" in said and "knob.x: current value 0 lies outside [1, 5]" in said
    # A config edited but not committed: Grove studies the commit, and says so.
    (tmp_path / "warn" / "config.toml").write_text("[knob]\nx = 3\nsleep = 0\n")
    res = grove(settings, "validate", "--static", str(tmp_path / "warn"))
    said = " ".join(res.stderr.split())
    assert res.returncode == 0 and "the working tree differs from the last commit in config.toml" in said


def test_validate_runs_dev_once_on_base_and_reports_what_happened(settings: Settings, tmp_path: Path) -> None:
    ok = grove(settings, "validate", str(make_repo(tmp_path / "ok", tiny_files())))
    assert ok.returncode == 0, ok.stderr
    assert "dev on base: score = 1.0 in" in ok.stdout  # 10 - (0 - 3)^2 with seed 0
    files = tiny_files()
    files["eval.py"] = "import sys\nprint('no such data file', file=sys.stderr)\nsys.exit(2)\n"
    bad = grove(settings, "validate", str(make_repo(tmp_path / "bad", files)))
    said = " ".join(bad.stderr.split())
    assert (
        bad.returncode == 1
        and "evaluate.dev on base: exited with code 2" in said
        and "no such data file" in said
    )
    files["eval.py"] = "import json\nprint(json.dumps({'accuracy': 0.5}))\n"
    missing = grove(settings, "validate", str(make_repo(tmp_path / "missing", files)))
    said = " ".join(missing.stderr.split())
    assert missing.returncode == 1 and "objective metric 'score' missing from the reported metrics" in said
    static = grove(settings, "validate", "--static", str(tmp_path / "missing"))
    assert static.returncode == 0 and "dev on base" not in static.stdout
