"""The loop's small pieces, in a one-rank gloo group (no launcher): the non-finite loss guard. The logging
window: test_metrics_log.py."""

import pytest
import torch

from zero_recipes.training.loop import NonFiniteGuard

pytestmark = pytest.mark.usefixtures("world_of_one")  # conftest.py: a one-rank gloo group


def test_guard_reports_the_first_non_finite_step_only():
    guard = NonFiniteGuard("cpu")
    guard.observe(torch.tensor(2.0), step=1)
    assert guard.check() is None
    guard.observe(torch.tensor(float("inf")), step=3)
    guard.observe(torch.tensor(float("nan")), step=4)
    assert guard.check() == 3
