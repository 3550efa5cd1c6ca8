"""What a checkpoint keeps of each rank's random generators, so dropout after a resume draws what it would have."""

import torch
from deepspeed.accelerator import get_accelerator

from zero_recipes.checkpointing.rng import rng_state, set_rng_state


def test_the_accelerators_generator_is_saved_with_its_device():
    # on a GPU dropout draws from the CUDA generator, which torch.get_rng_state() does not cover
    state = rng_state()
    assert state["accelerator"]["device"] == get_accelerator().device_name()
    assert torch.equal(state["accelerator"]["state"], get_accelerator().get_rng_state())


def test_a_resume_restores_the_draws_and_takes_a_checkpoint_from_another_device():
    state = rng_state()
    expected = torch.rand(4)
    torch.rand(100)
    # a GPU run's checkpoint resumed here: its CUDA state is skipped, the host generators still come back
    set_rng_state({**state, "accelerator": {"device": "cuda", "state": torch.zeros(16, dtype=torch.uint8)}})
    assert torch.equal(torch.rand(4), expected)
    # and one saved before the accelerator's state was kept
    set_rng_state({k: v for k, v in state.items() if k != "accelerator"})
    assert torch.equal(torch.rand(4), expected)
