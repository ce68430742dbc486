"""The Studies page and the connection: listing, the new-study form, and clear failures."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.frontend.conftest import Api, app_test, right_after, texts
from tests.support.repos import make_repo, tiny_files
from tests.support.waiting import free_port


def count(api: Api) -> int:
    return int(
        httpx.get(f"{api.url}/studies", headers={"Authorization": f"Bearer {api.approver}"}).json()["count"]
    )


def test_api_down_and_wrong_token_are_explained(api: Api) -> None:
    down = app_test(f"http://127.0.0.1:{free_port()}/api/v1", api.approver)
    assert not down.exception
    assert "did not answer" in texts(down) and "grove up" in texts(down)

    wrong = app_test(api.url, "grove_not-a-token")
    assert not wrong.exception
    assert "refused the token" in texts(wrong)

    conn = app_test(api.url, "", page="views/connection.py")
    conn.text_input(key="conn_token").input("grove_wrong")
    conn.button(key="connect").click().run()
    assert "refused this token" in texts(conn)
    conn.text_input(key="conn_token").input(api.viewer)
    conn.button(key="connect").click().run()
    assert "Connected to" in texts(conn)
    assert conn.session_state["token"] == api.viewer


def test_form_shows_errors_next_to_the_field_and_creates_nothing(api: Api, tmp_path: Path) -> None:
    before = count(api)
    at = app_test(api.url, api.approver)
    assert "New study" in texts(at)

    at.text_input(key="repository").input(str(tmp_path / "missing"))
    at.button(key="create").click().run()
    assert not at.exception
    errors = [e.value for e in at.error]
    assert any(e.startswith("repository:") and "does not exist" in e for e in errors), errors
    assert right_after(at, "repository").value.startswith("repository:")  # type: ignore[attr-defined]

    repo = make_repo(tmp_path / "r", tiny_files(name="form-bad"))
    at.text_input(key="repository").input(str(repo))
    at.text_area(key="spec_text").input("[study\nname = 'x'")
    at.button(key="create").click().run()
    errors = [e.value for e in at.error]
    assert len(errors) == 1 and "TOML" in errors[0], errors
    assert "TOML" in right_after(at, "spec_text").value  # type: ignore[attr-defined]
    assert count(api) == before

    at.text_area(key="spec_text").input(
        (repo / "grove.toml").read_text().replace('metric = "score"', 'metric = ""')
    )
    at.button(key="validate").click().run()
    assert right_after(at, "spec_text").value.startswith("objective.metric:")  # type: ignore[attr-defined]
    assert count(api) == before


def test_form_validates_then_creates_a_study(api: Api, tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r", tiny_files(name="form-ok", experiments=2))
    at = app_test(api.url, api.approver)
    at.text_input(key="repository").input(str(repo))
    at.text_area(key="spec_text").input((repo / "grove.toml").read_text())
    at.button(key="validate").click().run()
    assert any("valid" in s.value for s in at.success)
    before = count(api)
    at.button(key="create").click().run()
    assert not at.exception
    assert any("Created study 'form-ok'" in s.value for s in at.success), texts(at)
    assert count(api) == before + 1
    rows = at.dataframe[0].value.to_dict("records")
    assert any(r["study"] == "form-ok" for r in rows)
    assert "None" not in str(rows)  # an empty value reads as a dash, never "None"

    at.button(key="create").click().run()  # the same name again
    assert right_after(at, "spec_text").value.startswith("study.name: study 'form-ok' already exists")  # type: ignore[attr-defined]
    assert count(api) == before + 1
