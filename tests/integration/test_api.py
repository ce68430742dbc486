"""The REST API against real Celery workers, a real Redis and real git."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from backend.api.main import create_app
from backend.core.config import PROJECT_ROOT
from backend.core.security import create_token
from tests.support.repos import make_repo, tiny_files
from tests.support.services import Service, serve
from tests.support.waiting import free_port, wait_for

API = "/api/v1"


@pytest.fixture(scope="module")
def client(service: Service) -> Iterator[TestClient]:
    with TestClient(create_app(service.settings)) as c:
        yield c


def auth(service: Service, *roles: str, name: str = "") -> dict[str, str]:
    return {"Authorization": f"Bearer {create_token(service.settings, list(roles), name or '-'.join(roles))}"}


def sse(
    client: TestClient, url: str, headers: dict[str, str], until: str, limit: int = 500
) -> list[dict[str, Any]]:
    """Read server-sent events until one of type `until` (or `limit` events)."""
    events: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    with client.stream("GET", url, headers=headers) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("id:"):
                current["id"] = int(line[3:].strip())
            elif line.startswith("event:"):
                current["event"] = line[6:].strip()
            elif line.startswith("data:"):
                current["data"] = json.loads(line[5:].strip())
            elif not line and current:
                events.append(current)
                current = {}
                if events[-1]["event"] == until or len(events) >= limit:
                    break
    return events


def create(client: TestClient, repo: Path, headers: dict[str, str]) -> int:
    """Create a study from a repository's grove.toml over the API; return its id."""
    resp = client.post(
        f"{API}/studies",
        json={"spec": (repo / "grove.toml").read_text(), "repository": str(repo)},
        headers=headers,
    )
    assert resp.status_code == 201, resp.text
    return int(resp.json()["id"])


def approvals_of(client: TestClient, sid: int, headers: dict[str, str]) -> list[dict[str, Any]]:
    """Return a study's pending approvals."""
    r = client.get(f"{API}/approvals", params={"study_id": sid}, headers=headers)
    assert r.status_code == 200
    return list(r.json()["data"])


