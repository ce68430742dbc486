"""`GET /studies` with 200 studies: the listing's counters in bulk queries vs one set per study.

Writes 200 studies (30 nodes and 30 experiment jobs each, some approvals and LLM calls) straight
into a fresh SQLite database, then times in one run:

- `GET /api/v1/studies?limit=200` through the real app (FastAPI's test client, in-process), the
  requests back to back;
- alternately, the same page's serialisation by `serializers.study_publics` (every counter in a fixed number of
  grouped queries), and by the per-study way it was done before (the same function called once
  per study: six queries for each).

    python benchmarks/studies_list.py [--studies 200] [--requests 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def p95(xs: list[float]) -> float:
    return sorted(xs)[max(0, int(round(0.95 * len(xs))) - 1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--studies", type=int, default=200)
    ap.add_argument("--requests", type=int, default=30)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="grove-studies-list-") as tmp:
        os.environ["GROVE_DATA_DIR"] = str(Path(tmp) / "data")
        os.environ.pop("GROVE_DATABASE_URL", None)
        from fastapi.testclient import TestClient
        from sqlmodel import select

        from backend.api.app import app
        from backend.api.serializers import study_publics
        from backend.core import db
        from backend.core.config import get_settings
        from backend.core.models import Approval, Job, LlmCall, Node, Study
        from backend.core.security import create_token
        from tests.support.repos import tiny_files

        settings = get_settings()
        settings.ensure_dirs()
        with db.session(settings.db_url) as s:
            for i in range(args.studies):
                st = Study(name=f"s{i}", spec_toml=tiny_files(name=f"s{i}")["grove.toml"], source="bench")
                s.add(st)
                s.flush()
                for k in range(30):
                    n = Node(study_id=st.id or 0, depth=1 if k else 0, title=f"n{k}", status="evaluated",
                             dev_mean=float(k), verification={"decision": "accept"})  # fmt: skip
                    s.add(n)
                    s.flush()
                    s.add(Job(study_id=st.id or 0, node_id=n.id or 0, attempt=1, status="done"))
                    if k % 10 == 0:
                        s.add(Approval(study_id=st.id or 0, node_id=n.id or 0))
                        s.add(LlmCall(study_id=st.id or 0, role="ideator", model="m", tokens_in=5, usd=0.1))
            s.commit()
        token = create_token(settings, ["viewer"], "bench")
        client = TestClient(app)
        headers = {"Authorization": f"Bearer {token}"}
        times: dict[str, list[float]] = {"GET /studies (bulk)": [], "bulk serialisation": [], "per study": []}
        # The requests on their own, as a server answers them; then the two serialisations alternately.
        for _ in range(args.requests):
            t0 = time.perf_counter()
            resp = client.get(f"/api/v1/studies?limit={args.studies}", headers=headers)
            times["GET /studies (bulk)"].append(time.perf_counter() - t0)
            assert resp.status_code == 200 and len(resp.json()["data"]) == args.studies, resp.text[:300]
        for _ in range(args.requests):
            with db.session(settings.db_url) as s:
                rows = list(s.exec(select(Study).order_by(Study.id.desc())))  # type: ignore[union-attr]
                t0 = time.perf_counter()
                bulk = study_publics(s, rows)
                times["bulk serialisation"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                each = [study_publics(s, [r])[0] for r in rows]
                times["per study"].append(time.perf_counter() - t0)
                assert bulk == each
    print(f"{args.studies} studies, {args.requests} rounds, SQLite:\n")
    print("| measure | median | p95 |")
    print("|---|---|---|")
    for name, xs in times.items():
        print(f"| {name} | {statistics.median(xs) * 1000:.1f} ms | {p95(xs) * 1000:.1f} ms |")
    ratio = statistics.median(times["per study"]) / statistics.median(times["bulk serialisation"])
    print(f"\nper study / bulk: {ratio:.1f}x")


if __name__ == "__main__":
    main()
