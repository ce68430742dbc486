"""LLM-loop benchmark: the `llm` policy driven by a simulated researcher, this tree against an older one.

No real model runs. The *simulated researcher* is an OpenAI-compatible server on loopback whose
answers are drawn from a known space with known effects, with the format faults open models make
at set rates:

- the study: five knobs of a config file (`lr`, `width`, `epochs`, `dropout`, and `batch`, which does
  nothing); the dev and held-out scores are a known, additive function of them plus seeded noise, so
  changes compose and a change made stale by a merge is still worth having on the new trunk;
- the ideator proposes one knob move per child from an agenda (numeric variants of one knob count as
  different ideas: "lr 0.01", then "lr 0.003"), as children of trunk or, now and then, of a measured
  node that improved; it sometimes proposes again an idea it proposed before, word for word;
- ideator faults (each answer, at `--faults`): ids written `n3`, a gain as `"5%"`, prose around a
  fenced answer, a bare list of children, trailing commas;
- executor faults (each node, at `--faults`): the whole conversation in text actions (`<tool_call>`
  tags or `{"name", "arguments"}` objects) instead of native tool calls;
- insight faults (each answer, at `--faults`): a 2,500-character lesson.

Both trees run the same seeds through `grove run --auto-approve` (real worktrees, sandboxed runs,
the sealed gate), each in a data folder of its own; the older tree is checked out as a git worktree
(`--baseline`, by default the commit before the `llm` loop's issue work began). Reported per tree,
mean over seeds:

- held-out gain: trunk's held-out mean over the baseline's, as the study recorded it;
- true gain: the known score of the final trunk's config over the unchanged one (no noise);
- experiments: experiment jobs run (of the budget);
- wasted: experiments that taught nothing — *duplicates* (a config measured before), *failed*
  attempts, and *stale* measurements (a node that improved the trunk it was built on, but was never
  merged nor measured again on a later trunk);
- prompt sizes: the largest request per role, in tokens (characters / 4), as the server received it
  (the spec's `max_input_tokens` is `--max-input-tokens`).

    python benchmarks/llm_loop.py [--seeds 3] [--experiments 16] [--faults 0.25] [--max-input-tokens 6000]
                                  [--baseline REV] [--no-baseline]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BASELINE = "a691e5e"  # main before the llm loop's issue work (inheritance, tolerant answers, revisits)

BASE = {"lr": 0.1, "width": 16, "epochs": 5, "dropout": 0.5, "batch": 256}
# The researcher's agenda: one knob move per idea, numeric variants of a knob included.
AGENDA = [
    ("lr", 0.01), ("width", 64), ("epochs", 20), ("dropout", 0.2), ("lr", 0.003), ("batch", 128),
    ("width", 128), ("epochs", 40), ("dropout", 0.1), ("lr", 0.001), ("width", 256), ("epochs", 80),
    ("dropout", 0.0), ("batch", 64), ("lr", 0.03),
    # Finer variants, for long studies.
    ("lr", 0.005), ("width", 96), ("epochs", 30), ("dropout", 0.15), ("lr", 0.002), ("batch", 512),
    ("width", 48), ("epochs", 60), ("dropout", 0.05), ("lr", 0.0005), ("width", 192), ("epochs", 10),
    ("dropout", 0.3), ("batch", 32), ("lr", 0.02), ("lr", 0.004), ("width", 112), ("epochs", 35),
    ("dropout", 0.12), ("lr", 0.0025), ("width", 80), ("epochs", 50), ("dropout", 0.08), ("batch", 1024),
    ("lr", 0.0035), ("width", 160), ("epochs", 45), ("dropout", 0.25), ("lr", 0.006), ("width", 72),
]  # fmt: skip


def true_score(c: dict[str, float]) -> float:
    """Return the known score of a config, without noise."""
    lr = 0.2 * max(0.0, 1 - abs(math.log10(c["lr"] / 0.003)) / 2)
    width = 0.15 * min(math.log2(c["width"] / 16) / 3, 1.0) - (0.03 if c["width"] > 128 else 0.0)
    epochs = 0.1 * min(c["epochs"], 40) / 40
    dropout = 0.08 * max(0.0, 1 - abs(c["dropout"] - 0.1) / 0.5)
    return 0.4 + lr + width + epochs + dropout


def evaluator_source() -> str:
    """Return the study's eval.py: the known score, seeded noise, and the sealed offset for test."""
    import inspect

    return "\n".join([
        "import hashlib, json, math, os, sys, tomllib",
        inspect.getsource(true_score).replace('    """Return the known score of a config, without noise."""\n', ""),
        'c = tomllib.load(open("config.toml", "rb"))["train"]',
        'seed, split = int(os.environ.get("GROVE_SEED", "0")), sys.argv[1]',
        'h = hashlib.sha256(f"{sorted(c.items())}|{seed}|{split}".encode()).digest()',
        "noise = 0.004 * (h[0] / 255 - 0.5)",
        "score = true_score(c) + noise",
        'if split == "test":',
        '    score += float(open("data/test/offset.txt").read())',
        'print(f"epoch {c[\'epochs\']}: loss {1 - score:.4f}")',
        'print(json.dumps({"score": score}))',
        "",
    ])  # fmt: skip


