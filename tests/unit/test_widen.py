"""Widening a `[search]` range where a merged change landed on its bound."""

from __future__ import annotations

import math

import pytest

from agents.policies.widen import on_bound, widen, widened_bound


def test_a_log_range_widens_by_a_decade_on_the_side_the_merge_sat_on() -> None:
    dims = {"p.yaml:lr": {"low": 1e-4, "high": 1e-1, "log": True}, "p.yaml:c": {"values": ["a", "b"]}}
    space, found = widen(dims, [(5, 5, {"p.yaml:lr": 1.02e-4, "p.yaml:c": "a"})])
    assert space["p.yaml:lr"] == {"low": 1e-5, "high": 1e-1, "log": True}
    assert [(w.key, w.side, w.node_id) for w in found] == [("p.yaml:lr", "low", 5)]
    assert dims["p.yaml:lr"]["low"] == 1e-4  # the spec's own space is left alone
    again, more = widen(dims, [(5, 5, {"p.yaml:lr": 1e-4}), (9, 9, {"p.yaml:lr": 1e-5})])
    assert again["p.yaml:lr"]["low"] == pytest.approx(1e-6) and [w.node_id for w in more] == [5, 9]


def test_values_inside_the_range_or_outside_it_widen_nothing() -> None:
    dims = {"k": {"low": 1.0, "high": 3.0}}
    assert widen(dims, [(2, 2, {"k": 2.0}), (3, 3, {"k": 7.0})]) == (dims, [])
    assert on_bound(dims["k"], 2.99) == "high" and on_bound(dims["k"], 2.9) is None


def test_natural_limits_are_never_crossed() -> None:
    assert widened_bound({"low": 0.0, "high": 1.0}, "high") is None  # a probability
    assert widened_bound({"low": 0.05, "high": 1.0}, "high") is None  # a fraction
    assert widened_bound({"low": 0.05, "high": 1.0}, "low") == 0.0
    assert widened_bound({"low": 1, "high": 9, "integer": True}, "low") is None  # a size of at least 1
    assert widened_bound({"low": 2, "high": 9, "integer": True}, "low") == 1.0
    assert widened_bound({"low": 2, "high": 9, "integer": True}, "high") == 13.0
    assert widened_bound({"low": -1.0, "high": 1.0}, "low") == -2.0


def test_a_widened_range_stays_valid_for_its_kind() -> None:
    assert widened_bound({"low": 1, "high": 16, "integer": True, "log": True}, "low") is None  # not 0
    assert widened_bound({"low": 0.0, "high": 0.95}, "high") == 1.0  # dropout stays a probability
    assert (
        widened_bound({"low": 2, "high": 9, "integer": True}, "low", "p.yaml:tree.min_samples_split") is None
    )
    assert widened_bound({"low": 1e-4, "high": 1e-1, "log": True}, "low") == pytest.approx(1e-5)


def test_an_integer_range_stays_integer_however_often_it_widens() -> None:
    from agents.policies.space import Space

    dims = {"c.toml:warmup": {"low": 0, "high": 10}}  # an int in the file, whole bounds: integers
    space, found = widen(dims, [(4, 4, {"c.toml:warmup": 10}), (7, 7, {"c.toml:warmup": 15})])
    assert [w.new for w in found] == [15.0, 23.0]  # 15 + 7.5 rounds out, not to a bound of 22.5
    assert space["c.toml:warmup"]["integer"] is True
    wide = Space(space, {"c.toml:warmup": 0})
    assert wide.is_int("c.toml:warmup") and wide.snap("c.toml:warmup", 0.5) == 12
    assert not wide.contains("c.toml:warmup", 19.5)


