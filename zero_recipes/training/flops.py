"""Model FLOPs per token, datasheet peaks and MFU: the one place that does this arithmetic (the training loop,
train.py's dry run, the memory estimate and tools/bench use it).

Model FLOPs per token follow PaLM (arXiv 2204.02311, appendix B): 6·N for the weight matmuls of
forward + backward, where N counts the parameters that take part in a matmul (the input embedding is a
lookup and costs none; a tied lm_head counts once), plus 12·L·d_attn·s for the attention scores and the
weighted sum. Recomputation for gradient checkpointing is not model FLOPs, by MFU's definition.
"""

from __future__ import annotations

from typing import Optional

from zero_recipes.modeling import moe

# Dense (not 2:4 sparse) peak, FLOP/s per device, from NVIDIA's and AMD's datasheets. NVIDIA's headline
# figures are sparse; using them halves MFU (nanoGPT PR #464 reported "104 % MFU" from the wrong table).
# "tf32" is fp32 through the tensor cores (--tf32, torch.backends.fp32_precision = "tf32"); "fp32" is plain
# fp32, torch's default for matmuls, 7x slower on a Hopper. The PCIe and NVL cards run lower clocks and power than
# the SXM ones of the same name, so they come first: the first name found in the device's name wins.
PEAK_FLOPS = {
    # name substring: {dtype: flop/s}
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51.2e12},
    "H100 NVL": {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12},
    "H200 NVL": {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12},
    "H200": {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12},  # SXM
    "H100": {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12},  # SXM ("H100 80GB HBM3")
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},  # SXM and PCIe alike
    "L40S": {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12, "fp32": 91.6e12},
    "A10G": {"bf16": 70e12, "fp16": 70e12, "tf32": 35e12, "fp32": 31.2e12},
    "RTX 4090": {"bf16": 165e12, "fp16": 165e12, "tf32": 82.6e12, "fp32": 82.6e12},
    "V100": {"fp16": 125e12, "fp32": 15.7e12},  # no bf16 or TF32 tensor cores
    "MI300X": {"bf16": 1307e12, "fp16": 1307e12, "tf32": 653.7e12, "fp32": 163.4e12},
}


def peak_flops_from_table(device_name: str, dtype: str) -> Optional[float]:
    for key, table in PEAK_FLOPS.items():
        if key.lower() in device_name.lower():
            return table.get(dtype)
    return None


def fp32_matmul_kind() -> str:
    """ "tf32" when fp32 matmuls run on the tensor cores (--tf32 true, or the user's own setting), else "fp32"
    (torch >= 2.9's setting, as train.py's --tf32 writes it; the GPU image has 2.11)."""
    import torch

    return "tf32" if torch.backends.cuda.matmul.fp32_precision == "tf32" else "fp32"


def trainable_matmul_params(module) -> Optional[int]:
    """Parameters that get weight gradients, when some are frozen (LoRA): None when all train. ZeRO-3's
    partitioned parameters count whole (ds_numel)."""
    params = {id(p): p for p in module.parameters()}.values()
    if all(p.requires_grad for p in params):
        return None
    return sum(getattr(p, "ds_numel", p.numel()) for p in params if p.requires_grad)


def model_flops_per_token(config, seq_len: int, trainable: Optional[int] = None) -> float:
    """Training FLOPs (forward + backward) per token for an HF decoder config, without recomputation. A
    mixture of experts counts what a token multiplies by (moe.mlp_params: its k experts, the router and the
    shared experts), not every expert's weights. With `trainable` (LoRA's adapters, the rest frozen) a frozen
    weight costs 4 FLOPs a token (forward, and the backward's input gradient), not 6: it gets no weight
    gradient. The adapters' own 6 each are added."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    h = text.hidden_size
    layers = text.num_hidden_layers
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or h // heads
    inter = getattr(text, "intermediate_size", None) or 4 * h
    vocab = text.vocab_size
    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    attn = h * q_out + 2 * h * kv_out + q_out * h  # q, k, v, o projections
    gated = getattr(text, "hidden_act", "gelu") in ("silu", "swiglu") or getattr(text, "model_type", "") in (
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "gemma",
        "gemma2",
        "phi3",
        "mixtral",
    )
    mlp = (3 if gated else 2) * h * inter
    mlp_total = moe.mlp_params(config).active if moe.is_moe(config) else layers * mlp
    matmul_params = layers * attn + mlp_total + h * vocab  # + lm_head
    weights = 6 * matmul_params if trainable is None else 4 * matmul_params + 6 * trainable
    return weights + 12 * layers * q_out * seq_len


def mfu(tokens_per_sec_per_device: float, flops_per_token: float, peak: float) -> float:
    return tokens_per_sec_per_device * flops_per_token / peak
