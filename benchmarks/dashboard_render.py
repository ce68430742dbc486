"""Time to first render of the dashboard's study page, 1,000-node tree vs 10-node tree, in one run.

Starts a private `grove up` stack (API, Redis, workers, dashboard), writes two studies' trees
straight into its database, and loads each study page in Debian's headless Chromium (Playwright),
timing from navigation to the tree drawn (the root's label visible in the SVG) and the scores shown.

    python benchmarks/dashboard_render.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from playwright.sync_api import Page, sync_playwright

from backend.cli.up import Stack, free_port
from backend.core import db
from backend.core.config import PROJECT_ROOT, Settings
from backend.core.models import Node, Study
from backend.core.security import create_token
from backend.services.studies import create_study

sys.path.insert(0, str(PROJECT_ROOT))
from tests.conftest import make_repo, tiny_files

STATUSES = ["evaluated"] * 7 + ["rejected"] * 5 + ["failed"] * 3 + ["pruned"] * 2 + ["cancelled", "proposed"]


def grow(settings: Settings, root: Path, name: str, size: int, seed: int = 0) -> int:
    """Create a study whose tree has `size` nodes with a realistic mix of statuses; return its id."""
    rng = random.Random(seed)
    repo = make_repo(root / name, tiny_files(name=name))
    with db.session(settings.db_url) as s:
        study = create_study(s, settings, (repo / "grove.toml").read_text(), str(repo))
    with db.session(settings.db_url) as s:
        nodes = [s.get(Node, study.trunk_node_id)]
        trunk = nodes[0]
        while len(nodes) < size:
            parent = rng.choice(nodes[-200:]) if rng.random() < 0.7 else rng.choice(nodes)
            assert parent is not None
            if parent.status == "pruned" or parent.status in ("failed", "cancelled", "proposed"):
                parent = trunk
            status = "pruned" if parent.status == "pruned" else rng.choice(STATUSES)
            if parent is trunk and len(nodes) % 60 == 0:
                status = "merged"
            gain = rng.gauss(0.01, 0.02) if status in ("evaluated", "rejected", "merged") else None
            n = Node(study_id=study.id or 0, parent_id=parent.id, depth=parent.depth + 1, status=status,
                     title=f"config.toml:model.hidden {rng.choice([8, 16, 32])} → {rng.choice([64, 128])}",
                     dev_mean=None if gain is None else 0.9 + gain, dev_n=3, gain=gain)  # fmt: skip
            s.add(n)
            s.flush()
            nodes.append(n)
            if status == "merged":
                trunk = n
        st = s.get(Study, study.id)
        assert st is not None
        st.trunk_node_id, st.baseline_dev, st.trunk_dev = trunk.id, [0.9] * 3, [0.95] * 3
        s.add(st)
    return study.id or 0


def first_render(page: Page, url: str, unfold: bool = False) -> float:
    """Return seconds from navigation to the tree and the scores on screen."""
    started = time.perf_counter()
    page.goto(url)
    page.locator("svg text", has_text="baseline (trunk at base)").first.wait_for(timeout=120_000)
    page.get_by_text("baseline dev").first.wait_for(timeout=120_000)
    if not unfold:
        return time.perf_counter() - started
    page.get_by_text("Collapse pruned subtrees and dead ends").click()
    started = time.perf_counter()
    page.get_by_text(re.compile(r"showing 1000\b")).wait_for(timeout=120_000)
    page.locator("svg g.node").nth(999).wait_for(timeout=120_000)
    return time.perf_counter() - started


def main() -> None:
    """Start a private stack and print the render times side by side."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--screenshots", type=Path, help="save a screenshot of each page here")
    args = ap.parse_args()
    chromium = shutil.which("chromium")
    if not chromium:
        sys.exit("needs Debian's chromium: apt-get install -y chromium")
    with tempfile.TemporaryDirectory(prefix="grove-bench-") as tmp:
        root = Path(tmp)
        settings = Settings(data_dir=root / "data", worktrees_dir=root / "wt")
        stack = Stack(settings, port=free_port(), cpu_slots=1)
        env = stack.start(None)
        try:
            settings = Settings(
                data_dir=root / "data", worktrees_dir=root / "wt", redis_url=env["GROVE_REDIS_URL"]
            )
            board = stack.start_dashboard(env, free_port(), create_token(settings, ["viewer"], "bench"))
            small, big = grow(settings, root, "small", 10), grow(settings, root, "big", 1000)
            with sync_playwright() as pw:
                browser = pw.chromium.launch(
                    executable_path=chromium, headless=True,
                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"],
                )  # fmt: skip
                times: dict[str, list[float]] = {
                    "10 nodes": [],
                    "1,000 nodes": [],
                    "1,000 nodes unfolded": [],
                }
                for _ in range(args.repeats):
                    for label, sid, unfold in (("10 nodes", small, False), ("1,000 nodes", big, False),
                                               ("1,000 nodes unfolded", big, True)):  # fmt: skip
                        page = browser.new_page(viewport={"width": 1500, "height": 1100})
                        times[label].append(first_render(page, f"{board}/study?study={sid}", unfold))
                        if args.screenshots:
                            args.screenshots.mkdir(parents=True, exist_ok=True)
                            name = label.replace(",", "").replace(" ", "-")
                            page.screenshot(path=str(args.screenshots / f"{name}.png"), full_page=True)
                        page.close()
                browser.close()
        finally:
            stack.stop()
    base = statistics.median(times["10 nodes"])
    for label, ts in times.items():
        med = statistics.median(ts)
        what = "re-render after unfolding" if "unfolded" in label else "time to first render"
        print(f"study page, {label:>22}: {what} median {med:.2f} s over {len(ts)} loads "
              f"(min {min(ts):.2f}, max {max(ts):.2f}) -> {med / base:.2f}x the 10-node page")  # fmt: skip


if __name__ == "__main__":
    main()
