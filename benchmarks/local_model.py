"""Local-model benchmark: the `llm` policy on a real model, Gemma 3 270M served by llama.cpp, offline.

Runs examples/digits with `grove run --local-model` (every role on the packaged model, no scripted
answers) once with constrained decoding (each answer's JSON schema sent in the form the server takes)
and once without it (`[policy] decoding = "none"`: the schema's words in the prompt only), each in a
data folder of its own, and reads what the study recorded:

- per role: the answers asked for, valid on the first try, valid after re-asks, refused in the end
  (every refusal is an `llm.refused` event with its reason and try), seconds and tokens per call;
- prompts: the largest per role against the input limit the server was given;
- nodes: those the model proposed (dropped ideas apart, with their reasons), those that reached a dev
  evaluation, nodes evaluated per hour, and the study's wall time.

    python benchmarks/local_model.py [--experiments 4] [--only constrained|free] [--keep DIR]

Needs the optional extra (`bash scripts/setup.sh --local`). On 2 CPU cores a 4-experiment study takes
a few minutes per run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import tomlkit

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "digits"
RUNS = {"constrained": "auto", "free": "none"}
EVALUATED = {"evaluated", "merged", "rejected", "gate_failed", "gate_candidate", "stale", "pruned"}


def prepare(folder: Path, decoding: str, experiments: int) -> Path:
    """Copy the example into `folder` as a git repository whose spec runs the llm policy."""
    repo = folder / "digits"
    shutil.copytree(EXAMPLE, repo)
    spec = tomlkit.parse((repo / "grove.toml").read_text())
    spec["study"]["name"] = f"digits-{decoding}"  # type: ignore[index]
    spec["policy"]["kind"] = "llm"  # type: ignore[index]
    spec["policy"]["decoding"] = decoding  # type: ignore[index]
    spec["budget"]["experiments"] = experiments  # type: ignore[index]
    (repo / "grove.toml").write_text(tomlkit.dumps(spec))
    git = ["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost", "-C", str(repo)]
    subprocess.run([*git, "init", "-q", "-b", "main"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "digits"], check=True)
    return repo


def run(folder: Path, repo: Path) -> tuple[float, int, str]:
    """Run the study to its end with the local model; return its wall seconds, exit code and output tail."""
    env = {**os.environ, "GROVE_DATA_DIR": str(folder / "data"), "GROVE_WORKTREES_DIR": str(folder / "wt")}
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "backend.cli.main", "run", str(repo), "--local-model", "--auto-approve", "--quiet"],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )  # fmt: skip
    return time.monotonic() - began, done.returncode, (done.stdout + done.stderr)[-2000:]


def measured(db: Path) -> dict[str, Any]:
    """Read a finished study's calls, refusals and nodes."""
    con = sqlite3.connect(db)
    events = [(t, json.loads(p)) for t, p in con.execute("select type, payload from event order by id")]
    calls = [p for t, p in events if t == "llm.call"]
    refused = [p for t, p in events if t == "llm.refused"]
    nodes = list(con.execute("select status, origin, dev_n from node where parent_id is not null"))
    dropped = [p for t, p in events if t == "proposal.dropped"]
    # A failed call is an `llm.error` that does not just report the ask its last refusal ended.
    errors, ended = [], set()
    for t, p in events:
        if (
            t == "llm.refused"
            and str(p.get("try", "")).split(" of ")[:1] == str(p.get("try", "")).split(" of ")[1:]
        ):
            ended.add(p["role"])
        elif t == "llm.error":
            if p["role"] in ended:
                ended.discard(p["role"])
            else:
                errors.append(p)
    prompts = defaultdict(int)
    for role, messages in con.execute("select role, messages from llm_call"):
        prompts[role] = max(prompts[role], len(messages) // 4)
    study = con.execute("select status, stop_reason from study").fetchone()
    con.close()
    return {"calls": calls, "refused": refused, "nodes": nodes, "dropped": dropped, "prompts": prompts,
            "study": study, "errors": errors}  # fmt: skip


def roles(m: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Return per role: answers asked for, first-try valid, valid after re-asks, refused, calls that
    failed (an error, no answer), and seconds and tokens per call.

    An ask is a first call and its re-asks; a refusal that is not the last try is followed by a re-ask,
    unless that call failed (it is then not recorded as a call).
    """
    out: dict[str, dict[str, float]] = {}
    by_role = defaultdict(list)
    for c in m["calls"]:
        by_role[c["role"]].append(c)
    errors = Counter(e["role"] for e in m["errors"])
    for role in set(by_role) | set(errors):
        calls = by_role.get(role, [])
        mine = [r for r in m["refused"] if r["role"] == role]
        if role == "executor":  # its refusals are answers within a conversation, never re-asked
            first = final = len(mine)
            retried = 0
        else:
            tries = [str(r.get("try", "")).split(" of ") for r in mine]
            first = sum(t[0] == "1" for t in tries)
            final = sum(len(t) == 2 and t[0] == t[1] for t in tries)
            retried = len(mine) - final
        failed = min(errors[role], retried) if role != "executor" else 0  # re-asks that failed
        on_first = errors[role] - failed  # asks whose first call failed
        asks = len(calls) - (retried - failed) + on_first
        out[role] = {
            "asks": asks, "first": asks - first - on_first, "after": first - final - failed,
            "refused": final, "errors": errors[role],
            "seconds": sum(c.get("seconds", 0.0) for c in calls) / max(len(calls), 1),
            "tokens": sum(c["tokens"] for c in calls) / max(len(calls), 1),
        }  # fmt: skip
    return out


def report(name: str, wall: float, m: dict[str, Any], limit: int) -> None:
    """Print one run's tables."""
    status, reason = m["study"]
    reached = [n for n in m["nodes"] if n[2] and n[2] > 0 and n[1] != "revisit"]
    proposed = [n for n in m["nodes"] if n[1] != "revisit"]
    print(f"\n### {name} decoding: study {status} ({reason}), {wall:.0f} s wall\n")
    print(
        "| role | answers | valid first try | valid after re-asks | refused | failed calls | s / call | tokens / call | largest prompt |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for role, r in sorted(roles(m).items()):
        share = f"{r['first']:.0f} ({100 * r['first'] / r['asks']:.0f}%)" if r["asks"] else "0"
        print(f"| {role} | {r['asks']:.0f} | {share} | {r['after']:.0f} | {r['refused']:.0f} | {r['errors']:.0f} | {r['seconds']:.1f} | "
              f"{r['tokens']:.0f} | {m['prompts'].get(role, 0)} of {limit} |")  # fmt: skip
    hours = wall / 3600
    share = f"{100 * len(reached) / len(proposed):.0f}%" if proposed else "-"
    print(f"\nnodes proposed {len(proposed)}, reached evaluation {len(reached)} ({share}); dropped ideas "
          f"{len(m['dropped'])}; nodes evaluated per hour {len(reached) / hours:.1f}")  # fmt: skip
    for reason_, count in Counter(d["reason"].split(":")[0] for d in m["dropped"]).most_common(4):
        print(f"- dropped {count}x: {reason_}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experiments", type=int, default=4)
    parser.add_argument("--only", choices=sorted(RUNS))
    parser.add_argument("--keep", type=Path, help="keep each run's data folder under this folder")
    args = parser.parse_args()
    from backend.core.localmodel import CONTEXT, OUTPUT

    base = args.keep or Path(tempfile.mkdtemp(prefix="grove-local-bench-"))
    for name, decoding in RUNS.items():
        if args.only and name != args.only:
            continue
        folder = base / name
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        wall, code, tail = run(folder, prepare(folder, decoding, args.experiments))
        if code != 0:
            print(f"\n### {name}: grove run exited {code}\n{tail}")
        report(name, wall, measured(folder / "data" / "grove.db"), CONTEXT - OUTPUT)
    if args.keep is None:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
