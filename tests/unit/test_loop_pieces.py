"""The loop's small pieces, in a one-rank gloo group (no launcher): the logging window and the guard."""

import time

import pytest
import torch
import torch.distributed as dist

from helpers import free_port
from zero_recipes.loop import NonFiniteGuard
from zero_recipes.metrics import LogWindow


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_window_mean_loss_throughput_and_paused_time():
    window = LogWindow("cpu", tokens_per_step_rank=1000, losses_per_step=2, flops_per_token=6.0, peak_flops=6e6)
    for loss in (1.0, 2.0, 3.0, 6.0):  # two steps of two micro-batches
        window.add_loss(torch.tensor(loss))
    window.add_step(data_wait=0.0)
    window.add_step(data_wait=0.01)
    time.sleep(0.05)
    with window.paused():  # eval or a checkpoint save: not training time
        time.sleep(0.5)
    record = window.record()
    assert record["loss"] == 3.0
    assert 0.04 < 2000 / record["tokens_per_sec"] < 0.3  # the half second paused is not in the elapsed time
    assert record["mfu"] == pytest.approx(record["tokens_per_sec"] * 6.0 / 6e6)
    assert 0 < record["data_wait_frac"] < 1
    window.add_loss(torch.tensor(5.0))
    window.add_loss(torch.tensor(5.0))
    window.add_step(0.0)
    assert window.record()["loss"] == 5.0  # the next window starts empty


def test_guard_reports_the_first_non_finite_step_only():
    guard = NonFiniteGuard("cpu")
    guard.observe(torch.tensor(2.0), step=1)
    assert guard.check() is None
    guard.observe(torch.tensor(float("inf")), step=3)
    guard.observe(torch.tensor(float("nan")), step=4)
    assert guard.check() == 3
