"""REPORT.md's budget line and its 'Ended by' line, from the rows a study leaves."""

from __future__ import annotations

import pytest

from agents.spec import parse_spec
from backend.core.models import Event, Study
from backend.services.report import budget_line, ending
from backend.services.storage import BudgetSpent
from tests.support.repos import tiny_files

TOML = tiny_files(experiments=20, plateau_stop=6)["grove.toml"]  # repeats = 2
SPEC = parse_spec(TOML.replace("[budget]\n", "[budget]\nusd = 2\ntokens = 50000\nhours = 3\n"))


def test_the_budget_line_counts_units_and_says_what_they_went_on() -> None:
    spent = BudgetSpent(experiments=8, extra_runs=24, repeats=2)
    assert spent.units == 20
    assert budget_line(spent, 20) == (
        "20 of 20 units spent: 8 experiments, 24 extra dev runs (adaptive repeats: every 2 cost a unit)"
    )
    odd = BudgetSpent(experiments=1, extra_runs=3, repeats=2)
    assert budget_line(odd, 5) == (
        "2 of 5 units spent: 1 experiment, 3 extra dev runs (adaptive repeats: every 2 cost a unit; 1 not yet charged)"
    )
    assert budget_line(BudgetSpent(3, 0, 2), 5) == "3 of 5 units spent: 3 experiments, 0 extra dev runs"


def _pause(i: int, **payload: str) -> Event:
    return Event(id=i, study_id=1, type="study.paused", payload=payload)


@pytest.mark.parametrize(
    ("status", "rule", "reason", "events", "said"),
    [
        ("finished", "experiments", "experiment budget spent (20)", [],
         "the experiment budget was spent (20 of 20 units)"),
        ("finished", "time", "time budget spent (3 h)", [], "the time budget was spent (3 h)"),
        ("finished", "plateau", "plateau: 6 experiments without improvement", [],
         "the plateau stop: 6 experiments in a row without improvement"),
        ("finished", "frontier", "frontier exhausted: nothing left to try", [],
         "the frontier was exhausted (no hypothesis left to try)"),
        ("finished", "ideation", "ideation failed: no JSON", [], "a failure: ideation failed: no JSON"),
        ("failed", "", "the baseline failed on dev", [], "a failure: the baseline failed on dev"),
        ("finished", "user", "stopped by user",
         [Event(id=1, study_id=1, type="study.stopping", payload={"by": "ana"})], "stopped by a user (ana)"),
        ("finished", "user", "stopped by user",
         [_pause(1, reason="LLM budget spent: 120 of 1000 tokens used, 900 held by calls in flight", budget="tokens")],
         "stopped by a user while paused because the LLM token budget (50000 tokens) was spent"),
        ("finished", "user", "stopped by user",
         [_pause(1, reason="LLM budget spent: $0.04 of $0.04", budget="usd"), Event(id=2, study_id=1, type="study.resumed")],
         "stopped by a user"),  # resumed since: the pause did not hold it
        ("paused", "", "", [_pause(1, reason="LLM budget spent: $0.04 of $0.04", budget="usd")],
         "not ended: paused because the LLM budget ($2) was spent (resume or stop it)"),
        # The rule and the budget are fields: words that read like another rule do not move them.
        ("paused", "", "", [_pause(1, reason="LLM budget spent: 5 tokens", budget="usd")],
         "not ended: paused because the LLM budget ($2) was spent (resume or stop it)"),
        ("paused", "", "", [_pause(1, reason="LLM budget spent, as a person wrote it")],
         "not ended: paused: LLM budget spent, as a person wrote it (resume or stop it)"),
        ("finished", "frontier", "plateau: words of another rule", [],
         "the frontier was exhausted (no hypothesis left to try)"),
        ("finished", "", "a reason of no known rule", [], "a reason of no known rule"),
        ("paused", "", "", [_pause(1, by="ana")], "not ended: paused by ana (resume or stop it)"),
        ("running", "", "", [], "not ended: the study is running"),
    ],
)  # fmt: skip
def test_the_report_names_the_rule_that_ended_the_study(
    status: str, rule: str, reason: str, events: list[Event], said: str
) -> None:
    st = Study(name="tiny", goal="g", status=status, stop_reason=reason, stop_rule=rule)
    assert ending(st, SPEC, events, BudgetSpent(8, 24, 2)) == said