SPEC = """\
[study]
name = "llm-loop"
goal = "Raise the model's validation score by tuning its training config"

[objective]
metric = "score"
direction = "maximize"

[evaluate]
dev = "python eval.py dev"
test = "python eval.py test"
timeout = 60
repeats = 2

[files]
editable = ["config.toml"]
protected = ["eval.py"]
sealed = ["data/test/**"]

[budget]
experiments = {experiments}
parallel = 2
usd = 100

[gate]
mode = "auto"
margin = 0.0
test_repeats = 2
max_test_runs = 30

[plateau]
warn = 20
change = 40
stop = 80

[policy]
kind = "llm"
model = "openai/sim-researcher"
input_usd_per_mtok = 0.1
output_usd_per_mtok = 0.1
max_turns = 8
children = 2
max_input_tokens = {max_input}
"""


def config_text(c: dict[str, Any]) -> str:
    return "[train]\n" + "".join(f"{k} = {v}\n" for k, v in c.items())


def make_repo(path: Path, experiments: int, max_input: int) -> Path:
    """Write the study's repository and commit it."""
    path.mkdir(parents=True)
    files = {
        "config.toml": config_text(BASE),
        "eval.py": evaluator_source(),
        "data/test/offset.txt": "0.0\n",
        "grove.toml": SPEC.format(experiments=experiments, max_input=max_input),
    }
    for rel, text in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_text(text)
    env = {**os.environ, "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@b", "GIT_COMMITTER_NAME": "b",
           "GIT_COMMITTER_EMAIL": "b@b"}  # fmt: skip
    for cmd in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-qm", "study"]):
        subprocess.run(["git", *cmd], cwd=path, env=env, check=True)
    return path


# The simulated researcher ------------------------------------------------------------------------


