"""Liger-Kernel's SwiGLU and RMSNorm as the activation trace runs them (zero_recipes/memory/liger.py): the same
values and gradients as transformers' modules, and less memory held, by what their kernels do not save."""

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from zero_recipes.memory import activation_bytes, liger

SMALL = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=100)  # fmt: skip


def test_the_stand_ins_compute_what_transformers_computes():
    config = AutoConfig.for_model("llama", **SMALL)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    stood_in = copy.deepcopy(model)
    assert liger.install(stood_in) == 2 * 2 + 2 + 1  # two norms and an MLP a layer, the final norm
    ids = torch.randint(0, 100, (2, 9))
    losses = [m(input_ids=ids, labels=ids).loss for m in (model, stood_in)]
    for loss in losses:
        loss.backward()
    assert losses[0].item() == pytest.approx(losses[1].item(), rel=1e-6)
    for a, b in zip(model.parameters(), stood_in.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_liger_holds_less_by_one_mlp_intermediate_and_the_norms_fp32_copies():
    """Checkpointing off, bf16, 2 x 512 tokens: each layer's SwiGLU saves gate and up but not silu(gate)
    (2 x 512 x 1376 x 2 B = 2.8 MB a layer), and each RMSNorm its bf16 input and an fp32 number a row instead of
    fp32 copies; at least the MLP's saving is seen per layer."""
    config = AutoConfig.for_model("llama", **(SMALL | dict(hidden_size=512, intermediate_size=1376, vocab_size=1000)))
    plain = activation_bytes(config, 2, 512, torch.bfloat16, False)
    fused = activation_bytes(config, 2, 512, torch.bfloat16, False, liger=True)
    assert plain.per_layer_bytes - fused.per_layer_bytes >= 2 * 512 * 1376 * 2
    assert fused.bytes < plain.bytes
