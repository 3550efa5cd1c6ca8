"""lr_schedule.py writes out the HF Trainer's schedules (to keep peft and bitsandbytes out of every rank's
start-up); a user switching from the Trainer must see the same learning rate at every step, bit for bit,
and a checkpoint's scheduler state must load either way."""

import pytest
import torch
from transformers import get_scheduler

from zero_recipes.training import lr_schedule


def optimizer():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-4)


@pytest.mark.parametrize("name", lr_schedule.NAMES)
@pytest.mark.parametrize("warmup,total", [(0, 10), (1, 8), (3, 7), (10, 10), (5, 1000)])
def test_every_step_has_the_hf_trainers_learning_rate(name, warmup, total):
    ours = lr_schedule.build(name, optimizer(), warmup, total)
    theirs = get_scheduler(name, optimizer(), num_warmup_steps=warmup, num_training_steps=total)
    for step in range(total + 3):  # past the end too: a resumed run with more steps
        assert ours.get_last_lr() == theirs.get_last_lr(), (name, warmup, total, step)
        ours.optimizer.step(), theirs.optimizer.step()
        ours.step(), theirs.step()


@pytest.mark.parametrize("name", lr_schedule.NAMES)
def test_a_saved_scheduler_state_loads_into_either(name):
    theirs = get_scheduler(name, optimizer(), num_warmup_steps=2, num_training_steps=9)
    for _ in range(4):
        theirs.optimizer.step(), theirs.step()
    ours = lr_schedule.build(name, optimizer(), 2, 9)
    ours.load_state_dict(theirs.state_dict())
    assert ours.state_dict() == theirs.state_dict()
    ours.optimizer.step(), theirs.optimizer.step()
    ours.step(), theirs.step()
    assert ours.get_last_lr() == theirs.get_last_lr()


def test_an_unknown_name_is_refused():
    with pytest.raises(ValueError, match="unknown schedule 'polynomial'"):
        lr_schedule.factor("polynomial", 1, 10)
