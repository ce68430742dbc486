"""A study on a real model: Gemma 3 270M served by llama.cpp on loopback, no scripted answer anywhere.

The model proposes every node (as edits of the study's settings, which is what a 270M model can give)
and Grove holds it to what a weak model can be held to: each answer it gave was used, or refused with
a recorded reason; nodes reached a dev evaluation; nothing crashed; the sealed gate decided every
merge; and no prompt held a held-out number.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import tomlkit

from backend.core import localmodel
from backend.core.config import PROJECT_ROOT
from tests.support.repos import git

EXPERIMENTS = 3


@pytest.mark.timeout(1800)  # a few minutes on 2 cores: every call is a real model's
def test_a_study_on_a_real_local_model_runs_to_its_end_with_every_answer_accounted_for(
    tmp_path: Path,
) -> None:
    repo = tmp_path / "digits"
    shutil.copytree(PROJECT_ROOT / "examples" / "digits", repo)
    spec = tomlkit.parse((repo / "grove.toml").read_text())
    spec["policy"]["kind"] = "llm"  # type: ignore[index]
    spec["budget"]["experiments"] = EXPERIMENTS  # type: ignore[index]
    spec["budget"]["parallel"] = 1  # type: ignore[index]
    (repo / "grove.toml").write_text(tomlkit.dumps(spec))
    git("init", "-q", "-b", "main", cwd=repo)
    git("add", "-A", cwd=repo)
    git("commit", "-q", "-m", "digits", cwd=repo)
    data = tmp_path / "data"
    # The model is assembled from its package once per machine (its hash is checked on each use).
    gguf = localmodel.default_gguf(Path.home() / ".cache" / "grove-tests" / "models")
    env = {**os.environ, "GROVE_DATA_DIR": str(data), "GROVE_WORKTREES_DIR": str(tmp_path / "wt")}
    for key in ("GROVE_MODEL", "GROVE_LLM_API_BASE", "GROVE_LLM_API_KEY"):
        env.pop(key, None)
    done = subprocess.run(
        [sys.executable, "-m", "backend.cli.main", "run", str(repo), "--local-model-file", str(gguf),
         "--auto-approve", "--quiet"],
        cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=2400,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    con = sqlite3.connect(data / "grove.db")
    status, reason = con.execute("select status, stop_reason from study").fetchone()
    assert status == "finished" and reason == f"experiment budget spent ({EXPERIMENTS})", (status, reason)
    events = [(t, json.loads(p)) for t, p in con.execute("select type, payload from event order by id")]
    calls = [p for t, p in events if t == "llm.call"]
    assert calls and {c["model"] for c in calls} == {"openai/local"}  # the real model answered them all
    assert {c["role"] for c in calls} >= {"ideator"}

    # Every answer was used, or refused with its reason: an ideator answer that was not refused
    # became nodes or ideas dropped with why.
    refused = [p for t, p in events if t == "llm.refused"]
    assert all(r["reason"] and r["role"] and "answer" in r for r in refused)
    ideator_calls = sum(c["role"] == "ideator" for c in calls)
    ideator_refused = sum(r["role"] == "ideator" for r in refused)
    nodes = list(
        con.execute(
            "select id, status, origin, edits, dev_n, gated, gate_reason from node where parent_id is not null"
        )
    )
    dropped = [p for t, p in events if t == "proposal.dropped"]
    assert all(d["reason"] for d in dropped)
    used = ideator_calls - ideator_refused
    proposed = [n for n in nodes if n[2] != "revisit"]
    assert used >= 1 and len(proposed) + len(dropped) >= used  # each answer used gave a node or a drop
    # The model proposed every node, each a change of the study's settings; nodes reached evaluation.
    assert nodes and all(origin in ("policy", "refine", "restart", "revisit") for _, _, origin, *_ in nodes)
    assert all(json.loads(edits) for _, _, origin, edits, *_ in nodes if origin != "revisit")
    evaluated = [n for n in nodes if n[4] > 0]
    assert len(evaluated) >= EXPERIMENTS - 1, nodes
    # The gate behaved as with any policy: a merge only through it, with its reason recorded.
    for _, node_status, _, _, _, gated, gate_reason in nodes:
        if node_status == "merged":
            assert gated and gate_reason
    # No prompt held a held-out number.
    heldout = [v for (values,) in con.execute("select heldout_values from node") for v in json.loads(values)]
    prompts = " ".join(m for (m,) in con.execute("select messages from llm_call"))
    assert not [v for v in heldout if f"{v:.6g}" in prompts and len(f"{v:.6g}") > 4]
