"""Trial runs of a study's dev evaluator on its base, before any study exists (`grove validate`)."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Generator
from pathlib import Path

from agents.spec import Spec
from backend.core import gitops
from backend.core.config import Settings
from backend.core.models import Study
from backend.engine import environment, evaluation, workspace


def trial_runs(
    settings: Settings,
    spec: Spec,
    repo: gitops.Repo,
    base: str,
    variants: list[dict[str, str]],
    source: str = "",
) -> Generator[evaluation.Receipt]:
    """Yield a dev run (seed 0) on `base` per variant (files replaced by the texts given).

    Each variant runs in a fresh worktree of `base`, so nothing a run leaves (a checkpoint, a file
    swapped for a link) reaches the next. `source` names the repository as a study of it would
    (its environment build is then shared with the study's). Worktrees and the environment are
    released when the iterator is exhausted or closed. Raises `environment.SetupFailed` when the
    environment cannot be built, and ValueError for a variant naming a link or a path outside.
    """
    study = Study(name=spec.study.name, goal=spec.study.goal, spec_toml="", source=source, base_commit=base)
    out = Path(tempfile.mkdtemp(prefix="grove-trial-"))
    iso = None
    try:
        for n, texts in enumerate(variants):
            label = f"validate-{uuid.uuid4().hex[:8]}"
            tree = workspace.worktree_path(settings, study, label)
            branch = f"grove/{study.name}/validate-{n}"
            workspace.prepare(repo, tree, branch, base, sealed=spec.files.sealed, reason=label)
            try:
                if iso is None:
                    iso = environment.ensure(
                        settings, study, spec, repo, base, workspace.isolation_of(settings)
                    )
                for f, text in texts.items():
                    _write_inside(tree, f, text)
                yield evaluation.evaluate(
                    kind="dev", command=spec.evaluate.dev, worktree=tree, output_dir=out / str(n), seed=0,
                    metric=spec.objective.metric, commit=base, limits=workspace.limits_of(spec),
                    evaluator_fingerprint="", isolation=iso, output_cap=settings.output_cap_bytes,
                    tail_bytes=settings.tail_bytes,
                )  # fmt: skip
            finally:
                repo.remove_worktree(tree)
                repo.git("branch", "-D", branch, check=False)
    finally:
        environment.release()
        shutil.rmtree(out, ignore_errors=True)


def _write_inside(tree: Path, rel: str, text: str) -> None:
    """Replace a plain file of a fresh tree, refusing links anywhere on its path."""
    path = tree
    for part in Path(rel).parts:
        if part in ("..", "/") or (path / part).is_symlink():
            raise ValueError(f"{rel}: a link or a path outside the tree; a trial writes only plain files")
        path = path / part
    if not path.is_file():
        raise ValueError(f"{rel}: not a file of the tree")
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
