"""What a DeepSpeed config dict says about a run: its ZeRO stage, precision, offloads and parallel sizes.

A leaf (no import of the package): the config intake (ds_config), its checks (ds_checks), the parallel axes,
the engine, the JIT ops and the memory estimate all read these, and none of them may import the others for it.
"""

from __future__ import annotations

from typing import Optional


def zero_stage(ds: dict) -> int:
    return int(ds.get("zero_optimization", {}).get("stage", 0))


def precision(ds: dict) -> str:
    """'bf16', 'fp16' or 'fp32' for a resolved config (both blocks' "enabled" filled)."""
    return "bf16" if ds["bf16"]["enabled"] else "fp16" if ds["fp16"]["enabled"] else "fp32"


def autocast_dtype(ds: dict) -> Optional[str]:
    """The dtype DeepSpeed's `torch_autocast` block computes in ('bfloat16' or 'float16'), or None when it is off.
    A resolved config has it filled (ds/precision_blocks.py)."""
    block = ds.get("torch_autocast")
    if not isinstance(block, dict) or block.get("enabled") is not True:
        return None
    return {"bf16": "bfloat16", "fp16": "float16"}.get(str(block.get("dtype")), str(block.get("dtype") or "bfloat16"))


def state_bytes(ds: dict) -> tuple[int, int]:
    """(bytes of a master weight and of its gradient partition, bytes of each of Adam's two moments) under ZeRO:
    (4, 4) unless `bf16.bf16_master_weights_and_grads` makes the masters bf16 (2) and `bf16_optimizer_states`
    the moments too (DeepSpeed 0.19.8, runtime/base_optimizer.py `_configure_master_weights`)."""
    bf16 = ds.get("bf16") or {}
    if not bf16.get("enabled") or zero_stage(ds) == 0:
        return 4, 4
    master = 2 if bf16.get("bf16_master_weights_and_grads") is True else 4
    return master, 2 if master == 2 and bf16.get("bf16_optimizer_states") is True else 4


def precision_words(ds: dict) -> str:
    """The precision in words, as --dry_run and the estimator say it: `precision` where that is the whole story,
    else what is in which dtype ("bf16 autocast, fp32 master weights", "bf16 with bf16 master weights and optimizer
    states")."""
    auto = autocast_dtype(ds)
    if auto is not None and precision(ds) == "fp32":
        short = {"bfloat16": "bf16", "float16": "fp16"}.get(auto, auto)
        return f"{short} autocast, fp32 parameters and master weights"
    master, moments = state_bytes(ds)
    if master == 2 and moments == 2:
        return "bf16 with bf16 master weights and optimizer states"
    if master == 2:
        return "bf16 with bf16 master weights and gradients, fp32 optimizer states"
    return precision(ds)


def offloads(ds: dict) -> tuple[Optional[str], Optional[str]]:
    """(optimizer offload device, param offload device), each None, 'cpu' or 'nvme'."""
    z = ds.get("zero_optimization", {})

    def dev(key):
        d = (z.get(key) or {}).get("device", "none")
        return None if d in (None, "none") else d

    return dev("offload_optimizer"), dev("offload_param")


def tensor_parallel_size(ds: dict) -> int:
    """The AutoTP degree a DeepSpeed dict asks for (1: none)."""
    block = ds.get("tensor_parallel") or {}
    return max(1, int(block.get("autotp_size", 0) or 0)) if isinstance(block, dict) else 1


def sequence_parallel_size(ds: dict) -> int:
    """The Ulysses degree a DeepSpeed dict asks for (1: none)."""
    return max(1, int(ds.get("sequence_parallel_size", 1) or 1))


def pipeline_parallel_size(ds: dict) -> int:
    """The pipeline stages a DeepSpeed dict asks for (`"pipeline": {"stages": N}`; 1: none). DeepSpeed's own
    default, "auto", leaves the count to the model code: train.py has none of its own, so "auto" is 1."""
    block = ds.get("pipeline") or {}
    stages = block.get("stages", 1) if isinstance(block, dict) else 1
    return stages if isinstance(stages, int) and stages > 1 else 1


def expert_parallel_size(ds: dict) -> int:
    """The AutoEP degree a DeepSpeed dict asks for (`"expert_parallel": {"enabled": true, "autoep_size": N}`;
    1: none). DeepSpeed reads autoep_size only when enabled is true."""
    block = ds.get("expert_parallel") or {}
    if not isinstance(block, dict) or not block.get("enabled"):
        return 1
    size = block.get("autoep_size", 1)
    return size if isinstance(size, int) and size > 1 else 1
