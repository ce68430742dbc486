from __future__ import annotations

from agents.failures import Blame, blame_of
from agents.llm.model import BudgetExhausted, ContextTooLong, ModelError
from agents.policies.base import AnswerFormatError, ImplementationError
from agents.verify.arex import Decision, assess
from agents.verify.constraints import ConstraintRule, Verdict, check, verify_all
from agents.verify.state import ImprovementState
from backend.core.gitops import GitError
from backend.engine.sandbox import SandboxUnavailable

SIZE = ConstraintRule("size", "n_params", max=100)
FLOOR = ConstraintRule("floor", "recall", min=0.5)


def test_verdicts_take_the_worst_receipt_and_cite_it() -> None:
    ok = check(SIZE, [(1, {"n_params": 90}), (2, {"n_params": 95})])
    assert ok.verdict == Verdict.SATISFIED and ok.value == 95 and ok.receipt_id == 2
    bad = check(SIZE, [(1, {"n_params": 90}), (2, {"n_params": 120})])
    assert bad.verdict == Verdict.VIOLATED and bad.value == 120 and bad.receipt_id == 2
    low = check(FLOOR, [(3, {"recall": 0.7}), (4, {"recall": 0.4})])
    assert low.verdict == Verdict.VIOLATED and low.receipt_id == 4


def test_unknown_when_metric_missing_or_not_numeric() -> None:
    r = verify_all([SIZE], [(1, {"accuracy": 0.9}), (2, {"n_params": "big"})])[0]
    assert r.verdict == Verdict.UNKNOWN and r.value is None


def test_arex_decisions() -> None:
    sat = verify_all([SIZE], [(1, {"n_params": 10})])
    vio = verify_all([SIZE], [(1, {"n_params": 1000})])
    kw = dict(succeeded=True, recoverable=True, mechanism="wider")
    assert assess(improves=True, results=sat, **kw).decision == Decision.ACCEPT  # type: ignore[arg-type]
    refine = assess(improves=True, results=vio, **kw)  # type: ignore[arg-type]
    assert refine.decision == Decision.REFINE and refine.open_constraints == ("size",)
    assert "Keep the mechanism (wider)" in refine.refine_goal and "size" in refine.refine_goal
    assert assess(improves=False, results=sat, **kw).decision == Decision.REJECT  # type: ignore[arg-type]
    crash = assess(succeeded=False, recoverable=False, improves=False, results=[], mechanism="m")
    assert crash.decision == Decision.RESTART


def test_improvement_state_roundtrip_and_updates() -> None:
    st = ImprovementState()
    st.add_finding("wider helps", [3, 2, 3])
    st.set_constraint("size", "violated", "n_params=1000 > 100", 3)
    st.set_constraint("size", "violated", "n_params=900 > 100", 4)
    st.reject(5, "no gain")
    st.concern("plateau")
    st.concern("plateau")
    back = ImprovementState.from_dict(st.to_dict())
    assert back.verified_findings[0].node_ids == [2, 3]
    assert back.open_constraints[0].node_ids == [3, 4]
    assert back.concerns == ["plateau"]
    back.set_constraint("size", "satisfied", "ok", 6)
    assert back.open_constraints == []


def test_a_format_or_infrastructure_failure_is_no_evidence_and_never_restarts() -> None:
    machinery = [
        AnswerFormatError("3 answers in a row held no action that could run"),
        ModelError("APIConnectionError: refused"),
        ContextTooLong("too long"),
        GitError(["worktree", "add"], 128, "fatal: no space"),
        SandboxUnavailable("no user namespaces"),
        ConnectionRefusedError("refused"),
        FileNotFoundError("gone"),
    ]
    assert [blame_of(e) for e in machinery] == [Blame.MACHINERY] * len(machinery)
    assert blame_of(BudgetExhausted("the study's $5 are spent")) == Blame.USD
    assert blame_of(BudgetExhausted("5000 of 5000 tokens", Blame.TOKENS)) == Blame.TOKENS
    # The words do not decide: an idea's own failure that names a machinery error is still its own.
    idea = [
        ImplementationError("turn limit (30) reached before finish()"),
        ValueError("GitError: x"),
        RuntimeError(),
    ]
    assert [blame_of(e) for e in idea] == [Blame.IDEA] * len(idea)
    spent = assess(
        succeeded=False, recoverable=False, improves=False, results=[], mechanism="m", no_evidence=True
    )
    assert spent.decision == Decision.REJECT and "no evidence against the idea" in spent.reason
    again = assess(
        succeeded=False, recoverable=True, improves=False, results=[], mechanism="m", no_evidence=True
    )
    assert again.decision == Decision.REJECT and "tried again" in again.reason
