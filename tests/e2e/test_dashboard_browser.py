"""End to end in a real browser: Debian's headless Chromium, driven by Playwright, against `grove up`.

Submit the digits example in the form, watch the tree grow, open a node, see the study explore
while an approval waits, approve from the study page's banner, open the merged node from the
tree; reject a node on its page and see its fate and withdrawn findings, sort the leaderboard and
compare two nodes' diffs; a reload keeps a viewer's sign-in; the API's docs render with no network
outside. Screenshots go to $GROVE_TEST_ARTIFACTS
(default: test-artifacts/ in the project).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest
from playwright.sync_api import Browser, Frame, Page, Playwright, Route, expect, sync_playwright
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

from backend.core.config import PROJECT_ROOT, Settings
from tests.support.fake_llm import FakeLLM
from tests.support.repos import git, make_repo, tiny_files
from tests.support.services import spawn_up
from tests.support.trees import grow
from tests.support.waiting import free_port, wait_for

ARTIFACTS = Path(os.environ.get("GROVE_TEST_ARTIFACTS", PROJECT_ROOT / "test-artifacts"))
# The stack runs the digits study on the same 2 cores the browser uses: a page may take seconds.
expect.set_options(timeout=30_000)
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
]  # fmt: skip


def chromium() -> str:
    """Return Debian's chromium; the test fails (not skips) without it: `apt-get install chromium`."""
    path = shutil.which("chromium")
    assert path, "Debian's chromium is required: apt-get install -y chromium"
    return path


INTAKE_ANSWER = {
    "metric": "rmse",
    "search": {
        "params.yaml:train.seed": {"values": [7, 8, 9]},
        "params.yaml:train.nope": {"low": 1, "high": 2},
    },
    "notes": ["the seed picks the training subsample; searching it shows how noisy dev is"],
}


@pytest.fixture(scope="module")
def fake_model() -> Iterator[FakeLLM]:
    """The service's model: a scripted OpenAI-compatible server on loopback (drafts use it)."""
    with FakeLLM({"intake": [{"content": json.dumps(INTAKE_ANSWER)}]}) as fake:
        yield fake


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, fake_model: FakeLLM) -> Iterator[dict[str, str]]:
    """Run `grove up` (API, workers, Redis, dashboard) in a fresh data directory."""
    port, board = free_port(), free_port()
    model = {"GROVE_MODEL": "openai/fake-intake", "GROVE_LLM_API_BASE": fake_model.url}
    proc, out = spawn_up(tmp_path_factory.mktemp("e2e"), port, board, model)
    try:
        text = out.read_text()
        token = re.search(r"token\s+(grove_\S+)", text).group(1)  # type: ignore[union-attr]
        dashboard = re.search(r"dashboard\s+(http://\S+)", text).group(1)  # type: ignore[union-attr]
        data = str(out.parent / "data")
        redis = re.search(r"redis\s+(redis://\S+)", text).group(1)  # type: ignore[union-attr]
        yield {"api": f"http://127.0.0.1:{port}/api/v1", "token": token, "dashboard": dashboard, "data": data,
               "redis": redis}  # fmt: skip
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)


@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    with sync_playwright() as pw:
        yield pw


@pytest.fixture(scope="module")
def browser(playwright: Playwright) -> Iterator[Browser]:
    b = playwright.chromium.launch(executable_path=chromium(), headless=True, args=CHROMIUM_ARGS)
    yield b
    b.close()


def example_repository(dest: Path) -> Path:
    """Copy the digits example into a fresh git repository (what a researcher would submit)."""
    shutil.copytree(PROJECT_ROOT / "examples" / "digits", dest)
    git("init", "-q", "-b", "main", cwd=dest)
    git("add", "-A", cwd=dest)
    git("commit", "-q", "-m", "digits", cwd=dest)
    return dest


def shot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def test_submit_watch_open_node_and_approve_in_a_real_browser(
    stack: dict[str, str], browser: Browser, tmp_path: Path
) -> None:
    page = browser.new_page(viewport={"width": 1280, "height": 800})  # the size of docs/screenshots
    page.set_default_timeout(30_000)
    try:
        walk_through(stack, page, tmp_path)
    except Exception:
        shot(page, "failure")  # what the browser showed when a step failed
        raise


