"""Studies run by real Celery workers over a real Redis broker."""

from __future__ import annotations

import itertools
from pathlib import Path

from sqlmodel import col, select

from backend.core import db
from backend.core.models import Job, Node, Study
from backend.services.studies import create_study
from backend.worker.celery_app import make_app
from tests.conftest import Service, make_repo, tiny_files, wait_for


def study_status(svc: Service, study_id: int) -> str:
    with db.session(svc.settings.db_url) as s:
        st = s.get(Study, study_id)
        assert st is not None
        return st.status


def test_study_runs_to_the_end_on_workers_with_parallel_executors(service: Service, tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r", tiny_files(name="celery-auto", experiments=4, sleep=1.0))
    with db.session(service.settings.db_url) as s:
        study = create_study(s, service.settings, (repo / "grove.toml").read_text(), str(repo))
    make_app(service.settings).send_task("coordinator.advance", args=[study.id])
    wait_for(lambda: study_status(service, study.id or 0) == "finished", timeout=180)
    with db.session(service.settings.db_url) as s:
        st = s.get(Study, study.id)
        jobs = list(s.exec(select(Job).where(Job.study_id == study.id)))
        merged = list(
            s.exec(
                select(Node).where(
                    Node.study_id == study.id, Node.status == "merged", col(Node.parent_id).is_not(None)
                )
            )
        )
    assert st is not None and st.stop_reason.startswith("experiment budget spent")
    assert len(jobs) == 4 and all(j.status == "done" and j.token == f"job-{j.id}-a1" for j in jobs)
    assert merged and st.trunk_commit == merged[-1].gate_commit
    spans = sorted((j.started_at, j.finished_at) for j in jobs if j.started_at and j.finished_at)
    overlaps = any(a[1] > b[0] for a, b in itertools.pairwise(spans))
    assert overlaps, "two executors never ran at once"
