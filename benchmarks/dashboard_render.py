"""Time to first render of the dashboard's study page, 1,000- and 5,000-node trees vs a 10-node tree.

Starts a private `grove up` stack (API, Redis, workers, dashboard), writes three studies' trees
(10, 1,000 and 5,000 nodes) straight into its database, and loads each study page in Debian's
headless Chromium (Playwright), timing from navigation to the tree drawn (its first node in the
tree's frame) and the scores shown; then how long opening every folded subtree takes.

    python benchmarks/dashboard_render.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from playwright.sync_api import Page, sync_playwright

from backend.cli.up import Stack, free_port
from backend.core.config import PROJECT_ROOT, Settings
from backend.core.security import create_token

sys.path.insert(0, str(PROJECT_ROOT))
from tests.support.trees import grow


def first_render(page: Page, url: str, size: int, unfold: bool = False) -> float:
    """Return seconds from navigation to the tree and the scores on screen (or to every node drawn)."""
    started = time.perf_counter()
    page.goto(url)
    tree = page.frame_locator("iframe[srcdoc*='grove-tree-']")
    tree.locator("g.node").first.wait_for(timeout=120_000)
    page.get_by_text("baseline dev").first.wait_for(timeout=120_000)
    if not unfold:
        return time.perf_counter() - started
    started = time.perf_counter()
    tree.get_by_role("button", name="Unfold all").click()
    tree.get_by_text(re.compile(rf"showing {size} of {size} nodes")).wait_for(timeout=120_000)
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
            sizes = {10: grow(settings, root, "small", 10), 1000: grow(settings, root, "big", 1000),
                     5000: grow(settings, root, "huge", 5000)}  # fmt: skip
            with sync_playwright() as pw:
                browser = pw.chromium.launch(
                    executable_path=chromium, headless=True,
                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"],
                )  # fmt: skip
                runs = [(f"{n:,} nodes", n, False) for n in sizes] + [
                    (f"{n:,} nodes unfolded", n, True) for n in (1000, 5000)
                ]
                times: dict[str, list[float]] = {label: [] for label, _, _ in runs}
                for _ in range(args.repeats):
                    for label, n, unfold in runs:
                        page = browser.new_page(viewport={"width": 1500, "height": 1100})
                        times[label].append(first_render(page, f"{board}/study?study={sizes[n]}", n, unfold))
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
