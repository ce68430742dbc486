"""The client's typed bodies stay equal to the API's response schemas, and errors map to their classes."""

from __future__ import annotations

import json
import threading
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from pydantic import BaseModel

from backend.api import schemas
from client import Conflict, Forbidden, Grove, Invalid, NotFound, Unauthorized, Unreachable, models

PAIRS: list[tuple[type, type[BaseModel]]] = [
    (models.Study, schemas.StudyPublic),
    (models.NodeSummary, schemas.NodeSummary),
    (models.NodeDetail, schemas.NodeDetail),
    (models.Tree, schemas.Tree),
    (models.Event, schemas.EventPublic),
    (models.Approval, schemas.ApprovalPublic),
    (models.Progress, schemas.Progress),
    (models.LearningJob, schemas.LearningJobPublic),
    (models.Message, schemas.Message),
]


@pytest.mark.parametrize(("body", "schema"), PAIRS, ids=[p[0].__name__ for p in PAIRS])
def test_client_bodies_have_the_fields_of_the_api_schemas(body: type, schema: type[BaseModel]) -> None:
    assert set(typing.get_type_hints(body)) == set(schema.model_fields)


@contextmanager
def answering(status: int, detail: object) -> Iterator[Grove]:
    """Serve, on loopback, an API that answers every request with this status and JSON `detail`."""
    body = json.dumps({"detail": detail}).encode()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args: object) -> None:
            """Keep the test output quiet."""

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    api = Grove(f"http://127.0.0.1:{server.server_address[1]}/api/v1", "t")
    try:
        yield api
    finally:
        api.close()
        server.shutdown()


@pytest.mark.parametrize(
    ("status", "kind"),
    [(401, Unauthorized), (403, Forbidden), (404, NotFound), (409, Conflict), (422, Invalid)],
)
def test_each_error_status_raises_its_own_class(status: int, kind: type[Exception]) -> None:
    with answering(status, "no") as api, pytest.raises(kind):
        api.study(1)


def test_invalid_carries_the_field_errors() -> None:
    detail = {"message": "spec.study.name: taken", "errors": [{"key": "spec.study.name", "message": "taken"}]}
    with answering(422, detail) as api, pytest.raises(Invalid) as caught:
        api.create("x", "y")
    assert caught.value.status == 422 and caught.value.for_field("spec") == ["study.name: taken"]


def test_a_closed_port_is_unreachable() -> None:
    with pytest.raises(Unreachable, match="did not answer"):
        Grove("http://127.0.0.1:9/api/v1", timeout=2).health()