def test_study_over_http_runs_to_approval_merges_and_finishes(
    service: Service, client: TestClient, tmp_path: Path
) -> None:
    repo = make_repo(tmp_path / "r", tiny_files(name="api-flow", mode="approve", experiments=4, sleep=0.3))
    op = auth(service, "operator", "approver", name="ada")
    sid = create(client, repo, op)

    def pending() -> list[dict[str, Any]]:
        return approvals_of(client, sid, op)

    card = wait_for(pending, timeout=180)[0]  # type: ignore[index]
    assert card["dev_gain_lcb"] > 0 and card["heldout_gain"] >= card["margin"]
    assert all(c["verdict"] == "satisfied" for c in card["constraints"])
    resp = client.post(f"{API}/studies/{sid}/nodes/{card['node_id']}/approve", headers=op)
    assert resp.status_code == 200 and resp.json()["decided_by"] == "ada"
    again = client.post(f"{API}/studies/{sid}/nodes/{card['node_id']}/approve", headers=op)
    assert again.status_code == 409

    def settle() -> bool:
        for a in pending():
            client.post(f"{API}/studies/{sid}/nodes/{a['node_id']}/approve", headers=op)
        return client.get(f"{API}/studies/{sid}", headers=op).json()["status"] == "finished"

    wait_for(settle, timeout=180)
    node = client.get(f"{API}/studies/{sid}/nodes/{card['node_id']}", headers=op).json()
    assert node["status"] == "merged" and node["diff"].startswith("diff --git")
    assert [r["seed"] for r in node["receipts"] if r["kind"] == "dev"] == [0, 1]
    rid = node["receipts"][0]["id"]
    full = client.get(f"{API}/studies/{sid}/receipts/{rid}/output", headers=op)
    assert full.status_code == 200 and full.text.startswith("some log line")
    assert (
        client.get(
            f"{API}/studies/{sid}/receipts/{rid}/output", params={"stream": "bad"}, headers=op
        ).status_code
        == 422
    )
    assert node["insights"] and node["insights"][0]["cites"] == [card["node_id"]]
    assert {"node.queued", "node.running", "node.evaluated", "node.merged"} <= {
        e["type"] for e in node["history"]
    }
    tree = client.get(f"{API}/studies/{sid}/tree", headers=op).json()
    assert len(tree["nodes"]) >= 3
    # One progress point per evaluated experiment, numbered in order.
    points = client.get(f"{API}/studies/{sid}/progress", headers=op).json()["points"]
    evaluated = {n["id"] for n in tree["nodes"] if n["parent_id"] is not None and n["dev_mean"] is not None}
    assert sorted(p["node_id"] for p in points) == sorted(evaluated)
    assert [p["experiment"] for p in points] == list(range(1, len(points) + 1))
    assert client.get(f"{API}/studies/{sid}/report", headers=op).text.startswith("# Grove report: api-flow")

    # The event stream replays the whole study in order, then resumes after a reconnect.
    events = sse(client, f"{API}/studies/{sid}/events", op, until="study.finished")
    ids = [e["id"] for e in events]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    types = [e["event"] for e in events]
    assert types[0] == "study.created" and types[-1] == "study.finished"
    assert types.index("study.started") < types.index("node.proposed") < types.index("node.merged")
    middle = ids[len(ids) // 2]
    resumed = sse(
        client, f"{API}/studies/{sid}/events", {**op, "Last-Event-ID": str(middle)}, until="study.finished"
    )
    assert [e["id"] for e in resumed] == [i for i in ids if i > middle]
    log = client.get(f"{API}/studies/{sid}/events/log", params={"after": middle}, headers=op).json()
    assert [e["id"] for e in log] == [i for i in ids if i > middle]
    # The stream of a finished study ends by itself once it has sent everything.
    whole = sse(client, f"{API}/studies/{sid}/events", op, until="", limit=100_000)
    assert [e["id"] for e in whole] == ids and whole[-1]["event"] == "study.finished"


def test_the_study_explores_while_an_approval_waits_then_merges_on_approve(
    service: Service, client: TestClient, tmp_path: Path
) -> None:
    # Values enough that exploring cannot run out before the gate job (queued behind experiments) ends.
    files = tiny_files(
        name="api-wait", mode="approve", experiments=14, sleep=0.2, max_size=20, values=list(range(20))
    )
    repo = make_repo(tmp_path / "r", files)
    op = auth(service, "operator", "approver", name="ada")
    sid = create(client, repo, op)

    def pending() -> list[dict[str, Any]]:
        return approvals_of(client, sid, op)

    card = wait_for(pending, timeout=180)[0]  # type: ignore[index]
    waiting = card["node_id"]

    def started_and_evaluated_since() -> set[int]:
        log = client.get(f"{API}/studies/{sid}/events/log", headers=op).json()
        opened = next(
            e["id"] for e in log if e["type"] == "node.awaiting_approval" and e["node_id"] == waiting
        )
        later = [e for e in log if e["id"] > opened]
        queued = {e["node_id"] for e in later if e["type"] == "node.queued"}
        return queued & {e["node_id"] for e in later if e["type"] == "node.evaluated"}

    # Nobody has decided yet, and the study goes on: nodes dispatched after the approval opened
    # (not only those already running) are evaluated on the same trunk.
    others = wait_for(started_and_evaluated_since, timeout=180)
    assert waiting not in others  # type: ignore[operator]
    study = client.get(f"{API}/studies/{sid}", headers=op).json()
    assert study["status"] == "running" and pending()[0]["node_id"] == waiting
    resp = client.post(f"{API}/studies/{sid}/nodes/{waiting}/approve", headers=op)
    assert resp.status_code == 200

    def merged() -> bool:
        return bool(
            client.get(f"{API}/studies/{sid}/nodes/{waiting}", headers=op).json()["status"] == "merged"
        )

    wait_for(merged, timeout=120)

    def settle() -> bool:
        for a in pending():
            client.post(
                f"{API}/studies/{sid}/nodes/{a['node_id']}/reject", json={"reason": "enough"}, headers=op
            )
        return client.get(f"{API}/studies/{sid}", headers=op).json()["status"] == "finished"

    wait_for(settle, timeout=180)
    # Later gate passes were rejected: the approved node is the only merge besides the baseline.
    nodes = client.get(f"{API}/studies/{sid}/tree", headers=op).json()["nodes"]
    assert [n["id"] for n in nodes if n["status"] == "merged" and n["parent_id"] is not None] == [waiting]
    # Each node says what became of it, in the tree and on its page alike.
    fate = {n["id"]: n["fate"] for n in nodes}
    assert fate[waiting] == "merged by ada"
    assert (
        next(n for n in nodes if n["parent_id"] is None)["fate"] == "the baseline: trunk at the study's start"
    )
    turned = [
        n["id"] for n in nodes if n["status"] == "rejected" and fate[n["id"]].startswith("rejected by ada")
    ]
    assert all(fate[i] == "rejected by ada: enough" for i in turned)
    low = [
        n for n in nodes if n["status"] == "evaluated" and n["gain_lcb"] is not None and n["gain_lcb"] <= 0
    ]
    assert all(fate[n["id"]].startswith("not a gate candidate: dev LCB ") for n in low)
    assert low or turned, "the study should have left a node that was not merged"
    for n in nodes:
        assert client.get(f"{API}/studies/{sid}/nodes/{n['id']}", headers=op).json()["fate"] == fate[n["id"]]
    # A rejected node's findings leave the improvement state.
    state = client.get(f"{API}/studies/{sid}", headers=op).json()["improvement_state"]
    cited = {i for f in state.get("verified_findings", []) for i in f["node_ids"]}
    assert not cited & set(turned)
    assert {r["node_id"] for r in state.get("rejected_candidates", [])} >= set(turned)


def test_grove_submit_takes_the_same_overrides_as_grove_run(service: Service, tmp_path: Path) -> None:
    # Each evaluation takes seconds, so the study is still running when the test stops it.
    repo = make_repo(tmp_path / "r", tiny_files(name="to-submit", experiments=6, sleep=5))
    port = free_port()
    server, thread = serve(create_app(service.settings), port)
    url = f"http://127.0.0.1:{port}/api/v1"
    token = create_token(service.settings, ["operator"], "cli")
    try:
        out = subprocess.run(
            [sys.executable, "-m", "backend.cli.main", "submit", str(repo), "--api", url, "--token", token,
             "--budget", "2", "--name", "submitted"],
            cwd=PROJECT_ROOT, env={**os.environ, **service.env}, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        sid = int(re.search(r"\(id (\d+)\)", out.stdout).group(1))  # type: ignore[union-attr]
        study = httpx.get(f"{url}/studies/{sid}", headers={"Authorization": f"Bearer {token}"}).json()
        assert study["name"] == "submitted" and study["experiments_budget"] == 2
        stopped = httpx.post(f"{url}/studies/{sid}/stop", headers={"Authorization": f"Bearer {token}"})
        assert stopped.status_code == 200, stopped.text
        assert stopped.json()["status"] == "stopping"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_grove_submit_wait_says_what_the_study_waits_for_and_how_to_approve_it(
    service: Service, tmp_path: Path
) -> None:
    repo = make_repo(tmp_path / "r", tiny_files(name="asks", experiments=4, mode="approve"))
    port = free_port()
    server, thread = serve(create_app(service.settings), port)
    url = f"http://127.0.0.1:{port}/api/v1"
    token = create_token(service.settings, ["operator"], "cli")
    approver = {"Authorization": f"Bearer {create_token(service.settings, ['approver', 'viewer'], 'ada')}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "backend.cli.main", "submit", str(repo), "--api", url, "--token", token, "--wait"],
        cwd=PROJECT_ROOT, env={**os.environ, **service.env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        asked = wait_for(
            lambda: next((ln for ln in list(lines) if "waiting for your approval of n" in ln), None), 180
        )
        assert "/approve" in str(asked) and "approver token" in str(asked)
        sid = int(re.search(r"\(id (\d+)\)", "".join(lines)).group(1))  # type: ignore[union-attr]
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:  # each approval it waits for is given
            for card in httpx.get(f"{url}/approvals", params={"study_id": sid}, headers=approver).json()[
                "data"
            ]:
                httpx.post(f"{url}/studies/{sid}/nodes/{card['node_id']}/approve", headers=approver)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1)
        assert proc.returncode == 0, "".join(lines)
        assert sum("waiting for your approval of n" in ln for ln in lines) >= 1
    finally:
        if proc.poll() is None:
            proc.kill()
        server.should_exit = True
        thread.join(timeout=10)


def test_a_running_node_shows_its_output_live(service: Service, client: TestClient, tmp_path: Path) -> None:
    files = tiny_files(name="live", experiments=1, sleep=2.5)
    files["eval.py"] = files["eval.py"].replace(
        "time.sleep(", "print(f'warming up seed {seed}', flush=True)\ntime.sleep("
    )
    repo = make_repo(tmp_path / "r", files)
    op = auth(service, "operator")
    sid = create(client, repo, op)

    def running_node() -> int | None:
        nodes = client.get(f"{API}/studies/{sid}/tree", headers=op).json()["nodes"]
        return next((n["id"] for n in nodes if n["status"] == "running"), None)

    nid = wait_for(running_node, timeout=120)

    def printed() -> dict[str, Any] | None:
        out = client.get(f"{API}/studies/{sid}/nodes/{nid}/live", headers=op).json()
        return out if out["status"] == "running" and "warming up seed" in out["tail"] else None

    live = wait_for(printed, timeout=60)
    assert live["run"].startswith("dev-seed") and live["run"].endswith(".stdout")  # type: ignore[index]
    assert (
        client.get(f"{API}/studies/{sid}/nodes/{nid}/live", params={"stream": "bad"}, headers=op).status_code
        == 422
    )
    client.post(f"{API}/studies/{sid}/stop", headers=op)
    wait_for(
        lambda: client.get(f"{API}/studies/{sid}", headers=op).json()["status"] == "finished", timeout=120
    )
    nodes = client.get(f"{API}/studies/{sid}/tree", headers=op).json()["nodes"]
    never = [n["id"] for n in nodes if n["status"] == "cancelled" and n["attempts"] == 0]
    for other in never:
        quiet = client.get(f"{API}/studies/{sid}/nodes/{other}/live", headers=op).json()
        assert quiet["run"] == "" and quiet["note"]


def test_a_nodes_dev_runs_step_records_are_its_training_curves(
    service: Service, client: TestClient, tmp_path: Path
) -> None:
    files = tiny_files(name="curves", experiments=2, mode="auto")
    files["eval.py"] = files["eval.py"].replace(
        'print("some log line")',
        "for step in range(5):\n"
        "    print(json.dumps({'step': step, 'loss': (x + 1) / (step + 1) + seed, 'lr': 0.1}))\n"
        'print("some log line")',
    )
    repo = make_repo(tmp_path / "r", files)
    op = auth(service, "viewer")
    sid = create(client, repo, auth(service, "operator"))
    wait_for(
        lambda: client.get(f"{API}/studies/{sid}", headers=op).json()["status"] == "finished", timeout=180
    )
    nodes = client.get(f"{API}/studies/{sid}/tree", headers=op).json()["nodes"]
    measured = next(n for n in nodes if n["status"] == "merged" and n["parent_id"] is not None)
    detail = client.get(f"{API}/studies/{sid}/nodes/{measured['id']}", headers=op).json()
    dev = [r for r in detail["receipts"] if r["kind"] == "dev"]
    assert any(r["kind"] != "dev" for r in detail["receipts"])  # the gate's runs, never charted
    assert dev and all(set(r["metrics"]) == {"score", "size"} for r in dev)  # the metrics line, not a step
    got = client.get(f"{API}/studies/{sid}/nodes/{measured['id']}/curves", headers=op).json()
    assert got["keys"] == ["loss", "lr"]
    assert sorted(c["receipt_id"] for c in got["curves"]) == sorted(r["id"] for r in dev)  # dev runs only
    x = detail["edits"]["config.toml:knob.x"]
    for c in got["curves"]:
        assert [r["step"] for r in c["records"]] == [0, 1, 2, 3, 4]
        assert c["records"][2]["loss"] == (x + 1) / 3 + c["seed"]
    assert client.get(f"{API}/studies/{sid}/nodes/999999/curves", headers=op).status_code == 404


def test_auth_rules(service: Service, client: TestClient, tmp_path: Path) -> None:
    assert client.get(f"{API}/studies").status_code == 401
    assert client.get(f"{API}/studies", headers={"Authorization": "Bearer nope"}).status_code == 401
    viewer, operator = auth(service, "viewer"), auth(service, "operator")
    assert client.get(f"{API}/studies", headers=viewer).status_code == 200
    body = {"spec": tiny_files()["grove.toml"], "repository": str(tmp_path)}
    assert client.post(f"{API}/studies", json=body, headers=viewer).status_code == 403
    resp = client.post(f"{API}/studies/1/nodes/1/approve", headers=operator)
    assert resp.status_code == 403 and "approver" in resp.json()["detail"]
    assert client.get(f"{API}/health").json()["status"] == "ok"
    assert "grove_studies" in client.get(f"{API}/metrics").text


@pytest.mark.parametrize(
    ("mutate", "status", "needle"),
    [
        (lambda spec, repo: ("[study\nname=", str(repo)), 422, "not valid TOML"),
        (
            lambda spec, repo: (spec.replace('goal = "', 'colour = 1\ngoal = "'), str(repo)),
            422,
            "spec.study.colour: unknown key",
        ),
        (lambda spec, repo: (spec, str(repo / "missing")), 422, "repository: "),
        (lambda spec, repo: (spec, str(repo / "data")), 422, "is not the top of a git repository"),
        (
            # Plain http is refused up front; an unreachable https/git URL fails its background clone
            # (tests/integration/test_cloning.py).
            lambda spec, repo: (spec, "http://127.0.0.1:9/nothing.git"),
            422,
            "repository: scheme 'http' is not allowed",
        ),
        (
            lambda spec, repo: (spec.replace("editable = [", 'editable = ["nope/*", '), str(repo)),
            422,
            "spec.files.editable[0]",
        ),
    ],
)
def test_bad_input_is_a_clear_4xx_and_creates_nothing(
    service: Service, client: TestClient, tmp_path: Path, mutate: Any, status: int, needle: str
) -> None:
    files = tiny_files(name="bad-input")
    repo = make_repo(tmp_path / "r", files)
    spec, repository = mutate(files["grove.toml"], repo)
    op = auth(service, "operator")
    before = client.get(f"{API}/studies", headers=op).json()["count"]
    resp = client.post(f"{API}/studies", json={"spec": spec, "repository": repository}, headers=op)
    assert resp.status_code == status, resp.text
    assert needle in resp.json()["detail"]["message"]
    assert client.get(f"{API}/studies", headers=op).json()["count"] == before


def test_an_evaluation_without_metrics_fails_the_study_clearly(
    service: Service, client: TestClient, tmp_path: Path
) -> None:
    files = tiny_files(name="no-metric")
    files["eval.py"] = "print('all good, no numbers')\n"
    repo = make_repo(tmp_path / "r", files)
    op = auth(service, "operator")
    resp = client.post(
        f"{API}/studies", json={"spec": files["grove.toml"], "repository": str(repo)}, headers=op
    )
    assert resp.status_code == 201
    sid = resp.json()["id"]
    wait_for(lambda: client.get(f"{API}/studies/{sid}", headers=op).json()["status"] == "failed", timeout=120)
    study = client.get(f"{API}/studies/{sid}", headers=op).json()
    assert "no metrics" in study["stop_reason"]
    tree = client.get(f"{API}/studies/{sid}/tree", headers=op).json()
    root = next(n for n in tree["nodes"] if n["parent_id"] is None)
    receipts = client.get(f"{API}/studies/{sid}/nodes/{root['id']}", headers=op).json()["receipts"]
    assert receipts and not receipts[0]["ok"] and "no metrics" in receipts[0]["reason"]
    assert "all good, no numbers" in receipts[0]["stdout_tail"]


def test_pause_steer_and_resume(service: Service, client: TestClient, tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r", tiny_files(name="steered", mode="auto", experiments=4, sleep=0.5))
    op = auth(service, "operator", name="grace")
    sid = client.post(
        f"{API}/studies",
        json={"spec": (repo / "grove.toml").read_text(), "repository": str(repo)},
        headers=op,
    ).json()["id"]
    assert client.post(f"{API}/studies/{sid}/pause", headers=op).json()["status"] == "paused"
    assert client.post(f"{API}/studies/{sid}/pause", headers=op).status_code == 409
    tree = client.get(f"{API}/studies/{sid}/tree", headers=op).json()
    root = next(n["id"] for n in tree["nodes"] if n["parent_id"] is None)
    bad = client.post(
        f"{API}/studies/{sid}/nodes/{root}/hypotheses",
        json={"title": "t", "edits": {"nope.toml:a": 1}},
        headers=op,
    )
    assert bad.status_code == 422 and "edits.nope.toml:a" in bad.json()["detail"]["message"]
    human = client.post(
        f"{API}/studies/{sid}/nodes/{root}/hypotheses",
        json={"title": "try x = 3", "mechanism": "centre the knob", "edits": {"config.toml:knob.x": 3}},
        headers=op,
    )
    assert human.status_code == 201 and human.json()["origin"] == "human"
    hid = human.json()["id"]
    decoy = client.post(
        f"{API}/studies/{sid}/nodes/{root}/hypotheses",
        json={"title": "x = 5", "edits": {"config.toml:knob.x": 5}},
        headers=op,
    ).json()["id"]
    pruned = client.post(
        f"{API}/studies/{sid}/nodes/{decoy}/prune", json={"reason": "not worth it"}, headers=op
    )
    assert pruned.status_code == 200
    assert client.post(f"{API}/studies/{sid}/resume", headers=op).json()["status"] == "running"
    wait_for(
        lambda: client.get(f"{API}/studies/{sid}", headers=op).json()["status"] == "finished", timeout=180
    )
    node = client.get(f"{API}/studies/{sid}/nodes/{hid}", headers=op).json()
    assert (
        node["status"] in ("merged", "evaluated")
        and node["attempts"] == 1
        and abs(node["dev_mean"] - 10.005) < 1e-9
    )
    decoy_node = client.get(f"{API}/studies/{sid}/nodes/{decoy}", headers=op).json()
    assert decoy_node["status"] == "pruned" and decoy_node["attempts"] == 0
    assert "not worth it" in decoy_node["insights"][-1]["text"]
    assert decoy_node["fate"].startswith("pruned by ") and decoy_node["fate"].endswith(": not worth it")


def test_draft_explains_its_choices_and_refuses_what_it_cannot_read(
    service: Service, client: TestClient, tmp_path: Path
) -> None:
    from tests.integration.test_intake import FILES

    repo = make_repo(tmp_path / "wine", FILES)
    op, viewer = auth(service, "operator"), auth(service, "viewer")
    body = {"repository": str(repo), "goal": "Lower the RMSE", "use_model": False}
    assert client.post(f"{API}/studies/draft", json=body, headers=viewer).status_code == 403
    got = client.post(f"{API}/studies/draft", json=body, headers=op)
    assert got.status_code == 200, got.text
    draft = got.json()
    assert draft["model"] is None and 'name = "wine"' in draft["spec"]
    assert draft["notes"][0] == "model: not asked; this draft is Grove's own analysis"
    assert any(n.startswith("sealed: data/test/**") for n in draft["notes"])
    assert draft["files"] == {}  # the repository has its own evaluator
    # Asked for a model where none is configured: the notes say so.
    asked = client.post(f"{API}/studies/draft", json={**body, "use_model": True}, headers=op).json()
    assert asked["model"] is None and asked["notes"][0].startswith(
        "model: none is configured on this service"
    )
    # A repository with no evaluator: the draft carries the adapter and data split it needs.
    from tests.integration.test_init_adapter import MLPROJECT

    bare = make_repo(tmp_path / "bare", MLPROJECT)
    adapted = client.post(f"{API}/studies/draft", json={**body, "repository": str(bare)}, headers=op).json()
    assert set(adapted["files"]) >= {
        "grove_eval.py",
        "grove/adapter.json",
        "grove/heldout/data/wine-quality.csv",
    }
    assert 'dev = "python grove_eval.py dev"' in adapted["spec"]
    assert any(n.startswith("files: this draft needs grove/adapter.json") for n in adapted["notes"])
    # Its setup would download, which this server does not allow: said, naming the setting.
    url = f"{API}/studies/validate"
    refused = client.post(url, json={"spec": draft["spec"], "repository": str(repo)}, headers=op)
    assert refused.status_code == 422 and "GROVE_SANDBOX_NETWORK" in refused.text
    offline = draft["spec"].replace("network = true", "network = false")
    valid = client.post(url, json={"spec": offline, "repository": str(repo)}, headers=op)
    assert valid.status_code == 200 and valid.json()["message"].startswith("valid: study 'wine'")
    for repository, said in (
        ("https://example.invalid/repo.git", "a draft reads a repository on this server's disk"),
        (str(tmp_path / "missing"), "does not exist"),
        ("/", "must lie under"),
    ):
        bad = client.post(f"{API}/studies/draft", json={**body, "repository": repository}, headers=op)
        assert bad.status_code == 422 and said in bad.text and "repository" in bad.text, bad.text


def paused_study(
    client: TestClient, op: dict[str, str], files: dict[str, str], repo: Path
) -> tuple[int, int]:
    """Create a study of `repo` and pause it at once; return its id and its root node's."""
    sid = client.post(
        f"{API}/studies", json={"spec": files["grove.toml"], "repository": str(repo)}, headers=op
    ).json()["id"]
    assert client.post(f"{API}/studies/{sid}/pause", headers=op).json()["status"] == "paused"
    root = next(n["id"] for n in client.get(f"{API}/studies/{sid}/tree", headers=op).json()["nodes"])
    return sid, root


def test_a_human_hypothesis_past_max_depth_below_a_merge_is_refused_naming_parent(
    service: Service, client: TestClient, tmp_path: Path
) -> None:
    files = tiny_files(name="shallow", mode="auto", experiments=2)
    files["grove.toml"] = files["grove.toml"].replace("[policy]\n", "[policy]\nmax_depth = 1\n")
    op = auth(service, "operator")
    sid, root = paused_study(client, op, files, make_repo(tmp_path / "r", files))
    one = {"title": "x = 3", "edits": {"config.toml:knob.x": 3}}
    child = client.post(f"{API}/studies/{sid}/nodes/{root}/hypotheses", json=one, headers=op)
    assert child.status_code == 201  # the root is merged: 0 steps below a merge
    deeper = client.post(f"{API}/studies/{sid}/nodes/{child.json()['id']}/hypotheses", json=one, headers=op)
    assert deeper.status_code == 422
    assert deeper.json()["detail"]["message"].startswith(
        f"parent: n{child.json()['number']} is policy.max_depth (1)"
    )


def test_a_merge_on_a_range_bound_is_a_finding_and_widens_the_range(
    service: Service, client: TestClient, tmp_path: Path
) -> None:
    files = tiny_files(name="edge", mode="auto", experiments=3)
    files["grove.toml"] = files["grove.toml"].replace("values = [0, 1, 2, 3, 4, 5]", "low = 0.5, high = 3.0")
    op = auth(service, "operator")
    sid, root = paused_study(client, op, files, make_repo(tmp_path / "r", files))
    edge = {"title": "x to its upper bound", "edits": {"config.toml:knob.x": 3.0}}  # the best score there is
    assert (
        client.post(f"{API}/studies/{sid}/nodes/{root}/hypotheses", json=edge, headers=op).status_code == 201
    )
    assert client.post(f"{API}/studies/{sid}/resume", headers=op).json()["status"] == "running"
    wait_for(
        lambda: client.get(f"{API}/studies/{sid}", headers=op).json()["status"] == "finished", timeout=180
    )
    log = client.get(f"{API}/studies/{sid}/events/log", headers=op).json()
    widened = [
        (e["payload"]["key"], e["payload"]["side"], e["payload"]["new"])
        for e in log
        if e["type"] == "search.widened"
    ]
    # The sampler may also merge a point on the low bound (any x beats the base's 0) before x = 3.
    assert ("config.toml:knob.x", "high", 4.25) in widened or ("config.toml:knob.x", "high", 4.5) in widened
    assert len(widened) == len(set(widened)) and all(side in ("low", "high") for _, side, _ in widened)
    report = client.get(f"{API}/studies/{sid}/report", headers=op).text
    assert "on the high bound of its range (3): the optimum may lie beyond it" in report
