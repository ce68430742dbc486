"""`grove run` in approve mode asks in a real terminal (a pseudo-terminal here)."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

from sqlmodel import col
from sqlmodel import select as sql_select

from backend.core import db
from backend.core.config import PROJECT_ROOT, Settings
from backend.core.models import Approval, Event, Node
from tests.support.repos import make_repo, tiny_files
from tests.support.waiting import wait_for


class Terminal:
    """A child process on a pseudo-terminal, read with deadlines."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=PROJECT_ROOT)
        os.close(slave)
        self.seen = ""
        self.cursor = 0  # output before this was matched already

    def expect(self, *texts: str, timeout: float = 120) -> str:
        """Wait for the first of `texts` to appear after the last match; return it."""
        deadline = time.monotonic() + timeout
        while True:
            found = [(self.seen.find(t, self.cursor), t) for t in texts if t in self.seen[self.cursor :]]
            if found:
                at, text = min(found)
                self.cursor = at + len(text)
                return text
            left = deadline - time.monotonic()
            assert left > 0, f"{texts!r} never appeared; screen so far:\n{self.seen[-2000:]}"
            ready, _, _ = select.select([self.master], [], [], left)
            if ready:
                try:
                    self.seen += os.read(self.master, 65536).decode("utf-8", "replace")
                except OSError:  # the child closed the terminal
                    raise AssertionError(f"{texts!r} never appeared; screen:\n{self.seen[-2000:]}") from None

    def send(self, line: str) -> None:
        os.write(self.master, (line + "\r").encode())

    def close(self) -> int:
        try:
            code = self.proc.wait(timeout=120)
        finally:
            os.close(self.master)
        return code


def explored_while_asking(settings: Settings) -> bool:
    """Return whether a node queued after the first approval opened has been integrated by the study.

    Its experiment marks it evaluated on its own; only the study's loop integrates it.
    """
    with db.session(settings.db_url) as s:
        events = list(s.exec(sql_select(Event).order_by(col(Event.id))))
    opened = next((e.id or 0 for e in events if e.type == "node.awaiting_approval"), None)
    if opened is None:
        return False
    later = [e for e in events if (e.id or 0) > opened]
    queued = {e.node_id for e in later if e.type == "node.queued"}
    return bool(queued & {e.node_id for e in later if e.type == "node.integrated"})


def test_approve_and_reject_at_the_terminal(settings: Settings, tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r", tiny_files(mode="approve", experiments=10, margin=0.5))
    env = {
        **os.environ,
        "GROVE_DATA_DIR": str(settings.data_dir),
        "GROVE_WORKTREES_DIR": str(settings.worktrees_dir),
        "COLUMNS": "120",
    }
    term = Terminal([sys.executable, "-m", "backend.cli.main", "run", str(repo)], env)
    term.expect("Merge into trunk?")
    # Nobody answers yet, and the study goes on: a node queued after the question opened is evaluated.
    wait_for(lambda: explored_while_asking(settings), timeout=120)
    term.send("n")
    term.expect("Reason")
    term.send("not convinced yet")
    term.expect("Merge into trunk?")  # a later candidate asks again
    term.send("y")
    while term.expect("report:", "Merge into trunk?") != "report:":
        term.send("y")  # the merge opened the way for yet another candidate
    assert term.close() == 0
    with db.session(settings.db_url) as s:
        approvals: dict[str, Approval] = {}
        for a in s.exec(sql_select(Approval).order_by(col(Approval.id))):
            approvals.setdefault(a.status, a)  # the first decision of each kind
        rejected = s.get(Node, approvals["rejected"].node_id)
        merged = s.get(Node, approvals["approved"].node_id)
    assert (
        approvals["rejected"].reason == "not convinced yet" and approvals["rejected"].decided_by == "terminal"
    )
    assert rejected is not None and rejected.status == "rejected"
    assert merged is not None and merged.status == "merged"
    assert approvals["approved"].decided_by == "terminal"
