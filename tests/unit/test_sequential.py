"""Adaptive repeats: the error of the dev test is spent across looks, and unclear gains get more seeds."""

from __future__ import annotations

import math
import random
from statistics import NormalDist

import pytest

from agents.tree.sequential import TABULATED, Plan, Step, computed_levels, z_levels
from agents.tree.stats import gain_over, t95, t_quantile


def test_t_quantiles_match_the_table_and_grow_as_alpha_shrinks() -> None:
    for df in (1, 2, 5, 10, 30):
        assert t_quantile(0.05, df) == pytest.approx(t95(df), abs=2e-3)
    assert t_quantile(0.01, 2) == pytest.approx(6.965, abs=2e-3)
    assert t_quantile(0.025, 10) == pytest.approx(2.228, abs=2e-3)
    assert t_quantile(0.01, 5) > t_quantile(0.05, 5)


def test_the_looks_spend_exactly_alpha() -> None:
    plan = Plan(3, 9)
    assert plan.looks() == [3, 6, 9]
    z = list(z_levels((3, 6, 9), 0.05))
    assert z[0] == pytest.approx(0.05 * math.sqrt(1 / 3))  # the first look keeps most of it
    # The looks share their seeds, so a later look may test at more than its Bonferroni share
    # (the increment of the spending function) while the chance that any look rejects stays 5%.
    shares = [0.05 * (math.sqrt(2 / 3) - math.sqrt(1 / 3)), 0.05 * (1 - math.sqrt(2 / 3))]
    assert z[1] > shares[0] and z[2] > shares[1] and sum(z) > 0.05
    assert null_rejection(plan, z) == pytest.approx(0.05, abs=1.5e-3)
    # t tests get a little less than z (their looks are less correlated), still above Bonferroni.
    levels = [plan.alpha_at(n) for n in plan.looks()]
    assert all(s < a < b for s, a, b in zip([0.0, *shares], levels, z, strict=True))
    assert Plan(3, 3).alpha_at(3) == 0.05  # no adaptive repeats: the usual 95% test
    assert Plan(2, 5).looks() == [2, 4, 5] and plan.next_n(3) == 6 and plan.next_n(9) == 9


@pytest.mark.parametrize("key", sorted(TABULATED))
def test_tabulated_levels_are_what_the_computation_gives(key: tuple[tuple[int, ...], float]) -> None:
    looks, alpha = key
    assert Plan(looks[0], looks[-1]).looks() == list(looks)  # the plans default settings make
    assert TABULATED[key] == pytest.approx(computed_levels(looks, alpha), rel=1e-6)


def null_rejection(plan: Plan, levels: list[float]) -> float:
    """Return the chance that some look's z statistic crosses its level when there is no gain."""
    rng = random.Random(3)
    looks, hits, trials = plan.looks(), 0, 100_000
    edges = [NormalDist().inv_cdf(1 - a) for a in levels]
    for _ in range(trials):
        s, before = 0.0, 0
        for n, edge in zip(looks, edges, strict=True):
            s += rng.gauss(0, math.sqrt(n - before))
            before = n
            if s / math.sqrt(n) >= edge:
                hits += 1
                break
    return hits / trials


def test_steps() -> None:
    plan = Plan(3, 9)
    assert plan.step([0.5, 0.52, 0.51]) == Step.CLEAR
    assert plan.step([-0.2, -0.1, -0.15]) == Step.FUTILE
    assert plan.step([0.0, 0.0, 0.0]) == Step.FUTILE  # no difference at all
    assert plan.step([0.3, -0.1, 0.2]) == Step.MORE  # positive but within noise
    assert plan.step([0.3, -0.1, 0.2, 0.1, 0.2, 0.1, 0.1, 0.2, 0.3]) == Step.DONE


def run_node(plan: Plan, effect: float, rng: random.Random) -> bool:
    """Simulate one node through the looks; return whether it ends significant."""
    diffs = [effect + rng.gauss(0, 1) for _ in range(plan.repeats)]
    while plan.step(diffs) == Step.MORE:
        diffs += [effect + rng.gauss(0, 1) for _ in range(plan.next_n(len(diffs)) - len(diffs))]
    g = gain_over(diffs, [0.0] * len(diffs), maximize=True, alpha=plan.alpha_at(len(diffs)))
    return g.lcb > 0


def test_looking_again_does_not_raise_the_false_positive_rate_and_finds_small_gains() -> None:
    rng = random.Random(12)
    trials = 20_000
    adaptive, fixed = Plan(3, 9), Plan(3, 3)
    null = sum(run_node(adaptive, 0.0, rng) for _ in range(trials)) / trials
    # At most 5% (with a margin of three standard errors of the estimate).
    assert null <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / trials)
    small = 0.8  # a real gain of 0.8 noise standard deviations
    found_adaptive = sum(run_node(adaptive, small, rng) for _ in range(trials)) / trials
    found_fixed = sum(run_node(fixed, small, rng) for _ in range(trials)) / trials
    assert found_adaptive > found_fixed + 0.05


def test_racing_spends_more_seeds_only_on_a_gain_the_last_look_could_confirm() -> None:
    from agents.tree.sequential import resolution, worth_racing

    dev, gate = Plan(3, 9), Plan(3, 9)
    # Paired differences spread by about 0.0226 (two evaluations with 0.016 of their own noise each).
    undecided = [0.05, 0.02, 0.08]  # mean 0.05: unclear at three seeds, clear enough at nine
    hopeless = [-0.01, 0.02, 0.035]  # mean 0.015: below what nine seeds could confirm
    assert dev.step(undecided) == Step.MORE and dev.step(hopeless) == Step.MORE
    assert worth_racing(undecided, dev, gate)
    assert not worth_racing(hopeless, dev, gate)
    # The stricter plan decides: a gate of three seeds at most needs a larger gain than dev's nine.
    assert resolution(0.03, Plan(3, 3)) > resolution(0.03, Plan(3, 9)) > 0
    assert worth_racing([0.05, 0.02, 0.08], dev) and not worth_racing([0.05, 0.02, 0.08], dev, Plan(3, 3))
    assert worth_racing([0.1])  # one difference has no spread to judge by: looked at again
