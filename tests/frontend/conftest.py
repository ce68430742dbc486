"""A real Grove API on loopback (uvicorn in a thread), with real Celery workers behind it."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from streamlit.testing.v1 import AppTest

from backend.api.main import create_app
from backend.core.config import PROJECT_ROOT, Settings
from backend.core.security import create_token
from tests.support.services import Service, serve, sqlite_service
from tests.support.waiting import free_port

APP = str(PROJECT_ROOT / "frontend" / "app.py")


@dataclass
class Api:
    url: str
    settings: Settings
    approver: str
    viewer: str
    service: Service


@pytest.fixture(scope="package")
def api(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Api]:
    """Start the API and a coordinator and cpu worker over one SQLite database."""
    svc = sqlite_service(tmp_path_factory.mktemp("dashboard"), redis_url, db_number=7)
    settings = svc.settings
    svc.start_worker("dash-coord", "coordinator", 2)
    svc.start_worker("dash-cpu", "cpu,sealed", 2)
    port = free_port()
    server, thread = serve(create_app(settings), port)
    approver = create_token(settings, ["operator", "approver"], "dashboard-test")
    viewer = create_token(settings, ["viewer"], "dashboard-viewer")
    yield Api(f"http://127.0.0.1:{port}/api/v1", settings, approver, viewer, svc)
    server.should_exit = True
    thread.join(timeout=30)
    svc.stop()


def app_test(api_url: str, token: str, page: str | None = None, **params: object) -> AppTest:
    """Return an AppTest of the dashboard connected to `api_url` with `token`, on `page`."""
    at = AppTest.from_file(APP, default_timeout=60)
    at.session_state["api_url"] = api_url
    at.session_state["token"] = token
    for k, v in params.items():
        at.query_params[k] = str(v)
    at.run()
    if page is not None:
        at.switch_page(page)
        for k, v in params.items():
            at.query_params[k] = str(v)
        at.run()
    return at


def shown(markdown: str) -> str:
    """Return Markdown as a reader sees it: no backslash before punctuation, no invisible word joiner."""
    return re.sub(r"\\([!-/:-@\[-`{-~])", r"\1", markdown).replace("\u2060", "")


def texts(at: AppTest) -> str:
    """Return every piece of text the page shows, joined (for assertions)."""
    parts: list[str] = []
    for kind in ("title", "subheader", "markdown", "caption", "error", "success", "info", "warning", "code"):
        parts += [str(e.value) if kind == "code" else shown(str(e.value)) for e in getattr(at, kind)]
    parts += [f"{m.label}={m.value}" for m in at.metric]
    return "\n".join(parts)


def right_after(at: AppTest, key: str) -> object:
    """Return the element the page shows directly after the widget with `key`."""
    flat = [at.main.children[i] for i in sorted(at.main.children)]
    index = next(i for i, e in enumerate(flat) if getattr(e, "key", None) == key)
    return flat[index + 1]