def walk_through(stack: dict[str, str], page: Page, tmp_path: Path) -> None:
    repo = example_repository(tmp_path / "digits")
    page.goto(stack["dashboard"])
    expect(page.get_by_text("New study")).to_be_visible()

    page.get_by_label("…or start from a template").click()
    page.get_by_role("option", name="digits example").click()
    expect(page.get_by_role("textbox", name="grove.toml")).to_have_value(re.compile(r'name = "digits"'))
    page.get_by_label("Repository").fill(str(repo))
    page.get_by_role("button", name="Create study").click()
    expect(page.get_by_text("Created study 'digits'")).to_be_visible()
    shot(page, "01-studies")

    page.get_by_role("link", name="Open the new study").click()
    expect(page.get_by_role("heading", name="digits")).to_be_visible()
    nodes = page.get_by_text(re.compile(r"^\d+ nodes · fill: dev gain"))

    def grown() -> bool:
        m = re.match(r"(\d+) nodes", nodes.first.inner_text(timeout=5_000)) if nodes.count() else None
        return bool(m and int(m.group(1)) >= 3)

    wait_for(grown, timeout=240, every=1.0)
    tree = page.frame_locator("iframe[srcdoc*='grove-tree-']")
    expect(tree.locator("text.label", has_text=re.compile(r"^n1 · merged$"))).to_be_visible()
    shot(page, "02-study-growing")

    headers = {"Authorization": f"Bearer {stack['token']}"}
    wait_for(
        lambda: httpx.get(f"{stack['api']}/approvals", headers=headers).json()["count"] >= 1,
        timeout=300,
        every=1.0,
    )
    pending = httpx.get(f"{stack['api']}/approvals", headers=headers).json()["data"][0]
    node_id, number = pending["node_id"], pending["node_number"]

    # A node of the drawn tree is a link to its page. The study runs on, and a changed tree is drawn
    # afresh: a click that lands while its frame reloads is made again.
    def open_from_tree() -> bool:
        try:
            tree.locator(f'g.node[data-number="{number}"]').click(timeout=5_000)
            page.wait_for_url(re.compile(r"/node\?"), timeout=5_000)
        except PlaywrightTimeoutError:
            return False
        return True

    wait_for(open_from_tree, timeout=90, every=0.5)
    expect(page.get_by_role("heading", level=1, name=re.compile(rf"^n{number} · "))).to_be_visible()
    # The node waits for a decision: its page says so, with the decision card right there.
    expect(page.get_by_text(f"n{number} waits for your decision")).to_be_visible()
    expect(page.get_by_text("Fate: passed the held-out gate; waiting for a human decision")).to_be_visible()
    page.get_by_role("tab", name="Diff").click()
    expect(page.get_by_text("config.toml").first).to_be_visible()
    shot(page, "03-node")

    page.get_by_role("link", name=re.compile(r"^Approvals · 1 waiting")).click()
    study_name = httpx.get(f"{stack['api']}/studies/{pending['study_id']}", headers=headers).json()["name"]
    card_title = page.get_by_role("heading", level=3, name=re.compile(rf"^{study_name} · n{number} · "))
    expect(card_title).to_be_visible()
    expect(page.get_by_text("held-out gain vs margin").first).to_be_visible()
    shot(page, "04-approvals")

    # Nobody has decided, and the study goes on: a node dispatched after the approval opened is evaluated.
    sid = pending["study_id"]

    def explored_while_waiting() -> bool:
        log = httpx.get(f"{stack['api']}/studies/{sid}/events/log", headers=headers).json()
        opened = next(
            e["id"] for e in log if e["type"] == "node.awaiting_approval" and e["node_id"] == node_id
        )
        later = [e for e in log if e["id"] > opened]
        queued = {e["node_id"] for e in later if e["type"] == "node.queued"}
        return bool(queued & {e["node_id"] for e in later if e["type"] == "node.evaluated"})

    wait_for(explored_while_waiting, timeout=300, every=1.0)
    page.goto(f"{stack['dashboard']}/study?study={sid}")
    expect(page.get_by_text(f"Waiting for your decision on n{number}")).to_be_visible()
    shot(page, "05-study-waiting")
    page.get_by_role("button", name="Approve").first.click()  # it asks first, as Reject does
    expect(page.get_by_role("button", name="Yes, approve")).to_be_visible()
    assert httpx.get(f"{stack['api']}/studies/{sid}/nodes/{node_id}", headers=headers).json()["status"] == (
        "awaiting_approval"
    )  # nothing happened before the confirmation
    page.get_by_role("button", name="Yes, approve").click()
    expect(page.get_by_text(re.compile(rf"n{number}: approval recorded by grove-up"))).to_be_visible()

    wait_for(
        lambda: (
            httpx.get(
                f"{stack['api']}/studies/{pending['study_id']}/nodes/{node_id}", headers=headers
            ).json()["status"]
            == "merged"
        ),
        timeout=120,
    )
    page.goto(f"{stack['dashboard']}/study?study={pending['study_id']}")
    tree = page.frame_locator("iframe[srcdoc*='grove-tree-']")
    merged = tree.locator("text.label", has_text=re.compile(rf"^n{number} · merged$"))
    expect(merged).to_be_visible(timeout=30_000)
    # The first thing the page shows is the trusted best change: the merged node, linked.
    card = page.locator(".st-key-best-trusted")
    expect(card.get_by_text("passed the held-out gate")).to_be_visible()
    expect(card.get_by_text(re.compile(r"^held-out gain \+"))).to_be_visible()
    shot(page, "06-study-merged")
    card.get_by_role("link", name=re.compile(rf"^n{number} · ")).click()
    expect(page.get_by_role("heading", level=1, name=re.compile(rf"^n{number} · "))).to_be_visible()
    page.go_back()

    # The node picker opens it too (type to filter the list), and its page says what became of it.
    # The page reruns whole once when the study finishes, which can close the list under the
    # pointer: the pick is made again then.
    def pick() -> bool:
        try:
            page.get_by_role("combobox", name="Open a node").click(timeout=10_000)
            page.keyboard.type(f"n{number} · ")
            page.get_by_role("option", name=re.compile(rf"^n{number} · ")).click(timeout=10_000)
            page.get_by_role("link", name=f"Open n{number} →").click(timeout=10_000)
        except PlaywrightTimeoutError:
            page.keyboard.press("Escape")
            return False
        return True

    wait_for(pick, timeout=120, every=0.5)
    expect(page.get_by_role("heading", level=1, name=re.compile(rf"^n{number} · "))).to_be_visible()
    expect(page.get_by_text("Fate: merged by grove-up")).to_be_visible()


