"""`tools/benchmark.py longctx`'s arithmetic, without a launcher: the search for the longest sequence within a
budget, the split of a step's allocator events into model states, activations and the loss region, and the
goal ratios (tools/bench/longctx/benchmark.py, longctx/search.py, longctx/report.py, longctx/probe.py)."""

import pytest

from bench.longctx.benchmark import SP, SP_TILED, TILED, TODAY, goals, point
from bench.longctx.probe import step_memory
from bench.longctx.report import growth, states_spread
from bench.longctx.search import longest, predicted_peak, trains_within


@pytest.mark.parametrize("truth", [100, 700, 1000, 1024, 1500, 5000, 40000])
def test_search_brackets_the_longest_length_within_the_resolution(truth):
    """Doubling (or halving) from the start, then bisection: the answer fits, the failing end does not, and
    they are within max(quantum, resolution x answer) of each other; the answer is a multiple of the quantum."""
    tried = []
    out = longest(lambda n: tried.append(n) or n <= truth, 1024, 64, 1 / 8, 65536)
    lo, hi = out["longest"], out["shortest_failing"]
    assert out["tried"] == tried and len(set(tried)) == len(tried)  # no length is run twice
    assert lo <= truth < hi and lo % 64 == 0
    assert hi - lo <= max(64, lo / 8)


def test_search_steps_in_order():
    out = longest(lambda n: n <= 5000, 1024, 64, 1 / 8, 65536)
    assert out["tried"] == [1024, 2048, 4096, 8192, 6144, 5120, 4608]
    assert (out["longest"], out["shortest_failing"]) == (4608, 5120)
    out = longest(lambda n: n <= 1000, 1024, 64, 1 / 8, 65536)
    assert out["tried"] == [1024, 512, 768, 896, 960] and out["longest"] == 960


def test_search_limits():
    nothing = longest(lambda n: False, 1024, 64, 1 / 8, 65536)
    assert nothing["longest"] == 0 and nothing["shortest_failing"] == 64 and nothing["tried"][-1] == 64
    everything = longest(lambda n: True, 1024, 64, 1 / 8, 8192)
    assert everything == {"longest": 8192, "shortest_failing": None, "tried": [1024, 2048, 4096, 8192]}


def test_a_run_trains_within_the_budget_only_if_it_exited_0_at_or_under_it():
    assert trains_within({"exit_code": 0, "peak_bytes": 100}, 100)
    assert not trains_within({"exit_code": 0, "peak_bytes": 101}, 100)
    assert not trains_within({"exit_code": 1}, 100)  # a crash has no peak
    assert not trains_within({"block": 8, "skipped": "over cap"}, 100)
    assert not trains_within(None, 100)


def test_peak_prediction_is_linear_through_the_two_nearest_measured_lengths_below():
    pts = {1024: {"peak_bytes": 10}, 2048: {"peak_bytes": 20}, 4096: {"peak_bytes": 50}, 512: {"skipped": "x"}}
    assert predicted_peak(pts, 8192) == 50 + 30 / 2048 * 4096
    assert predicted_peak(pts, 3000) == 20 + 10 / 1024 * 952
    assert predicted_peak(pts, 2048) is None  # one measured length below: no line


def test_step_split_into_states_activations_and_loss_region():
    """One step: 100 bytes live at its forward (the states), 30 more by the final norm, the head and loss
    add 50 and free them by the time the gradient is back at the norm, the backward peaks at 140, then the
    optimizer step allocates 100 transiently (not an activation)."""
    steps = [(10, 100, "train_step")]
    points = [(20, "forward"), (40, "loss_start"), (60, "loss_end"), (80, "optimizer")]
    mem = [(0, 100), (25, 30), (45, 50), (50, -50), (65, 10), (70, -40), (85, 100), (90, -100), (200, 999)]
    [s] = step_memory(steps, points, mem)
    assert s == {
        "complete": True,
        "states": 100,
        "peak": 200,  # the optimizer's transient, inside the step
        "forward_backward_peak": 180,
        "activations": 80,
        "loss_region": 50,
    }
    # a step whose marks are missing (no backward reached the norm) is flagged, not guessed
    assert step_memory(steps, points[:2], mem) == [{"complete": False}]


