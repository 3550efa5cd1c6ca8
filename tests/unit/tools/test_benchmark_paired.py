"""The timing arithmetic every speed benchmark reports with (tools/bench/paired.py): rotated rounds,
windows of steps, ratios paired within a round, and the bootstrap interval of their median."""

import random
import statistics

import pytest

from bench import paired


def test_rotations_put_every_runner_once_in_each_round_and_each_position_once():
    names = ["A", "B", "C"]
    order = paired.rotations(names, 3)
    assert order == [["A", "B", "C"], ["B", "C", "A"], ["C", "A", "B"]]
    for position in range(3):
        assert sorted(r[position] for r in order) == names
    assert paired.rotations(names, 4)[3] == names  # the cycle repeats


def test_window_rates_time_each_window_from_step_starts_and_leave_out_warm_up():
    # steps of 2 s carrying 100 tokens, except a slow first step (warm-up) and the last one (no end)
    starts = [0.0, 10.0] + [10.0 + 2 * i for i in range(1, 9)]
    tokens = [100] * len(starts)
    tokens[-1] = 10**9  # the last step never ends inside the run: it must not count
    rates = paired.window_rates(starts, tokens, windows=2, warmup=1)
    assert rates == [50.0, 50.0]
    with pytest.raises(ValueError, match="cannot make 9 windows"):
        paired.window_rates(starts, tokens, windows=9, warmup=1)


def test_window_rates_weigh_windows_by_what_their_steps_trained():
    starts = [0.0, 1.0, 2.0, 3.0, 4.0]
    rates = paired.window_rates(starts, [10, 30, 50, 70, 0], windows=2, warmup=0)
    assert rates == [20.0, 60.0]  # (10 + 30) tokens in 2 s, (50 + 70) in 2 s


def test_pairing_cancels_machine_load_that_drifts_between_rounds():
    """A is 10 % faster than B on the same machine state; the machine's speed varies by ±30 % from round to
    round and window to window. The paired median is exactly 1.1 with no width; the ratio of the medians of
    pooled, unpaired windows is not."""
    rng = random.Random(1)
    rounds = []
    for _ in range(4):
        load = [rng.uniform(0.7, 1.3) for _ in range(5)]
        rounds.append({"A": [1100 * x for x in load], "B": [1000 * x for x in load]})
    r = paired.ratio(rounds, "A", "B")
    assert r["median"] == pytest.approx(1.1) and r["low"] == pytest.approx(1.1) and r["high"] == pytest.approx(1.1)
    assert r["pairs"] == 20 and r["rounds"] == 4
    pooled_a = statistics.median(x for rd in rounds for x in rd["A"][:3])
    pooled_b = statistics.median(x for rd in rounds for x in rd["B"][2:])
    assert abs(pooled_a / pooled_b - 1.1) > 0.01  # what an unpaired comparison of other windows would report


def test_the_interval_contains_the_true_ratio_and_narrows_with_more_rounds():
    def rounds(n, seed):
        rng = random.Random(seed)
        return [
            {"A": [1.05 * rng.gauss(1, 0.05) for _ in range(4)], "B": [rng.gauss(1, 0.05) for _ in range(4)]}
            for _ in range(n)
        ]

    few, many = paired.ratio(rounds(3, 0), "A", "B"), paired.ratio(rounds(24, 0), "A", "B")
    for r in (few, many):
        assert r["low"] <= r["median"] <= r["high"]
        assert r["low"] < 1.05 < r["high"]
    assert many["half_width"] < few["half_width"]
    assert many["half_width"] == pytest.approx(
        max(many["median"] - many["low"], many["high"] - many["median"]) / many["median"]
    )


def test_pairs_stop_at_the_shorter_run_and_text_shows_the_interval():
    groups = paired.paired_ratios([{"A": [2.0, 4.0, 6.0], "B": [1.0, 2.0]}], "A", "B")
    assert groups == [[2.0, 2.0]]
    r = paired.bootstrap(groups)
    assert paired.text(r) == "2.000 (2.000–2.000, ±0.0%)"
    with pytest.raises(ValueError, match="no paired windows"):
        paired.bootstrap([[]])
