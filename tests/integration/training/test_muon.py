"""What is particular to DeepSpeed's Muon (ds_configs/muon.json), read from the contract's Muon rows
(tests/contract.py optimizer_rows); the muon-zero3 row's ranks count Newton-Schulz and sum their optimizer states
as they train (its `watch`, tests/muon_calls.py):

- under zero.Init every parameter reports a 1-D shape; DeepSpeed must still give Muon to exactly the 2-D
  non-embedding tensors, read from the layer shape (deepspeed#8438 gave it to none, silently);
- Newton-Schulz runs once per matrix per optimizer step with 2 micro-batches a step (deepspeed#8443 ran it per
  micro-batch under ZeRO-3);
- Muon keeps one fp32 momentum per element where AdamW keeps two moments: half the state bytes.
"""

import pytest

import muon_calls
from contract import BY_NAME, MUON_SPLIT

ROW = BY_NAME["muon-zero3"]  # ZeRO-3 under zero.Init, 2 micro-batches of 2 a step
STEPS = 8


def two_d_non_embedding() -> tuple[int, int]:
    """(Muon's tensors, all trainable tensors) of the quick start's model, built on the meta device: the 2-D
    ones whose names hold neither "embed" nor "lm_head", as deepspeed.set_optimizer_flags defines them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from zero_recipes.modeling.model import TINY_LLAMA

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_LLAMA))
    named = list(model.named_parameters())
    muon = [n for n, p in named if p.dim() == 2 and "embed" not in n and "lm_head" not in n]
    return len(muon), len(named)


@pytest.fixture(scope="module")
def counted(mode_run):
    """The muon-zero3 row's run, whose ranks counted and summed as they trained (its `watch`, tests/muon_calls.py)."""
    run = mode_run(ROW).check()
    return run, muon_calls.read(run.output_dir, ROW.nproc)


def test_under_zero_init_exactly_the_2d_non_embedding_tensors_take_muon(mode_run):
    run = mode_run(ROW).check()
    muon, total = two_d_non_embedding()
    assert "model: built under zero.Init" in run.log  # every parameter a flat partition when DeepSpeed tags them
    assert muon > 0 and f"muon: {muon} of {total} tensors (the 2-D non-embedding ones)" in run.log, run.log[-3000:]
    assert MUON_SPLIT.startswith(f"muon: {muon} of {total} ")  # the rows' `says` name the same split


def test_newton_schulz_runs_once_per_matrix_per_step_with_gradient_accumulation(counted):
    _, ranks = counted
    muon, _ = two_d_non_embedding()
    # each rank orthogonalizes a round-robin share of the matrices (stage3 _muon_update_sub_group)
    assert sum(r["newton_schulz"] for r in ranks) == muon * STEPS, ranks
    assert ROW.args[-4:] == ("--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2")
    # counting changed nothing: the row's losses equal Muon on ZeRO-0's (tests/integration/contract/test_parity.py)


def test_muon_keeps_half_the_optimizer_state_bytes_of_adam(counted):
    _, ranks = counted
    muon = {k: sum(r["state"]["muon"][k] for r in ranks) for k in ("bytes", "elements")}
    adam = {k: sum(r["state"]["adam"][k] for r in ranks) for k in ("bytes", "elements")}
    assert muon["elements"] > 0 and adam["elements"] > 0
    assert adam["bytes"] == 8 * adam["elements"]  # exp_avg and exp_avg_sq, fp32
    assert muon["bytes"] == 4 * muon["elements"]  # one fp32 momentum: half of Adam's per element
