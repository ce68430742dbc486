"""Notifications to people: a webhook called when a node starts waiting for a human decision."""

from __future__ import annotations

from typing import Any

import httpx

from backend.core import db
from backend.core.config import Settings
from backend.core.models import Node, Study
from backend.services.records import add_event

TIMEOUT = 5.0


def approval_payload(settings: Settings, study: Study, node: Node) -> dict[str, Any]:
    """Return what the webhook receives about an opened approval (no held-out number in it)."""
    base = settings.dashboard_url.rstrip("/")
    link = f"{base}/approvals?study={study.id}" if base else ""
    return {
        "event": "approval.opened",
        "study_id": study.id,
        "study": study.name,
        "node_id": node.id,
        "node_number": node.number,
        "title": node.title,
        "text": f"Grove: {study.name} n{node.number} ({node.title}) passed the held-out gate and waits for your decision"
        + (f": {link}" if link else "."),
        "link": link,
    }


def approval_opened(settings: Settings, study_id: int, node_id: int) -> None:
    """Call GROVE_NOTIFY_URL about an opened approval (after it is committed); a failure is an event."""
    if not settings.notify_url:
        return
    with db.session(settings.db_url) as s:
        study, node = s.get(Study, study_id), s.get(Node, node_id)
        assert study is not None and node is not None
        payload = approval_payload(settings, study, node)
    outcome: dict[str, Any]
    try:
        r = httpx.post(settings.notify_url, json=payload, timeout=TIMEOUT)
        outcome = {"status": r.status_code}
        if r.is_error:
            outcome["error"] = f"HTTP {r.status_code}"
    except Exception as exc:  # any failure is reported, none stops the study
        # Only the kind of failure: the URL (in httpx's messages) may hold the webhook's secret.
        outcome = {"error": type(exc).__name__}
    with db.session(settings.db_url) as s:
        add_event(s, study_id, "notify.failed" if outcome.get("error") else "notify.sent", node_id, **outcome)