def test_a_bound_widens_only_where_the_evidence_rises_toward_it() -> None:
    from agents.policies.widen import Measured

    dims = {"c.toml:depth": {"low": 1, "high": 8}, "c.toml:lr": {"low": 1e-4, "high": 1e-1, "log": True}}
    base = {"c.toml:depth": 2, "c.toml:lr": 0.01}
    tried = [(1, 0.01), (2, 0.003), (4, 0.02), (5, 0.01), (6, 0.005), (3, 0.001), (8, 0.01)]

    def history(score: object) -> list[Measured]:
        return [
            Measured(i, i, {"c.toml:depth": d, "c.toml:lr": lr}, score(d), 0.004)  # type: ignore[operator]
            for i, (d, lr) in enumerate(tried, start=2)
        ]

    merged = [(8, 8, {"c.toml:depth": 8, "c.toml:lr": 0.01})]  # the last node tried, on depth's bound
    rising = history(lambda d: 0.5 + 0.05 * math.log2(1 + d))  # deeper is still better at 8
    space, found = widen(dims, merged, rising, base=base)
    assert [(w.key, w.side, w.new) for w in found] == [("c.toml:depth", "high", 12.0)]
    assert space["c.toml:depth"]["high"] == 12.0
    # A knob that barely matters (its best is at 5, and 8 costs 0.012) stays in its range, as does
    # one the history cannot show rising (nothing else known when the merged one completed).
    flat = history(lambda d: 0.6 - 0.004 * abs(d - 5))
    assert widen(dims, merged, flat, base=base) == (dims, [])
    alone = [Measured(8, 3, merged[0][2], 0.66, 0.004)]
    assert widen(dims, merged, alone, base=base)[1] == []
    # Minimizing turns the evidence round: a loss that falls with depth widens it too.
    falling = [Measured(m.id, m.order, m.edits, -m.dev_mean, m.se) for m in rising]
    assert widen(dims, merged, falling, base=base, maximize=False)[1] != []
    assert widen(dims, merged, falling, base=base, maximize=True)[1] == []


def test_a_rise_smaller_than_the_noise_or_than_a_hundredth_of_the_spread_widens_nothing() -> None:
    from agents.policies.widen import Measured

    dims = {"c.toml:depth": {"low": 1, "high": 8}, "c.toml:lr": {"low": 1e-4, "high": 1e-1, "log": True}}
    base = {"c.toml:depth": 2, "c.toml:lr": 0.01}
    tried = [(1, 0.01), (2, 0.003), (4, 0.02), (5, 0.01), (6, 0.005), (3, 0.001), (8, 0.01)]
    merged = [(8, 8, {"c.toml:depth": 8, "c.toml:lr": 0.01})]

    def history(score: object, se: float) -> list[Measured]:
        return [
            Measured(i, i, {"c.toml:depth": d, "c.toml:lr": lr}, score(d, lr), se)  # type: ignore[operator]
            for i, (d, lr) in enumerate(tried, start=2)
        ]

    # Depth is worth 0.001 a step, under twice a node mean's error (0.004).
    assert widen(dims, merged, history(lambda d, lr: 0.5 + 0.001 * d, 0.004), base=base)[1] == []
    # A deterministic evaluator (se 0): the learning rate moves the score, depth does nothing.
    idle = history(lambda d, lr: 0.5 + 0.05 * math.log10(lr), 0.0)
    assert widen(dims, merged, idle, base=base)[1] == []
    # The same evaluator where depth matters: the bound moves.
    deep = history(lambda d, lr: 0.5 + 0.05 * math.log10(lr) + 0.02 * d, 0.0)
    assert [w.key for w in widen(dims, merged, deep, base=base)[1]] == ["c.toml:depth"]
    # A value the model cannot read is no evidence (and no crash).
    odd = [*deep, Measured(99, 1, {"c.toml:depth": "deep", "c.toml:lr": 0.01}, 0.7, 0.0)]
    assert widen(dims, merged, odd, base=base)[1] == []


def test_the_repositorys_value_decides_whether_a_range_is_integer() -> None:
    from agents.policies.widen import Measured

    dims = {"c.toml:wd": {"low": 0, "high": 10}}  # whole bounds, but the file holds a float
    rising = [Measured(i, i, {"c.toml:wd": float(x)}, x / 10, 0.001) for i, x in enumerate((0, 2, 5, 7), 2)]
    merged = [(9, 9, {"c.toml:wd": 10})]  # a human wrote an int
    history = [*rising, Measured(9, 9, {"c.toml:wd": 10}, 1.0, 0.001)]
    space, found = widen(dims, merged, history, base={"c.toml:wd": 0.0})
    assert found and "integer" not in space["c.toml:wd"]
