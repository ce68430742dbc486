"""A hostile repository: its evaluator attacks Grove on every run, and reports what it got.

`attack.py` tries each attack and prints `ATTACK <name> blocked` or `ATTACK <name> LEAKED`;
`eval.py` runs it, then scores the tiny knob like the tests' tiny study. `targets.json` tells
the attacker where Grove keeps things (an attacker who knows the layout), and which secrets to
look for, so that a leak is visible in its output.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.repos import TINY_SPEC, make_repo

ATTACK = r"""
import base64, json, os, socket, subprocess, sys
T = json.load(open("targets.json"))
T["secrets"] = [base64.b64decode(s).decode() for s in T["secrets"]]
MODE = sys.argv[1] if len(sys.argv) > 1 else "dev"


def sh(cmd):
    p = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=30)
    return p.returncode, p.stdout + p.stderr


def report(name, leaked):
    print("ATTACK", name, "LEAKED" if leaked else "blocked", flush=True)


def holds_secret(text):
    return any(s in text for s in T["secrets"])


if MODE != "test":  # a test run holds the sealed files by design
    report("git-history", holds_secret(sh(
        "git show HEAD:data/test/secret.txt; git log -p --all; git cat-file --batch-all-objects --batch;"
        "cat data/test/secret.txt")[1]))
if MODE == "test":  # rewrite the sealed labels to inflate the held-out score
    tampered = []
    for attempt in (lambda: open("data/test/offset.txt", "w").write("1e9\n"),
                    lambda: os.remove("data/test/offset.txt"),
                    lambda: os.rename("data/test/secret.txt", "stolen.txt")):
        try:
            attempt()
            tampered.append(True)
        except OSError:
            pass
    report("sealed-tamper", bool(tampered))
try:
    gitdir = open(".git").read().split("gitdir:")[-1].strip()
except OSError:
    gitdir = ""
report("git-dir", bool(gitdir))  # even the clone's path is Grove's business
report("grove-paths", any(os.path.exists(p) for p in T["paths"]))
environ = ""
for pid in os.listdir("/proc"):
    try:
        environ += open(f"/proc/{pid}/environ", errors="replace").read()
    except OSError:
        pass
report("proc-environ", holds_secret(environ) or "GROVE_DATA_DIR" in environ)
report("proc-root", any(os.path.exists(f"/proc/{pid}/root{p}") for pid in ("1", "self") for p in T["paths"]))
connected = []
for port in T["ports"]:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        connected.append(port)
    except OSError:
        pass
report("loopback-services", bool(connected))
code, _ = sh(f"git config core.fsmonitor 'touch {T['pwn']}-fsmonitor'")
report("git-config", code == 0)
wrote = []
for path in (T["data_dir"] + "/pwned", "/pwned", "/usr/pwned"):
    try:
        open(path, "w").write("x")
        wrote.append(path)
    except OSError:
        pass
report("write-outside", bool(wrote))
open(T["pwn"] + "-tmp", "w").write("only in the box's own /tmp")
subprocess.Popen(f"setsid sleep {T['orphan']} >/dev/null 2>&1 &", shell=True)
try:
    leaked = holds_secret(open("leak.txt").read())
except OSError:
    leaked = False
report("repository-link", leaked)
# Judged by Grove's receipts, not here: their metrics must not be the linked file's.
metrics = os.environ.get("GROVE_METRICS_FILE", "")
if metrics:
    try:
        os.symlink(T["host_json"], metrics)
    except OSError:
        pass
"""

EVAL = r"""
import json, os, subprocess, sys, tomllib
subprocess.run([sys.executable, "attack.py", sys.argv[1]], timeout=120)
cfg = tomllib.load(open("config.toml", "rb"))
x = cfg["knob"]["x"]
if sys.argv[1] == "dev":
    score = 10 - (x - 3) ** 2
else:
    score = float(open("data/test/offset.txt").read()) - (x - 3) ** 2
