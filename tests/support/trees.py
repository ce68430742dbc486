"""Grow a study's tree straight into its database: the dashboard's tests and benchmarks draw large trees."""

from __future__ import annotations

import random
from pathlib import Path

from backend.core import db
from backend.core.config import Settings
from backend.core.models import Node, Study
from backend.services.studies import create_study
from tests.support.repos import make_repo, tiny_files

STATUSES = ["evaluated"] * 7 + ["rejected"] * 5 + ["failed"] * 3 + ["pruned"] * 2 + ["cancelled", "proposed"]
KNOB = "config.toml:knob.x"  # the tiny study's one [search] key, values 0 to 5


def grow(
    settings: Settings,
    root: Path,
    name: str,
    size: int,
    seed: int = 0,
    status: str = "",
    stop_reason: str = "",
    stop_rule: str = "",
) -> int:
    """Create a study whose tree has `size` nodes with a realistic mix of statuses; return its id.

    Measured nodes set the knob (dev grows with it), so the search-space charts have data; a
    `status` other than "" finishes the study with it.
    """
    rng = random.Random(seed)
    repo = make_repo(root / name, tiny_files(name=name))
    with db.session(settings.db_url) as s:
        study = create_study(s, settings, (repo / "grove.toml").read_text(), str(repo))
    with db.session(settings.db_url) as s:
        root_node = s.get(Node, study.trunk_node_id)
        assert root_node is not None
        root_node.dev_mean, root_node.dev_n = 0.9, 3
        nodes, trunk = [root_node], root_node
        while len(nodes) < size:
            parent = rng.choice(nodes[-200:]) if rng.random() < 0.7 else rng.choice(nodes)
            if parent.status in ("pruned", "failed", "cancelled", "proposed"):
                parent = trunk
            state = "pruned" if parent.status == "pruned" else rng.choice(STATUSES)
            if parent is trunk and len(nodes) % 60 == 0:
                state = "merged"
            x = rng.randrange(6)
            gain = (
                0.01 * x - 0.02 + rng.gauss(0, 0.004)
                if state in ("evaluated", "rejected", "merged")
                else None
            )
            n = Node(study_id=study.id or 0, parent_id=parent.id, depth=parent.depth + 1, status=state,
                     title=f"config.toml:knob.x {x}", edits={KNOB: x},
                     dev_mean=None if gain is None else 0.9 + gain, dev_n=3, gain=gain,
                     gain_lcb=None if gain is None else gain - 0.005)  # fmt: skip
            s.add(n)
            s.flush()
            nodes.append(n)
            if state == "merged":
                trunk = n
        st = s.get(Study, study.id)
        assert st is not None
        st.trunk_node_id, st.baseline_dev, st.trunk_dev = trunk.id, [0.9] * 3, [0.95] * 3
        if status:
            st.status, st.stop_reason, st.stop_rule = status, stop_reason, stop_rule
        s.add(st)
    return study.id or 0
