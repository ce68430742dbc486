"""A learning job's run against a deterministic store: what reaches the store when the API goes away."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from backend.core.config import Settings
from backend.core.models import LearningJob
from backend.engine import learning
from backend.engine.jobstore import Refused, Unreachable


class Store:
    """A `LearningStore` that records its calls; `progress` is unreachable the first `away` times."""

    def __init__(self, away: int = 0, refuse_finish: bool = False) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.away, self.refuse_finish = away, refuse_finish

    def claim(self, host: str, pid: int) -> LearningJob | None:
        params = learning.SparseEvalParams(docs=4, doc_len=8, pool=4, top_k=2, trials=16, device="cpu")
        return LearningJob(id=7, kind="sparse_eval", params=params.model_dump(), status="running", host=host)

    def progress(self, fraction: float, payload: dict[str, Any]) -> None:
        if self.away:
            self.away -= 1
            raise Unreachable("cannot reach the API")
        self.calls.append(("progress", fraction))

    def fail(self, reason: str) -> None:
        self.calls.append(("fail", reason))

    def finish(self, result: dict[str, Any], artifact: str) -> None:
        if self.refuse_finish:
            raise Refused("result: more than 256000 bytes as JSON")
        self.calls.append(("finish", artifact))

    def records(self) -> list[dict[str, Any]]:
        return []


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path / "data", worktrees_dir=tmp_path / "wt")


def test_an_api_out_of_reach_mid_job_is_raised_not_recorded_as_the_jobs_failure(settings: Settings) -> None:
    store = Store(away=1)
    with pytest.raises(Unreachable):
        learning.run(settings, 7, store)
    assert store.calls == []  # the task runs it again once the API is back; nothing was failed
    again = Store()
    assert learning.run(settings, 7, again) == "done"
    assert again.calls == [
        ("progress", 0.5),
        ("progress", 1.0),
        ("finish", str(settings.data_dir / "learning" / "job-7")),
    ]


def test_a_result_the_server_refuses_still_ends_the_job(settings: Settings) -> None:
    store = Store(refuse_finish=True)
    assert learning.run(settings, 7, store) == "failed"
    assert store.calls[-1][0] == "fail" and "refused" in store.calls[-1][1]


def test_non_finite_numbers_become_null_before_they_are_stored_or_sent() -> None:
    got = learning.finite({"loss": math.nan, "curve": [1.0, math.inf, (-math.inf, 2)], "name": "x", "n": 3})
    assert got == {"loss": None, "curve": [1.0, None, [None, 2]], "name": "x", "n": 3}
