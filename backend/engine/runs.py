"""Run a worktree's dev or sealed test command on its seeds, in the study's environment, and keep the receipts."""

from __future__ import annotations

from pathlib import Path

from agents import globs
from agents.spec import Spec
from backend.core.config import Settings
from backend.core.gitops import Repo
from backend.core.models import Study
from backend.core.states import RunKind
from backend.engine import environment, evaluation, twophase
from backend.engine.jobstore import JobStore
from backend.engine.workspace import isolation_of, limits_of, output_dir, sealed_paths, worktree_path


def run_repeats(
    settings: Settings,
    store: JobStore,
    repo: Repo,
    study: Study,
    spec: Spec,
    *,
    kind: str,
    worktree: Path,
    commit: str,
    label: str,
    node_id: int | None,
    seeds: range | None = None,
) -> list[evaluation.Receipt]:
    """Run the dev or test command `repeats` times (GROVE_SEED=0..n-1, or `seeds`) and store the receipts."""
    if kind == RunKind.TEST and spec.evaluate.two_phase:
        return _run_two_phase(settings, store, repo, study, spec, worktree, commit, label, node_id, seeds)
    command = spec.evaluate.dev if kind == RunKind.DEV else spec.evaluate.test
    n = spec.evaluate.repeats if kind == RunKind.DEV else spec.gate.test_repeats
    patterns = spec.files.protected + (spec.files.sealed if kind == RunKind.TEST else [])
    fp = evaluation.fingerprint(worktree, patterns)
    # The evaluator's files (and, in a sealed run, the sealed files) are read-only in every run:
    # code under test cannot rewrite the labels, nor the evaluator for the next seed.
    present = repo.files_at(commit) + (
        sealed_paths(repo, study, spec) if kind == RunKind.TEST and study.sealed_commit else []
    )
    readonly = tuple(globs.select(patterns, present)) if patterns else ()
    iso = environment.ensure(settings, study, spec, repo, commit, isolation_of(settings))
    receipts = []
    for seed in seeds if seeds is not None else range(n):
        r = evaluation.evaluate(
            kind=kind,
            command=command,
            worktree=worktree,
            output_dir=output_dir(settings, study, label),
            seed=seed,
            metric=spec.objective.metric,
            commit=commit,
            limits=limits_of(spec),
            evaluator_fingerprint=fp,
            bounds=spec.objective.bounds,
            isolation=iso,
            readonly=readonly,
            output_cap=settings.output_cap_bytes,
            tail_bytes=settings.tail_bytes,
        )
        receipts.append(r)
        if not r.ok:
            break
    store.add_receipts(node_id, [r.to_dict() for r in receipts])
    return receipts


def _run_two_phase(
    settings: Settings,
    store: JobStore,
    repo: Repo,
    study: Study,
    spec: Spec,
    worktree: Path,
    commit: str,
    label: str,
    node_id: int | None,
    seeds: range | None,
) -> list[evaluation.Receipt]:
    """Run the two-phase sealed test per seed; return each seed's score receipt (or its failed predict run)."""
    scored = worktree_path(settings, study, f"{label}-score")
    kept = twophase.score_tree(repo, scored, f"grove/{study.name}/{label}-score", commit, spec, reason=label)
    if study.sealed_commit:
        sealed = sealed_paths(repo, study, spec)
        repo.write_files(study.sealed_commit, sealed, scored)
        kept = sorted({*kept, *sealed})
    receipts: list[evaluation.Receipt] = []
    try:
        fp = evaluation.fingerprint(scored, spec.files.protected + spec.files.sealed)
        files = repo.files_at(commit) + (sealed_paths(repo, study, spec) if study.sealed_commit else [])
        readonly = tuple(globs.select(spec.files.protected + spec.evaluate.test_inputs, files))
        iso = environment.ensure(settings, study, spec, repo, commit, isolation_of(settings))
        # The scorer runs in the environment of the study's base: nothing a change installs runs there.
        score_iso = environment.ensure(settings, study, spec, repo, study.base_commit, isolation_of(settings))
        for seed in seeds if seeds is not None else range(spec.gate.test_repeats):
            rs = twophase.run(
                kind="test", predict=spec.evaluate.test_predict, score=spec.evaluate.test_score, tree=worktree,
                scored=scored, kept=kept, output_dir=output_dir(settings, study, label), seed=seed,
                metric=spec.objective.metric, commit=commit, limits=limits_of(spec), fingerprint=fp,
                bounds=spec.objective.bounds, isolation=iso, score_isolation=score_iso, readonly=readonly,
                output_cap=settings.output_cap_bytes, tail_bytes=settings.tail_bytes,
            )  # fmt: skip
            receipts += rs
            if not rs[-1].ok:
                break
    finally:
        repo.remove_worktree(scored)
    store.add_receipts(node_id, [r.to_dict() for r in receipts])
    return [r for r in receipts if r.kind == RunKind.TEST or not r.ok]