def _rank(peak, steps):
    return {"peak_bytes": peak + 5, "phase_peak_bytes": {"train_step": peak}, "steps": steps}


def test_point_is_the_largest_over_ranks_at_the_last_complete_step():
    step = dict(complete=True, states=10, peak=0, forward_backward_peak=0)
    ranks = [
        _rank(100, [{**step, "activations": 999, "loss_region": 999}, {**step, "activations": 40, "loss_region": 7}]),
        _rank(120, [{**step, "activations": 50, "loss_region": 6}, {"complete": False}]),
    ]
    p = point(ranks)
    assert p["peak_bytes"] == 120 and p["peak_bytes_by_rank"] == [100, 120] and p["whole_run_peak_bytes"] == 125
    assert p["activation_bytes"] == 50 and p["activation_bytes_by_rank"] == [40, 50] and p["loss_region_bytes"] == 7


def test_goal_ratios_are_taken_at_the_longest_block_both_runs_trained():
    def pt(act, loss):
        return {"exit_code": 0, "peak_bytes": 1, "activation_bytes": act, "loss_region_bytes": loss}

    points = {
        TODAY: {1024: pt(200, 150), 2048: pt(400, 300), 4096: {"exit_code": 1}},
        TILED: {1024: pt(100, 60), 2048: pt(150, 60), 4096: pt(250, 60)},
        SP: {1024: pt(110, 75), 2048: pt(210, 150)},
        SP_TILED: {1024: pt(80, 60), 2048: pt(100, 60), 4096: pt(160, 60)},
    }
    searches = {TODAY: {"longest": 700}, SP_TILED: {"longest": 2100}}
    g = goals(points, searches)
    assert g["sp_activation"]["block"] == 2048 and g["sp_activation"]["ratio"] == 400 / 210
    assert g["sp_activation"]["met"]  # 1.90 >= 1.8
    assert g["sp_activation"]["by_block"] == {1024: 200 / 110, 2048: 400 / 210}
    assert g["sp_activation_tiled"]["block"] == 4096 and g["sp_activation_tiled"]["ratio"] == 250 / 160
    assert not g["sp_activation_tiled"]["met"]
    assert g["tiled_loss_region"]["block"] == 2048 and g["tiled_loss_region"]["ratio"] == 5.0
    assert g["tiled_loss_region"]["met"]
    assert g["longest"]["ratio"] == 3.0 and g["longest"]["met"] and g["longest"]["config"] == SP_TILED
    # no baseline that trained: no ratio, and not met
    assert not goals(points, {TODAY: {"longest": 0}, SP_TILED: {"longest": 2100}})["longest"]["met"]


def test_per_token_growth_through_the_two_longest_lengths_that_trained():
    pts = {"1024": {"exit_code": 0, "peak_bytes": 300}, "2048": {"exit_code": 0, "peak_bytes": 400}}
    pts["512"] = {"exit_code": 0, "peak_bytes": 1}
    pts["4096"] = {"exit_code": 1}
    assert growth(pts) == {"per_1024": 100.0, "intercept": 200.0, "blocks": [1024, 2048]}
    assert growth({"1024": {"exit_code": 0, "peak_bytes": 3}}) is None


def test_states_spread_is_the_widest_range_of_one_configurations_model_states():
    pts = {
        "a": {"1": {"states_bytes": 10}, "2": {"states_bytes": 30}, "3": {"exit_code": 1}},
        "b": {"1": {"states_bytes": 5}, "2": {"states_bytes": 50}},
    }
    assert states_spread(pts) == {"bytes": 45, "config": "b", "min": 5, "max": 50}
