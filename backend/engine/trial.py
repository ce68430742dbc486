"""Trial runs of a study's dev evaluator on its base, before any study exists (`grove validate`)."""

from __future__ import annotations

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
    """Yield a dev run (seed 0) on `base` per variant (files replaced by the texts given), in one tree.

    `source` names the repository as a study of it would (its environment build is then shared
    with the study's). The tree and environment are released when the iterator is exhausted or closed. Raises
    `environment.SetupFailed` when the environment cannot be built, and ValueError for a variant
    naming a link.
    """
    study = Study(name=spec.study.name, goal=spec.study.goal, spec_toml="", source=source, base_commit=base)
    label = f"validate-{uuid.uuid4().hex[:8]}"
    tree = workspace.worktree_path(settings, study, label)
    out = Path(tempfile.mkdtemp(prefix="grove-trial-"))
    workspace.prepare(
        repo, tree, f"grove/{study.name}/validate", base, sealed=spec.files.sealed, reason=label
    )
    try:
        iso = environment.ensure(settings, study, spec, repo, base, workspace.isolation_of(settings))
        for texts in variants:
            for f in texts:
                if (tree / f).is_symlink() or not (tree / f).resolve().is_relative_to(tree.resolve()):
                    raise ValueError(f"{f}: a link or outside the tree; a trial writes only plain files")
            saved = {f: (tree / f).read_text("utf-8") for f in texts}
            for f, text in texts.items():
                (tree / f).write_text(text, "utf-8")
            try:
                yield evaluation.evaluate(
                    kind="dev", command=spec.evaluate.dev, worktree=tree, output_dir=out, seed=0,
                    metric=spec.objective.metric, commit=base, limits=workspace.limits_of(spec),
                    evaluator_fingerprint="", isolation=iso, output_cap=settings.output_cap_bytes,
                    tail_bytes=settings.tail_bytes,
                )  # fmt: skip
            finally:
                for f, text in saved.items():
                    (tree / f).write_text(text, "utf-8")
    finally:
        environment.release()
        repo.remove_worktree(tree)
        shutil.rmtree(out, ignore_errors=True)
