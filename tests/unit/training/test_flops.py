"""FLOPs and MFU: the one function, checked against torch's own FLOP counter, and the datasheet peaks."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import GPT2Config, LlamaConfig, LlamaForCausalLM

from zero_recipes.training import flops


def counted_llama(kv_heads: int) -> LlamaConfig:
    """A small Llama whose FLOPs torch's FlopCounterMode can count: eager attention (the CPU's sdpa kernels are
    not in its table)."""
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
    )
    config._attn_implementation = "eager"
    return config


def counted_flops_per_token(model, batch: int = 2, seq: int = 128) -> float:
    """FlopCounterMode's count of one forward and backward, per token."""
    x = torch.randint(0, model.config.vocab_size, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=x, labels=x).loss.backward()
    return counter.get_total_flops() / x.numel()


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_flops_per_token_matches_flop_counter(kv_heads):
    config = counted_llama(kv_heads)
    seq = 128
    measured = counted_flops_per_token(LlamaForCausalLM(config), seq=seq)
    predicted = flops.model_flops_per_token(config, seq)
    # FlopCounterMode counts matmuls (attention's bmm included), as model FLOPs do; norms, softmax and
    # the loss are the small remainder.
    assert predicted == pytest.approx(measured, rel=0.02)


def test_non_gated_mlp_counts_two_matrices():
    c = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100)
    c.intermediate_size = 256
    per_layer = 4 * 64 * 64 + 2 * 64 * 256
    assert flops.model_flops_per_token(c, 10) == 6 * (2 * per_layer + 64 * 100) + 12 * 2 * 64 * 10


def test_peak_table_uses_dense_figures():
    assert flops.peak_flops_from_table("NVIDIA H200", "bf16") == 989e12
    assert flops.peak_flops_from_table("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert flops.peak_flops_from_table("NVIDIA A100-SXM4-80GB", "bf16") == 312e12
    assert flops.peak_flops_from_table("Some Unknown GPU", "bf16") is None


def test_mfu_arithmetic():
    assert flops.mfu(1000.0, 6e9, 12e12) == pytest.approx(0.5)


def test_lora_flops_count_four_per_frozen_weight():
    # a frozen weight gets no weight gradient: forward and input gradient, 4 FLOPs a token, where 6N is 15 % over
    from peft import LoraConfig, get_peft_model

    config = counted_llama(kv_heads=2)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=8, target_modules="all-linear"))
    measured = counted_flops_per_token(model, seq=128)
    trainable = flops.trainable_matmul_params(model)
    assert trainable == sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    # the first layer's input needs no gradient, so it does a little less than 4N: under 2 % here
    assert flops.model_flops_per_token(config, 128, trainable) == pytest.approx(measured, rel=0.02)
    assert flops.model_flops_per_token(config, 128) > 1.1 * measured
    assert flops.trainable_matmul_params(LlamaForCausalLM(config)) is None


@pytest.mark.parametrize(
    "name,dtype,peak",
    [
        ("NVIDIA H100 PCIe", "bf16", 756e12),
        ("NVIDIA H100 NVL", "bf16", 835.5e12),
        ("NVIDIA H200 NVL", "tf32", 417.5e12),
        ("NVIDIA H100 80GB HBM3", "tf32", 494.5e12),
        ("NVIDIA H100 80GB HBM3", "fp32", 67e12),  # no TF32: 7x below the TF32 figure
        ("NVIDIA A100 80GB PCIe", "fp32", 19.5e12),
    ],
)
def test_peak_table_tells_variants_and_tf32_apart(name, dtype, peak):
    assert flops.peak_flops_from_table(name, dtype) == peak


def test_fp32_peak_follows_whether_tf32_is_on():
    before = torch.backends.fp32_precision
    try:
        torch.backends.fp32_precision = "tf32"  # what --tf32 true sets
        assert flops.fp32_matmul_kind() == "tf32"
        torch.backends.fp32_precision = "ieee"
        assert flops.fp32_matmul_kind() == "fp32"
    finally:
        torch.backends.fp32_precision = before
