"""Events in words: one line per event, for the study's timeline and a node's history."""

from __future__ import annotations

from typing import Any

from client.models import Event

WORDS = {
    "node.proposed": "proposed",
    "node.queued": "queued",
    "node.running": "started running",
    "node.evaluated": "measured on dev",
    "node.verified": "verified",
    "node.integrated": "integrated into the tree",
    "node.repeated": "more dev runs asked",
    "node.not_repeated": "no more dev runs: the gain is too small to confirm",
    "node.awaiting_approval": "passed the held-out gate; waits for a human decision",
    "node.gate_passed": "passed the held-out gate",
    "node.gate_failed": "did not pass the held-out gate",
    "node.merged": "merged into trunk",
    "node.rejected": "rejected",
    "node.failed": "failed",
    "node.pruned": "pruned",
    "node.cancelled": "cancelled",
    "node.relabeled": "relabelled",
    "approval.opened": "an approval opened",
    "study.cloning": "study: cloning the repository",
    "study.started": "study started",
    "study.paused": "study paused",
    "study.resumed": "study resumed",
    "study.stopping": "study stopping",
    "study.finished": "study finished",
    "study.failed": "study failed",
    "study.promoted": "trunk promoted to the origin",
    "study.unsandboxed": "study runs without the sandbox",
    "search.widened": "a search range widened",
    "insight.updated": "insight updated",
    "state.updated": "improvement state updated",
    "trunk.repeated": "trunk's dev runs repeated",
    "evaluator.deterministic": "dev evaluation gives the same value for every seed: one run each from now",
    "job.started": "a job started",
    "job.crashed": "a job's worker died; the job runs again",
    "gate.refused": "the gate refused what a worker published",
    "notify.failed": "the approval webhook could not be called",
    "llm.refused": "a model's answer was refused",
}
SHOWN = (
    "by",
    "reason",
    "gain",
    "gain_lcb",
    "heldout_gain",
    "passed",
    "seeds",
    "key",
    "bound",
    "old",
    "new",
    "status",
)


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:+.4g}"
    if isinstance(v, list):
        return ", ".join(_value(x) for x in v[:8]) + (" …" if len(v) > 8 else "")
    return str(v)


def sentence(e: Event, number: dict[int, int]) -> str:
    """Return an event as one line: 'HH:MM:SS · n5 merged into trunk (by ada)'."""
    what = WORDS.get(e["type"], e["type"].replace(".", " ").replace("_", " "))
    node = e.get("node_id")
    who = f"n{number.get(node, '?')} " if node else ""
    payload = e.get("payload") or {}
    details = [
        f"{k.replace('_', ' ')} {_value(payload[k])}"
        for k in SHOWN
        if k in payload and payload[k] not in ("", None)
    ]
    line = f"{str(e['time'])[11:19]} · {who}{what}" + (f" ({'; '.join(details)})" if details else "")
    return line[:300]


def lines(events: list[Event], number: dict[int, int]) -> str:
    """Return events as a readable timeline, one per line (plain text: reasons may quote a model)."""
    return "\n".join(sentence(e, number) for e in events)