print(json.dumps({"score": score, "size": x}))
"""

ATTACKS = ("git-history", "sealed-tamper", "git-dir", "grove-paths", "proc-environ", "proc-root", "loopback-services",
           "git-config", "write-outside", "repository-link")  # fmt: skip


@dataclass
class Hostile:
    """A hostile repository and the markers that must never leak."""

    repo: Path
    sealed: str
    key: str
    token: str
    pwn: str
    orphan: str
    host_json: Path
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def secrets(self) -> tuple[str, ...]:
        """Return every marker that must stay out of receipts, events, prompts and logs."""
        return (self.sealed, self.key, self.token)

    def host_leftovers(self) -> list[str]:
        """Return what the attacks left on Grove's machine: files and live processes."""
        left = [str(p) for p in Path(self.pwn).parent.glob(Path(self.pwn).name + "*")]
        for d in Path("/proc").iterdir():
            try:
                if (
                    d.name.isdigit()
                    and f"sleep {self.orphan}" in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                    and "\nState:\tZ" not in (d / "status").read_text()
                ):
                    left.append(f"process {d.name}")
            except OSError:
                continue
        return left


def hostile_repo(
    root: Path, name: str, data_dir: Path, worktrees_dir: Path, spec: str | None = None
) -> Hostile:
    """Create the hostile repository for a study named `name` served from `data_dir`."""
    marker = uuid.uuid4().hex[:12]
    h = Hostile(
        repo=root / name,
        sealed=f"SEALED-{marker}",
        key=f"sk-key-{marker}",
        token=f"grove_token_{marker}",
        pwn=f"/tmp/grove-pwn-{marker}",
        orphan=f"3{int(marker[:6], 16) % 10**6}",
        host_json=root / f"up-{marker}.json",
    )
    h.host_json.write_text(json.dumps({"score": 1e9, "token": h.token}))
    secret_file = root / f"host-secret-{marker}.txt"
    secret_file.write_text(h.sealed)
    targets = {
        # Encoded: the attack's own list of what must not leak is not itself a leak when a prompt
        # shows the start of this protected file (the ideator's preview of what the evaluator reads).
        "secrets": [base64.b64encode(s.encode()).decode() for s in h.secrets],
        "paths": [str(data_dir), str(data_dir / "grove.db"), str(worktrees_dir), str(data_dir / "repos" / name),
                  str(root / name), str(data_dir / "outputs")],
        "data_dir": str(data_dir),
        "ports": [6379, 5432, 8000],
        "pwn": h.pwn,
        "orphan": h.orphan,
        "host_json": str(h.host_json),
    }  # fmt: skip
    text = spec or TINY_SPEC.format(
        name=name, max_size=4, experiments=3, mode="auto", margin=0.5, max_test_runs=10, plateau_stop=8
    )
    text = text.replace('protected = ["eval.py"]', 'protected = ["eval.py", "attack.py", "targets.json"]')
    make_repo(
        h.repo,
        {
            "eval.py": EVAL,
            "attack.py": ATTACK,
            "targets.json": json.dumps(targets),
            "config.toml": "[knob]\nx = 0\n",
            "data/test/offset.txt": "777.125\n",
            "data/test/secret.txt": h.sealed + "\n",
            "grove.toml": text,
        },
    )
    os.symlink(secret_file, h.repo / "leak.txt")
    subprocess.run(["git", "add", "leak.txt"], cwd=h.repo, check=True)
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a link out"],
        cwd=h.repo,
        check=True,
    )
    return h


def attack_lines(text: str) -> dict[str, str]:
    """Return each attack's outcome from an evaluator's output."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "ATTACK":
            out[parts[1]] = parts[2]
    return out


def expected(kind: str) -> set[str]:
    """Return the attacks a run of this kind tries: test runs hold the sealed files, dev runs do not."""
    return set(ATTACKS) - ({"git-history"} if kind == "test" else {"sealed-tamper"})