class Researcher:
    """Answers each role as a researcher model with known habits and format faults would."""

    def __init__(self, seed: int, faults: float) -> None:
        self.rng = random.Random(seed)
        self.faults = faults
        self.proposed: list[tuple[str, float]] = []
        self.text_nodes: dict[str, bool] = {}  # node -> whether its executor writes text actions
        self.sizes: dict[str, int] = {}  # role -> largest prompt, in tokens (characters / 4)
        self.lock = threading.Lock()

    def answer(self, role: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
        tokens = len(json.dumps(messages)) // 4
        self.sizes[role] = max(self.sizes.get(role, 0), tokens)
        if role == "ideator":
            return {"content": self.ideate(messages)}
        if role == "executor":
            return self.execute(messages)
        if role == "insight":
            long = self.rng.random() < self.faults
            lesson = "Moving one knob at a time toward its sweet spot helps; lr and width matter most. "
            return {"content": lesson * (30 if long else 1)}
        if role == "state":
            return {"content": json.dumps({"verified_findings": [], "open_constraints": [],
                                           "rejected_candidates": [], "concerns": [],
                                           "next_plan": ["tune one knob at a time"]})}  # fmt: skip
        if role == "reflect":
            return {"content": "The attempt failed before a result; follow the action format exactly."}
        return {"content": '{"verdicts": {}, "call": "accept", "why": "ok"}'}

    def ideate(self, messages: list[dict[str, Any]]) -> str:
        system = str(messages[0].get("content", ""))
        k = int(m.group(1)) if (m := re.search(r"Propose exactly (\d+) children", system)) else 2
        evidence = json.loads(next(m["content"] for m in messages if m["role"] == "user"))
        trunk = evidence.get("trunk_node_id") or 1
        improved = [n["id"] for n in evidence.get("nodes", [])
                    if (n.get("gain") or 0) > 0.005 and n.get("status") == "evaluated"]  # fmt: skip
        children = []
        with self.lock:
            for _ in range(k):
                if self.proposed and self.rng.random() < 0.15:
                    knob, value = self.rng.choice(self.proposed)  # an idea it had before, word for word
                else:
                    fresh = [a for a in AGENDA if a not in self.proposed]
                    knob, value = fresh[0] if fresh else self.rng.choice(AGENDA)
                    self.proposed.append((knob, value))
                parent = self.rng.choice(improved) if improved and self.rng.random() < 0.3 else trunk
                gain = 0.02
                children.append({
                    "parent_id": parent, "title": f"Set {knob} to {value}", "mechanism": f"set train.{knob} to {value}",
                    "hypothesis": f"{knob} = {value} trains a better model", "observable": "a higher dev score",
                    "risks": "it may overshoot", "expected_gain": gain,
                })  # fmt: skip
            fault = (
                self.rng.choice(["ids", "percent", "prose", "bare", "commas"])
                if self.rng.random() < self.faults
                else ""
            )
        if fault == "ids":
            for c in children:
                c["parent_id"] = f"n{c['parent_id']}"
        if fault == "percent":
            for c in children:
                c["expected_gain"] = "5%"
        if fault == "bare":
            return json.dumps(children)
        text = json.dumps({"children": children}, indent=1)
        if fault == "commas":
            text = text.replace("}\n ]", "},\n ]")
        if fault == "prose":
            text = f"Here are my proposals.\n```json\n{text}\n```\nThey build on the findings so far."
        return text

    def execute(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        task = next((str(m.get("content", "")) for m in messages if m["role"] == "user"), "")
        node = m.group(1) if (m := re.search(r"\(node (n\d+)\)", task)) else "?"
        move = re.search(r"set train\.(\w+) to ([\d.e-]+)", task)
        with self.lock:
            if node not in self.text_nodes:
                self.text_nodes[node] = self.rng.random() < self.faults
            text_mode = self.text_nodes[node]
        done = " ".join(
            [json.dumps(m.get("tool_calls") or "") + str(m.get("content") or "")
             for m in messages if m["role"] == "assistant"]
        )  # fmt: skip
        called = set(re.findall(r'"(?:name|tool)": "(\w+)"', done))
        if move is None or "edit" in called:
            name, args = "finish", {"report": f"Set {move.group(1) if move else '?'}; dev score checked."}
        elif "read" in called:
            seen = " ".join(str(m.get("content") or "") for m in messages if m["role"] in ("tool", "user"))
            current = re.findall(rf"\b{move.group(1)} = ([^\s\\\"]+)", seen)
            old = f"{move.group(1)} = {current[-1] if current else BASE[move.group(1)]}"
            name, args = (
                "edit",
                {"path": "config.toml", "search": old, "replace": f"{move.group(1)} = {move.group(2)}"},
            )
        else:
            name, args = "read", {"path": "config.toml"}
        if text_mode:
            call = json.dumps({"name": name, "arguments": args})
            return {"content": f"<tool_call>{call}</tool_call>" if len(node) % 2 else call}
        return {"tool": name, "args": args}


def serve(researcher: Researcher) -> tuple[ThreadingHTTPServer, str]:
    """Start the researcher's OpenAI-compatible server on loopback."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            messages = body["messages"]
            first = next((m.get("content") or "" for m in messages if m["role"] == "system"), "")
            role = (
                m.group(1)
                if (m := re.search(r"ROLE: (\w+)", str(first or messages[0].get("content"))))
                else "?"
            )
            step = researcher.answer(role, messages)
            message: dict[str, Any] = {"role": "assistant", "content": step.get("content")}
            if "tool" in step:
                message["tool_calls"] = [{"id": f"c{time.monotonic_ns()}", "type": "function",
                                          "function": {"name": step["tool"], "arguments": json.dumps(step["args"])}}]  # fmt: skip
            data = json.dumps({
                "id": "sim", "object": "chat.completion", "created": int(time.time()), "model": body["model"],
                "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if "tool" in step else "stop"}],
                "usage": {"prompt_tokens": len(json.dumps(messages)) // 4, "completion_tokens": 40,
                          "total_tokens": len(json.dumps(messages)) // 4 + 40},
            }).encode()  # fmt: skip
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/v1"


# One study ---------------------------------------------------------------------------------------


def run_once(
    tree: Path, seed: int, experiments: int, faults: float, work: Path, max_input: int
) -> dict[str, Any]:
    """Run one study with the code in `tree`; return its measures."""
    repo = make_repo(work / "repo", experiments, max_input)
    data = work / "data"
    researcher = Researcher(seed, faults)
    server, url = serve(researcher)
    env = {**os.environ, "GROVE_DATA_DIR": str(data), "GROVE_WORKTREES_DIR": str(data / "wt"),
           "GROVE_LLM_API_BASE": url, "GROVE_LLM_BACKOFF": "0.05", "OPENAI_API_KEY": "sk-sim"}  # fmt: skip
    started = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "backend.cli.main", "run", str(repo), "--auto-approve", "--fresh", "--quiet"],
            cwd=tree, env=env, capture_output=True, text=True, timeout=3600,
        )  # fmt: skip
    finally:
        server.shutdown()
    if proc.returncode != 0:
        raise RuntimeError(f"grove run failed in {tree}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return {**measure(data / "grove.db"), "seconds": time.monotonic() - started, "prompts": researcher.sizes}


def measure(db_path: Path) -> dict[str, Any]:
    """Read a finished study's measures from its database (plain SQL: the two trees' schemas differ)."""
    con = sqlite3.connect(db_path)
    con.row_factory = sqlite3.Row
    st = con.execute("SELECT * FROM study").fetchone()
    nodes = [dict(r) for r in con.execute("SELECT * FROM node WHERE study_id = ? ORDER BY id", (st["id"],))]
    experiments = con.execute(
        "SELECT count(*) FROM job WHERE study_id = ? AND kind = 'experiment'", (st["id"],)
    ).fetchone()[0]
    con.close()
    repo = Path(st["repo_path"])

    def config_at(commit: str) -> dict[str, Any] | None:
        out = subprocess.run(
            ["git", "show", f"{commit}:config.toml"], cwd=repo, capture_output=True, text=True
        )
        return tomllib.loads(out.stdout)["train"] if out.returncode == 0 else None

    root = nodes[0]
    trunk_of = {root["commit"]: root} | {
        n["gate_commit"]: n for n in nodes if n["status"] == "merged" and n["gate_commit"]
    }
    seen = [config_at(root["commit"])]
    duplicates = failed = stale = 0
    revisited = {n["origin_ref"] for n in nodes if n["origin"] == "revisit"}
    for n in nodes[1:]:
        failed += n["attempts"] - (0 if n["status"] == "failed" else 1) if n["attempts"] else 0
        if not n["commit"] or n["dev_mean"] is None:
            continue
        c = config_at(n["commit"])
        if c in seen:
            duplicates += 1
        seen.append(c)
        base = trunk_of.get(n["base_commit"])
        improved = (
            base is not None and base["dev_mean"] is not None and n["dev_mean"] > base["dev_mean"] + 0.005
        )
        if (
            improved
            and n["status"] != "merged"
            and n["base_commit"] != st["trunk_commit"]
            and n["id"] not in revisited
        ):
            stale += 1
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    final = config_at(st["trunk_commit"]) or BASE
    return {
        "heldout_gain": mean(json.loads(st["trunk_heldout"])) - mean(json.loads(st["baseline_heldout"])),
        "true_gain": true_score(final) - true_score(BASE),
        "experiments": experiments,
        "duplicates": duplicates,
        "failed": failed,
        "stale": stale,
        "merges": sum(1 for n in nodes[1:] if n["status"] == "merged"),
    }


# Both trees --------------------------------------------------------------------------------------


def checkout(rev: str, where: Path) -> Path:
    """Check `rev` out as a detached git worktree at `where`."""
    subprocess.run(["git", "worktree", "add", "-q", "--detach", str(where), rev], cwd=ROOT, check=True)
    return where


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ["heldout_gain", "true_gain", "experiments", "duplicates", "failed", "stale", "merges", "seconds"]
    out: dict[str, Any] = {k: statistics.mean(r[k] for r in rows) for k in keys}
    out["wasted"] = statistics.mean(r["duplicates"] + r["failed"] + r["stale"] for r in rows)
    out["wasted_share"] = statistics.mean(
        (r["duplicates"] + r["failed"] + r["stale"]) / max(r["experiments"], 1) for r in rows
    )
    roles = sorted({role for r in rows for role in r["prompts"]})
    out["prompts"] = {role: max(r["prompts"].get(role, 0) for r in rows) for role in roles}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--experiments", type=int, default=16)
    ap.add_argument("--faults", type=float, default=0.25)
    ap.add_argument("--baseline", default=BASELINE, help="the older tree's commit (default: %(default)s)")
    ap.add_argument("--no-baseline", action="store_true", help="run this tree only")
    ap.add_argument("--max-input-tokens", type=int, default=6000, help="the spec's policy.max_input_tokens")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="grove-llm-loop-") as tmp:
        old = Path(tmp) / "baseline-tree"
        trees = [("this tree", ROOT)] + (
            [] if args.no_baseline else [(args.baseline, checkout(args.baseline, old))]
        )
        try:
            results: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in trees}
            for seed in range(args.seeds):
                for name, tree in trees:
                    work = Path(tmp) / f"{name.replace(' ', '-')}-{seed}"
                    r = run_once(tree, seed, args.experiments, args.faults, work, args.max_input_tokens)
                    results[name].append(r)
                    print(f"seed {seed} {name}: {json.dumps({k: v for k, v in r.items() if k != 'prompts'})}",
                          flush=True)  # fmt: skip
        finally:
            if old.exists():
                subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, check=False)
    print(f"\n{args.seeds} seeds, budget {args.experiments} experiments, fault rate {args.faults}, "
          f"max_input_tokens {args.max_input_tokens}\n")  # fmt: skip
    sums = {name: summary(rows) for name, rows in results.items()}
    names = list(sums)
    print(f"| measure | {' | '.join(names)} |")
    print(f"|---|{'---|' * len(names)}")
    for key in ["heldout_gain", "true_gain", "merges", "experiments", "wasted", "wasted_share", "duplicates",
                "failed", "stale", "seconds"]:  # fmt: skip
        print(f"| {key.replace('_', ' ')} | {' | '.join(f'{sums[n][key]:.4g}' for n in names)} |")
    for role in sorted({r for s in sums.values() for r in s["prompts"]}):
        print(
            f"| largest {role} prompt (tokens) | {' | '.join(str(sums[n]['prompts'].get(role, '-')) for n in names)} |"
        )
    if len(names) == 2 and sums[names[1]]["wasted"]:
        a, b = sums[names[0]], sums[names[1]]
        print(f"\nwasted experiments, this tree / {names[1]}: {a['wasted'] / b['wasted']:.2f} "
              f"(as a share of the experiments run: {a['wasted_share'] / b['wasted_share']:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
