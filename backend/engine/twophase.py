"""The two-phase sealed test: the candidate predicts without the labels, protected code scores.

Phase one runs `evaluate.test_predict` on the candidate's tree, where every sealed file is absent
but the `evaluate.test_inputs`; it writes what it predicts under `$GROVE_OUTPUTS`. Those outputs
are copied (regular files and folders only, so no link can point the scorer at the labels) into a
second tree that holds nothing but the study's protected and sealed files, where
`evaluate.test_score` reads them and reports the metric, in the environment built from the study's
base commit. No file a change may edit is in the second box: nothing the candidate wrote runs
beside the labels.
"""

from __future__ import annotations

import functools
import os
import shutil
import stat
from pathlib import Path

from agents import globs
from agents.spec import Spec
from backend.core.gitops import Repo
from backend.engine import evaluation, sandbox

OUTPUTS = ".grove-outputs"  # the folder $GROVE_OUTPUTS names, in both trees


class OutputsTooLarge(RuntimeError):
    """The predict phase wrote more than a run may write."""


def score_tree(repo: Repo, path: Path, branch: str, commit: str, spec: Spec, reason: str) -> list[str]:
    """Create a worktree of `commit` that holds only its protected and sealed files; return their paths."""
    repo.add_worktree(path, branch, commit, reason=reason)
    tracked = repo.files_at(commit)
    kept = set(globs.select(spec.files.protected + spec.files.sealed, tracked))
    for rel in tracked:
        if rel not in kept:
            (path / rel).unlink(missing_ok=True)
    for folder, _, _ in sorted(os.walk(path), key=lambda w: -len(w[0])):
        here = Path(folder)
        if here != path and here.name != ".git" and not any(here.iterdir()):
            here.rmdir()
    return sorted(kept)


def copy_outputs(src: Path, dest: Path, cap_bytes: int) -> list[str]:
    """Copy the regular files and folders under `src` to `dest` (links and devices left out); return the files."""
    dest.mkdir(parents=True)
    copied: list[str] = []
    total = 0

    def walk(here: Path, rel: str) -> None:
        nonlocal total
        with os.scandir(here) as entries:
            for entry in entries:
                name = f"{rel}{entry.name}"
                if entry.is_dir(follow_symlinks=False):
                    (dest / name).mkdir()
                    walk(Path(entry.path), f"{name}/")
                    continue
                if not entry.is_file(follow_symlinks=False):
                    continue
                fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
                with os.fdopen(fd, "rb") as fh:
                    if not stat.S_ISREG(os.fstat(fd).st_mode):
                        continue
                    with (dest / name).open("wb") as out:
                        while chunk := fh.read(1 << 20):
                            total += len(chunk)
                            if total > cap_bytes:
                                raise OutputsTooLarge(
                                    f"the predict phase wrote more than {cap_bytes >> 20} MB"
                                )
                            out.write(chunk)
                copied.append(name)

    walk(src, "")
    return copied


def clear(path: Path) -> None:
    """Remove an outputs folder, whatever a run left there (a link is removed, never followed)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def run(
    *,
    kind: str,
    predict: str,
    score: str,
    tree: Path,
    scored: Path,
    kept: list[str],
    output_dir: Path,
    seed: int,
    metric: str,
    commit: str,
    limits: sandbox.Limits,
    fingerprint: str,
    bounds: tuple[float, float] | None,
    isolation: sandbox.Isolation,
    score_isolation: sandbox.Isolation,
    readonly: tuple[str, ...],
    output_cap: int,
    tail_bytes: int,
) -> list[evaluation.Receipt]:
    """Run one seed's predict phase and, if it succeeded, its score phase; return their receipts."""
    outputs, received = tree / OUTPUTS, scored / OUTPUTS
    evaluate = functools.partial(
        evaluation.evaluate, output_dir=output_dir, seed=seed, commit=commit, limits=limits,
        evaluator_fingerprint=fingerprint, output_cap=output_cap, tail_bytes=tail_bytes,
    )  # fmt: skip
    clear(outputs)
    outputs.mkdir()
    try:
        seen = f"{sandbox.TREE}/{OUTPUTS}" if isolation.boxed else str(outputs)
        predicted = evaluate(
            kind=f"{kind}-predict", command=predict, worktree=tree, metric=None, isolation=isolation,
            readonly=readonly, env={"GROVE_OUTPUTS": seen},
        )  # fmt: skip
        if not predicted.ok:
            return [predicted]
        clear(received)
        try:
            files = copy_outputs(outputs, received, (limits.disk_mb or 2048) << 20)
        except OutputsTooLarge as exc:
            predicted.ok, predicted.reason = False, str(exc)
            return [predicted]
    finally:
        clear(outputs)
    try:
        seen = f"{sandbox.TREE}/{OUTPUTS}" if score_isolation.boxed else str(received)
        scored_receipt = evaluate(
            kind=kind, command=score, worktree=scored, metric=metric, bounds=bounds,
            isolation=score_isolation, readonly=(*kept, *(f"{OUTPUTS}/{f}" for f in files)),
            env={"GROVE_OUTPUTS": seen},
        )  # fmt: skip
    finally:
        clear(received)
    return [predicted, scored_receipt]
