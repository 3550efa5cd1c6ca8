"""The HF Trainer's learning-rate schedules, as torch LambdaLRs.

Written out rather than taken from `transformers.get_scheduler` for start-up time alone: importing
transformers.optimization imports transformers.trainer_utils, which imports peft, accelerate and
bitsandbytes, about 15 % of a rank's import time (measured with -X importtime) in a run that uses none of
them (docs/speed.md). The factors are transformers' own expressions, operation for operation, so the learning
rates are the same floats; tests/unit/training/test_lr_schedule.py compares every step with `transformers.get_scheduler`.
As there, each factor is a `functools.partial` of a module-level function, so a checkpoint's scheduler state
is the same as one saved by earlier versions.
"""

from __future__ import annotations

import math
from functools import partial

NAMES = ("cosine", "linear", "constant_with_warmup", "constant")


def _cosine(step: int, *, num_warmup_steps: int, num_training_steps: int, num_cycles: float = 0.5) -> float:
    if step < num_warmup_steps:
        return float(step) / float(max(1, num_warmup_steps))
    progress = float(step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
    factor = 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))
    return max(0, factor)  # transformers then applies min_lr_rate, 0 for "cosine": x * 1.0 + 0.0 is x


def _linear(step: int, *, num_warmup_steps: int, num_training_steps: int) -> float:
    if step < num_warmup_steps:
        return float(step) / float(max(1, num_warmup_steps))
    return max(0.0, float(num_training_steps - step) / float(max(1, num_training_steps - num_warmup_steps)))


def _constant_with_warmup(step: int, *, num_warmup_steps: int) -> float:
    if step < num_warmup_steps:
        return float(step) / float(max(1.0, num_warmup_steps))
    return 1.0


def _constant(_=None) -> int:
    return 1


def factor(name: str, warmup: int, total: int):
    """The LR multiplier of step t for `--lr_scheduler_type NAME`, as transformers builds it."""
    if name == "cosine":
        return partial(_cosine, num_warmup_steps=warmup, num_training_steps=total, num_cycles=0.5)
    if name == "linear":
        return partial(_linear, num_warmup_steps=warmup, num_training_steps=total)
    if name == "constant_with_warmup":
        return partial(_constant_with_warmup, num_warmup_steps=warmup)
    if name == "constant":
        return _constant
    raise ValueError(f"unknown schedule {name!r}; one of {NAMES}")


def build(name: str, optimizer, warmup: int, total: int):
    """transformers.get_scheduler(NAME, optimizer, num_warmup_steps=warmup, num_training_steps=total)."""
    from torch.optim.lr_scheduler import LambdaLR

    return LambdaLR(optimizer, factor(name, warmup, total), -1)
