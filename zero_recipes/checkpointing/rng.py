"""Every random generator a rank draws from, as a checkpoint keeps it and a resume (or the live evaluation,
which lm-eval reseeds) puts it back."""

from __future__ import annotations

import random


def rng_state() -> dict:
    """Every generator this rank draws from: Python's, numpy's, torch's CPU one and its accelerator's (dropout on
    a GPU draws from the CUDA generator; on the CPU accelerator it is the CPU one again)."""
    import numpy as np
    import torch
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "accelerator": {"device": acc.device_name(), "state": acc.get_rng_state()},
    }


def set_rng_state(state: dict) -> None:
    """Restore `rng_state()`. The accelerator's state comes back on the same kind of device only: a CUDA
    generator's state means nothing to another device (a checkpoint resumed on the CPU, or one saved before
    the accelerator's state was kept)."""
    import numpy as np
    import torch
    from deepspeed.accelerator import get_accelerator

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    acc, saved = get_accelerator(), state.get("accelerator")
    if saved and saved["device"] == acc.device_name() and saved["device"] != "cpu":
        acc.set_rng_state(saved["state"])