def test_dashboard_refuses_a_rebound_host_and_never_sends_its_token(
    stack: dict[str, str], playwright: Playwright
) -> None:
    port = stack["dashboard"].rsplit(":", 1)[1].strip("/")
    rules = "--host-resolver-rules=MAP rebind.test 127.0.0.1"  # what a DNS-rebinding page would achieve
    b = playwright.chromium.launch(executable_path=chromium(), headless=True, args=[*CHROMIUM_ARGS, rules])
    try:
        page = b.new_page()
        page.set_default_timeout(30_000)
        page.goto(f"http://rebind.test:{port}/")
        expect(page.get_by_text("Refused: this dashboard does not answer to host")).to_be_visible()
        expect(page.get_by_text("Studies", exact=True)).to_have_count(0)
        page.goto(f"http://127.0.0.1:{port}/connection")
        expect(page.get_by_text("API URL")).to_be_visible()
        wait_for(lambda: "signed in" in page.content(), timeout=30)
        assert stack["token"] not in page.content()
    finally:
        b.close()


def test_api_docs_render_with_no_network_outside(stack: dict[str, str], browser: Browser) -> None:
    page = browser.new_page()
    page.set_default_timeout(30_000)
    outside: list[str] = []

    def only_loopback(route: Route) -> None:
        host = urlparse(route.request.url).hostname
        if host in ("127.0.0.1", "localhost"):
            route.continue_()
        else:  # a CDN, a font host: recorded, and refused as an offline machine would
            outside.append(route.request.url)
            route.abort()

    page.route("**/*", only_loopback)
    root = stack["api"].removesuffix("/api/v1")
    try:
        page.goto(f"{root}/docs")
        expect(page.locator(".swagger-ui .info .title")).to_contain_text("Grove")
        expect(page.get_by_text("/api/v1/studies", exact=True).first).to_be_visible()
        page.goto(f"{root}/redoc")
        expect(page.get_by_role("heading", name=re.compile(r"^Grove"))).to_be_visible()
        expect(page.get_by_text("API docs by Redocly")).to_be_visible()  # the footer whose logo is remote
        assert outside == []
    finally:
        page.close()


