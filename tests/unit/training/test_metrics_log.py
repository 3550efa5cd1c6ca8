"""The logging window's loss and throughput arithmetic, in a one-rank gloo group (no launcher): its record is
collective. MetricsLog meeting a full or read-only disk: tests/unit/checkpointing/test_storage.py."""

import time

import pytest
import torch

from zero_recipes.training import metrics_log
from zero_recipes.training.metrics_log import LogWindow

pytestmark = pytest.mark.usefixtures("world_of_one")  # conftest.py: a one-rank gloo group


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


def test_a_tensor_or_sequence_parallel_group_counts_its_tokens_once(monkeypatch):
    """2 steps of 1000 tokens per rank in 4 s: alone, a rank trained 500 tokens/s; in a TP or SP group of 2
    the group trained them together, so each device did half of that, and MFU is taken on the half. Under
    SP a rank's loss is its slice's share: the replica's loss is their sum."""
    clock = iter(())
    monkeypatch.setattr(metrics_log.time, "perf_counter", lambda: next(clock))
    records = {}
    for group, shares in ((1, 1), (2, 1), (2, 2)):
        clock = iter([0.0, 4.0, 4.0])  # the window opens, records, and opens the next
        window = LogWindow("cpu", 1000, 1, flops_per_token=6.0, peak_flops=6e3, group=group, loss_shares=shares)
        window.add_loss(torch.tensor(1.0))
        window.add_step(0.0)
        window.add_loss(torch.tensor(1.0))
        window.add_step(0.0)
        records[group, shares] = window.record()
    assert records[1, 1]["tokens_per_sec_per_device"] == 500 and records[1, 1]["tokens_per_sec"] == 500
    tp = records[2, 1]
    assert tp["tokens_per_sec_per_device"] == 250 and tp["tokens_per_sec"] == 250  # world of one
    assert tp["mfu"] == pytest.approx(250 * 6.0 / 6e3)
    assert records[1, 1]["loss"] == tp["loss"] == 1.0 and records[2, 2]["loss"] == 2.0
