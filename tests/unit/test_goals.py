"""Limits read out of a goal in words, kept only where the evaluator prints the quantity."""

from __future__ import annotations

import pytest

from agents.goals import limits

NAMES = ["rmse", "n_params", "latency_ms", "val_accuracy", "recall"]


@pytest.mark.parametrize(
    ("goal", "want"),
    [
        ("Lower the RMSE; keep the model under 30k parameters", [("n_params", None, 30000.0)]),
        ("keep the number of parameters under 30,000", [("n_params", None, 30000.0)]),
        ("reach 0.95 accuracy with under 2 million weights", [("n_params", None, 2e6)]),
        ("n_params < 3e4", [("n_params", None, 3e4)]),
        (
            "keep latency below 50 ms and recall at least 0.9",
            [("latency_ms", None, 50.0), ("recall", 0.9, None)],
        ),
        ("improve the model", []),
        ("keep the disk use under 2 GB", []),  # nothing printed measures it
    ],
)
def test_bounds_on_printed_metrics_are_read_from_the_goal(
    goal: str, want: list[tuple[str, float | None, float | None]]
) -> None:
    assert [(x.metric, x.min, x.max) for x in limits(goal, NAMES)] == want