def test_a_reload_keeps_a_viewer_sign_in(stack: dict[str, str], browser: Browser) -> None:
    made = subprocess.run(
        [sys.executable, "-m", "backend.cli.main", "token", "create", "--role", "viewer", "--name", "vera"],
        env={**os.environ, "GROVE_DATA_DIR": stack["data"]}, cwd=PROJECT_ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    viewer = re.search(r"grove_\S+", made.stdout).group(0)  # type: ignore[union-attr]
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    page.set_default_timeout(30_000)
    try:
        page.goto(f"{stack['dashboard']}/connection")
        expect(page.get_by_text("signed in as grove-up")).to_be_visible()  # the token `grove up` started with

        def connect() -> bool:
            # A page still settling (its first runs, under load) may redraw the field between the
            # typing and the click: then the click connects nothing, and the sign-in is tried again.
            page.get_by_role("textbox", name="Token").fill(viewer)
            page.get_by_role("button", name="Connect").click()
            try:
                expect(page.get_by_text("as vera (viewer)").first).to_be_visible(timeout=10_000)
                # Shown by the page's script only once the browser holds the session cookie.
                expect(page.get_by_text("This browser stays signed in across reloads.")).to_be_visible(
                    timeout=10_000
                )
            except AssertionError:
                return False
            return True

        wait_for(connect, timeout=120, every=0.5)
        page.reload()
        expect(page.get_by_text("signed in as vera (viewer)")).to_be_visible()
        page.goto(f"{stack['dashboard']}/studies")
        expect(page.get_by_text("signed in as vera (viewer)")).to_be_visible()
        # The browser holds only a random session id, never the token.
        cookies = page.context.cookies()
        assert "grove_session" in [c["name"] for c in cookies]
        assert viewer not in json.dumps(cookies) and stack["token"] not in json.dumps(cookies)
    except Exception:
        shot(page, "failure-reload")
        raise
    finally:
        page.close()


def test_reject_on_the_node_page_then_rank_and_compare(
    stack: dict[str, str], browser: Browser, tmp_path: Path
) -> None:
    repo = make_repo(tmp_path / "tiny", tiny_files(name="tiny-reject", mode="approve", experiments=6))
    headers = {"Authorization": f"Bearer {stack['token']}"}
    # Another study first (stopped at once), so this study's node ids and numbers differ whatever ran before.
    first = make_repo(tmp_path / "first", tiny_files(name="tiny-first"))
    spec = {"spec": (first / "grove.toml").read_text(), "repository": str(first)}
    other = httpx.post(f"{stack['api']}/studies", json=spec, headers=headers)
    assert other.status_code == 201, other.text
    assert httpx.post(f"{stack['api']}/studies/{other.json()['id']}/stop", headers=headers).status_code == 200
    made = httpx.post(
        f"{stack['api']}/studies",
        json={"spec": (repo / "grove.toml").read_text(), "repository": str(repo)},
        headers=headers,
    )
    assert made.status_code == 201, made.text
    sid = made.json()["id"]

    def pending() -> list[dict[str, Any]]:
        got = httpx.get(f"{stack['api']}/approvals", params={"study_id": sid}, headers=headers)
        return list(got.json()["data"])

    card = wait_for(pending, timeout=240, every=1.0)[0]  # type: ignore[index]
    node_id, number = card["node_id"], card["node_number"]
    assert number != node_id  # another study came first: pages say the study's own number

    def cited() -> bool:
        state = httpx.get(f"{stack['api']}/studies/{sid}", headers=headers).json()["improvement_state"]
        return any(node_id in f["node_ids"] for f in state.get("verified_findings", []))

    wait_for(cited, timeout=60, every=0.5)  # before a decision, its gain counts as a verified finding
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    page.set_default_timeout(30_000)
    try:
        page.goto(f"{stack['dashboard']}/node?study={sid}&node={node_id}")
        expect(page.get_by_text(f"n{number} waits for your decision")).to_be_visible()
        page.get_by_placeholder("reason for rejecting").fill("too close to the margin")
        page.get_by_placeholder("reason for rejecting").press("Enter")
        page.get_by_role("button", name="Reject").click()
        page.get_by_role("button", name="Yes, reject").click()
        expect(page.get_by_text(re.compile(rf"n{number}: rejection recorded by grove-up"))).to_be_visible()

        def rejected() -> bool:
            got = httpx.get(f"{stack['api']}/studies/{sid}/nodes/{node_id}", headers=headers).json()
            return bool(got["status"] == "rejected")

        wait_for(rejected, timeout=120, every=1.0)
        page.reload()
        expect(page.get_by_text("Fate: rejected by grove-up: too close to the margin")).to_be_visible()
        expect(page.get_by_text(f"n{number} waits for your decision")).to_have_count(0)

        # The study page no longer counts it among verified findings, and names it as rejected.
        page.goto(f"{stack['dashboard']}/study?study={sid}")
        expect(page.get_by_text("Rejected candidates")).to_be_visible()
        expect(page.get_by_text(re.compile(rf"^n{number}: .*too close to the margin"))).to_be_visible()
        state = httpx.get(f"{stack['api']}/studies/{sid}", headers=headers).json()["improvement_state"]
        assert all(node_id not in f["node_ids"] for f in state["verified_findings"])
        findings = page.locator("li", has_text=re.compile(rf"\(n{number}(,|\))"))
        expect(findings).to_have_count(0)

        # Stopped, the tree holds still; the leaderboard sorts by what is chosen, compare shows both diffs.
        assert httpx.post(f"{stack['api']}/studies/{sid}/stop", headers=headers).status_code == 200

        def ended() -> bool:
            got = httpx.get(f"{stack['api']}/studies/{sid}", headers=headers).json()
            return got["status"] in ("finished", "stopped", "failed")

        wait_for(ended, timeout=120, every=1.0)
        nodes = httpx.get(f"{stack['api']}/studies/{sid}/tree", headers=headers).json()["nodes"]
        measured = [n for n in nodes if n["parent_id"] is not None and n["dev_mean"] is not None]
        assert len(measured) >= 2 and node_id in {n["id"] for n in measured}
        page.goto(f"{stack['dashboard']}/study?study={sid}")
        board = page.locator("[data-testid='stTable']").first
        expect(board).to_be_visible()
        a, b = measured[0], measured[1]
        for n in (a, b):  # the two picked by default, each under its own heading
            expect(page.get_by_text(f"n{n['number']} · {n['title']}", exact=True).first).to_be_visible()
        diffs = page.locator("[data-testid='stCode']", has_text="diff --git")
        expect(diffs).to_have_count(2)
        for n in (a, b):
            diff = httpx.get(f"{stack['api']}/studies/{sid}/nodes/{n['id']}", headers=headers).json()["diff"]
            changed = next(line for line in diff.splitlines() if line.startswith("+x"))
            expect(diffs.filter(has_text=changed)).not_to_have_count(0)
        # Each sort orders the whole table (missing values last, ties by node id).
        for label, key in (("held-out gain", "heldout_gain"), ("dev mean", "dev_mean")):
            page.get_by_role("combobox", name="Sort by").click()
            page.keyboard.type(label)  # a click alone does not open this list in headless Chromium
            page.get_by_role("option", name=label, exact=True).click()
            order = sorted(measured, key=lambda n: (n[key] is None, -(n[key] or 0.0), n["id"]))
            expect(board.locator("tbody tr")).to_have_text(
                [re.compile(rf"^\s*n{n['number']}(?!\d)") for n in order]
            )
        shot(page, "07-leaderboard-compare")
        # A point of the dev-score chart opens its node's page.
        target = measured[-1]["number"]
        point = page.locator(f"[data-testid='stVegaLiteChart'] path[aria-label*='node: n{target};']").first
        point.scroll_into_view_if_needed()
        point.click()
        expect(page.get_by_role("heading", level=1, name=re.compile(rf"^n{target} · "))).to_be_visible()
    except Exception:
        shot(page, "failure-reject")
        raise
    finally:
        page.close()


SEALED = "SEALED-ROW-" + "7f3a9c"


def wine_repository(dest: Path) -> Path:
    """A public-style repository: an argparse evaluator, YAML params, held-out data, requirements."""
    from tests.integration.test_intake import FILES

    return make_repo(dest, {**FILES, "data/test/test.csv": f"{SEALED}\n4\n5\n"})


@pytest.mark.parametrize("with_model", [False, True], ids=["grove-alone", "scripted-model"])
def test_goal_in_words_to_a_drafted_spec_validated_and_created(
    stack: dict[str, str], browser: Browser, fake_model: FakeLLM, tmp_path: Path, with_model: bool
) -> None:
    name = "wine-model" if with_model else "wine-alone"
    repo = wine_repository(tmp_path / name)
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    page.set_default_timeout(30_000)
    asked = len(fake_model.requests)
    try:
        page.goto(stack["dashboard"])
        page.get_by_label("Repository").fill(str(repo))
        page.get_by_label("Goal in words").fill("Lower the dev RMSE of the wine model")
        if not with_model:
            page.get_by_text("Ask the service's model too").click()
        page.get_by_role("button", name="Draft grove.toml from the goal").click()
        spec = page.get_by_role("textbox", name="grove.toml")
        expect(spec).to_have_value(re.compile(rf'name = "{name}"'), timeout=90_000)  # litellm's first import
        expect(spec).to_have_value(re.compile(r'goal = "Lower the dev RMSE of the wine model"'))
        expect(spec).to_have_value(re.compile(r'dev = "python evaluate.py --split dev"'))
        expect(spec).to_have_value(re.compile(r'sealed = \["data/test/\*\*"\]'))
        expect(page.get_by_text("Why Grove chose each line of this draft")).to_be_visible()
        drafted = "Drafted grove.toml with " if with_model else "Drafted grove.toml from Grove's own analysis"
        expect(page.get_by_text(drafted)).to_be_visible()
        notes = page.get_by_test_id("stText").filter(has_text="- evaluator: evaluate.py")
        expect(notes).to_contain_text("metric: 'rmse', minimized")
        if with_model:
            expect(spec).to_have_value(re.compile(r'"params.yaml:train.seed" = \{ values = \[7, 8, 9\] \}'))
            expect(notes).to_contain_text("search params.yaml:train.nope left out")
            expect(notes).to_contain_text("the seed picks the training subsample")
            sent = json.dumps(fake_model.requests[asked:])
            assert len(fake_model.requests) == asked + 1 and "evaluate.py" in sent
            assert SEALED not in sent  # the sealed split never reaches the model
        else:
            expect(spec).not_to_have_value(re.compile("train.seed"))
            assert len(fake_model.requests) == asked
        page.get_by_text("Why Grove chose each line of this draft").scroll_into_view_if_needed()
        shot(page, f"08-draft-{name}")
        # The person edits the draft before anything is created: fewer experiments
        # (and no downloads: this server gives no network)
        text = (
            spec.input_value()
            .replace("experiments = 20", "experiments = 3")
            .replace("network = true", "network = false")
        )
        spec.fill(text)
        page.get_by_role("button", name="Validate").click()
        expect(page.get_by_text(f"valid: study '{name}' can be created")).to_be_visible()
        page.get_by_role("button", name="Create study").click()
        expect(page.get_by_text(f"Created study '{name}'")).to_be_visible()
        headers = {"Authorization": f"Bearer {stack['token']}"}
        made = [
            s
            for s in httpx.get(f"{stack['api']}/studies", headers=headers).json()["data"]
            if s["name"] == name
        ]
        assert made and made[0]["experiments_budget"] == 3 and made[0]["metric"] == "rmse"
    except Exception:
        shot(page, f"failure-draft-{name}")
        raise
    finally:
        page.close()


def grown(stack: dict[str, str], root: Path, name: str, size: int, **kw: str) -> int:
    """Write a study with a `size`-node tree into the stack's database; return its id."""
    data = Path(stack["data"])
    settings = Settings(data_dir=data, worktrees_dir=data.parent / "wt", redis_url=stack["redis"])
    return grow(settings, root, name, size, **kw)


def tree_frame(page: Page) -> Frame:
    """Return the frame that draws the study's tree, once it has drawn."""
    page.frame_locator("iframe[srcdoc*='grove-tree-']").locator("g.node").first.wait_for()
    return next(f for f in page.frames if f.url == "about:srcdoc" and f.locator("#canvas").count())


def test_a_500_node_tree_reads_after_a_zoom_and_a_search_centres_the_node(
    stack: dict[str, str], browser: Browser, tmp_path: Path
) -> None:
    sid = grown(stack, tmp_path, "wide", 500)
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(f"{stack['dashboard']}/study?study={sid}")
    tree = tree_frame(page)
    expect(tree.locator("#info")).to_contain_text("of 500 nodes")
    tree.get_by_role("button", name="Fit").click()
    label = tree.locator("g.node text.label").first
    k = tree.evaluate("groveTree.state().k")
    assert k < 0.35 and not label.is_visible()  # the whole tree at once: too small to read, labels left out
    tree.locator("#canvas").scroll_into_view_if_needed()
    canvas = tree.locator("#canvas").bounding_box()
    assert canvas is not None
    page.mouse.move(canvas["x"] + 200, canvas["y"] + 200)
    for _ in range(12):  # the wheel zooms in around the pointer
        page.mouse.wheel(0, -240)
    wait_for(lambda: tree.evaluate("groveTree.state().k") >= 1, timeout=10)
    readable = [b for b in (e.bounding_box() for e in tree.locator("g.node text.label").all()[:400]) if b]
    assert readable and min(b["height"] for b in readable) >= 11  # px on screen
    shot(page, "07-tree-500-zoomed")

    tree.get_by_role("searchbox", name="Find a node").fill("n250")
    tree.get_by_role("searchbox", name="Find a node").press("Enter")
    hit = tree.locator('g.node.hit[data-number="250"]')
    expect(hit).to_be_visible()
    box, frame = hit.bounding_box(), tree.locator("#canvas").bounding_box()
    assert box is not None and frame is not None
    centre = (frame["x"] + frame["width"] / 2, frame["y"] + frame["height"] / 2)
    assert (
        abs(box["x"] + box["width"] / 2 - centre[0]) < 40
        and abs(box["y"] + box["height"] / 2 - centre[1]) < 40
    )
    assert tree.locator('g.node.hit[data-number="250"] text.label').first.bounding_box()["height"] >= 11  # type: ignore[index]
    expect(tree.locator("#info")).to_contain_text("n250: match 1 of 1")
    shot(page, "08-tree-500-search")
    page.close()


def test_a_finished_study_shows_parallel_coordinates_importance_and_its_report(
    stack: dict[str, str], browser: Browser, tmp_path: Path
) -> None:
    sid = grown(
        stack,
        tmp_path,
        "charted",
        40,
        status="finished",
        stop_reason="experiment budget spent",
        stop_rule="experiments",
    )
    headers = {"Authorization": f"Bearer {stack['token']}"}
    measured = httpx.get(f"{stack['api']}/studies/{sid}/search", headers=headers).json()["points"]
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(f"{stack['dashboard']}/study?study={sid}")
    expect(page.get_by_text("Parallel coordinates")).to_be_visible()
    parallel = page.frame_locator("iframe[srcdoc*='id=\"parallel\"']")
    expect(parallel.locator("polyline")).to_have_count(len(measured))
    expect(parallel.get_by_text("config.toml:knob.x")).to_be_visible()
    importance = page.frame_locator("iframe[srcdoc*='id=\"importance\"']")
    expect(importance.locator("rect.bar")).to_have_count(1)
    expect(importance.get_by_text("100%")).to_be_visible()  # the study's one knob explains it all
    page.get_by_text("Parallel coordinates").scroll_into_view_if_needed()
    shot(page, "09-search-charts")
    page.get_by_text("REPORT.md").last.click()
    expect(page.get_by_role("heading", name="Grove report: charted")).to_be_visible()
    expect(page.get_by_role("heading", name="Baseline → final")).to_be_visible()
    page.close()


def test_a_failed_study_opens_with_a_banner_giving_the_reason_and_the_fix(
    stack: dict[str, str], browser: Browser, tmp_path: Path
) -> None:
    reason = "dev evaluation fails on the unchanged repository: eval.py exited 1"
    sid = grown(stack, tmp_path, "broken", 3, status="failed", stop_reason=reason, stop_rule="baseline_dev")
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    # The studies list: a click on a study's row opens it.
    page.goto(stack["dashboard"])
    headers = {"Authorization": f"Bearer {stack['token']}"}
    listed = httpx.get(f"{stack['api']}/studies", headers=headers).json()["data"]
    row = next(i for i, s in enumerate(listed) if s["id"] == sid)
    grid = page.locator("[data-testid='stDataFrame']").first
    expect(grid).to_be_visible()
    box = grid.bounding_box()
    assert box is not None
    page.mouse.click(box["x"] + 16, box["y"] + 35 * (row + 1) + 17)  # the row's selector, under the header
    expect(page).to_have_url(re.compile(rf"/study\?study={sid}$"))
    banner = page.get_by_role("alert").filter(has_text="This study failed.")
    expect(banner).to_be_visible()
    expect(banner).to_contain_text(reason)
    expect(banner).to_contain_text("What to do: Run grove validate on the repository")
    shot(page, "10-study-failed")
    page.close()


def test_an_image_and_links_in_model_written_text_render_inert(
    stack: dict[str, str], browser: Browser, tmp_path: Path
) -> None:
    import http.server
    import threading

    from sqlmodel import select

    from backend.core import db
    from backend.core.models import Node

    asked: list[str] = []

    class Watch(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    watch = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Watch)
    threading.Thread(target=watch.serve_forever, daemon=True).start()
    here = f"127.0.0.1:{watch.server_address[1]}"
    hostile = (f"![pixel](http://{here}/pixel.png) see [the docs](http://{here}/click) or http://{here}/bare "
               f"www.evil.example <img src='http://{here}/raw.png'> :red[loud]")  # fmt: skip
    sid = grown(stack, tmp_path, "inert", 4)
    data = Path(stack["data"])
    settings = Settings(data_dir=data, worktrees_dir=data.parent / "wt", redis_url=stack["redis"])
    with db.session(settings.db_url) as s:
        node = s.exec(select(Node).where(Node.study_id == sid, Node.depth == 1)).first()
        assert node is not None
        node.hypothesis = {"hypothesis": hostile, "mechanism": hostile, "observable": "x", "risks": hostile}
        node.reflection, node.summary = hostile, hostile
        s.add(node)
        nid = node.id
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        page.goto(f"{stack['dashboard']}/node?study={sid}&node={nid}")
        expect(page.get_by_text("Reflection after a failed attempt.")).to_be_visible()
        expect(page.get_by_text(f"![pixel](http:\u2060//{here}/pixel.png)").first).to_be_visible()
        shot(page, "12-inert-hypothesis")
        assert page.locator(f"img[src*='{here}']").count() == 0
        links = page.locator(f"a[href*='{here}'], a[href*='evil.example']")
        assert links.count() == 0, links.first.evaluate("e => e.outerHTML")
        assert asked == [], asked
    finally:
        page.close()
        watch.shutdown()
