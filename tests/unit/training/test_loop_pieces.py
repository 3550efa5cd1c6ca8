"""The loop's small pieces, in a one-rank gloo group (no launcher): the non-finite loss guard. The logging
window: test_metrics_log.py."""

import pytest
import torch
import torch.distributed as dist

from helpers import free_port
from zero_recipes.training.loop import NonFiniteGuard


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_guard_reports_the_first_non_finite_step_only():
    guard = NonFiniteGuard("cpu")
    guard.observe(torch.tensor(2.0), step=1)
    assert guard.check() is None
    guard.observe(torch.tensor(float("inf")), step=3)
    guard.observe(torch.tensor(float("nan")), step=4)
    assert guard.check() == 3
