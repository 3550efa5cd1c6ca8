"""tools/estimate_memory.py's activation term checked against a real forward/backward in this process (the torch
profiler's allocator events), and memory sizes parsed. The checks against real DeepSpeed through the launcher, and
the CLI, are in tests/integration/memory/test_estimate_memory.py."""

import pytest
import torch

from helpers import ESTIMATE_OVER, ESTIMATE_UNDER, fwd_bwd_peak_bytes, small_llama
from zero_recipes.memory import activation_bytes, parse_memory


def measured_fwd_bwd(config, micro, seq, dtype, gc) -> int:
    """Peak live bytes of a real forward+backward (grads dropped as ZeRO does), from the allocator events."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return fwd_bwd_peak_bytes(model, config, micro, seq)


@pytest.mark.parametrize(
    "dtype,gc,attn",
    [(torch.bfloat16, False, "sdpa"), (torch.bfloat16, True, "sdpa"), (torch.float32, False, "eager")],
    ids=["bf16", "bf16-gc", "fp32-eager"],
)
def test_activations_match_a_real_forward_backward(dtype, gc, attn):
    config = small_llama(attn_implementation=attn)
    predicted = activation_bytes(config, 2, 256, dtype, gc, attn)
    assert predicted.method == "traced"
    real = measured_fwd_bwd(config, 2, 256, dtype, gc)
    assert -ESTIMATE_UNDER <= predicted.bytes / real - 1 <= ESTIMATE_OVER, (predicted.bytes, real)


def test_activation_terms_move_the_right_way():
    """Checkpointing saves memory, eager attention costs its s x s matrix, a longer sequence costs more."""
    bf16 = torch.bfloat16
    plain = activation_bytes(small_llama(), 2, 256, bf16, False).bytes
    assert activation_bytes(small_llama(), 2, 256, bf16, True).bytes < plain
    assert activation_bytes(small_llama(), 2, 256, bf16, False, "eager").bytes > plain
    assert activation_bytes(small_llama(), 2, 512, bf16, False).bytes > 1.9 * plain


def test_parse_memory():
    assert parse_memory("80GiB") == 80 * 2**30 and parse_memory("24GB") == 24 * 10**9
    assert parse_memory("512 mib") == 512 * 2**20
