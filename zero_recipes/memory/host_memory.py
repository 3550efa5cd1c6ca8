"""Host memory per node of one launch: what its ranks offload to the host, pin or spill to NVMe, and what the
model's load holds there before DeepSpeed moves it (estimate.py's `per_node`)."""

from __future__ import annotations

from .shape import ModelShape
from .states import Setup


def per_node(
    table: dict,
    shape: ModelShape,
    setup: Setup,
    init_host_buffers: int,
    num_gpus: int,
    preloaded_bytes: int | None = None,
) -> dict:
    """Host memory per node: offloaded states (pinned when pin_memory), and the load. Without zero.Init every
    rank materialises the whole model on the host (fp32 for a random init) before DeepSpeed moves it; with
    it, a pretrained checkpoint passes through one shard (at most 5 GB, HF's default) at a time. Under tensor
    parallelism too: AutoTP splits the built model inside deepspeed.initialize (engine.py
    `_apply_autotp_partitioning`), so each rank first holds the whole of it. A model built before DeepSpeed
    (`preloaded_bytes` a parameter, preloaded.py) is whole on the host in every process, at any stage."""
    stage, off_opt, off_par, zero = setup.stage, setup.offload_optimizer, setup.offload_param, setup.zero
    host_states = max(t["host_bytes"] for t in table.values())
    full = shape.model_params
    init_host = 4 * full if stage < 3 else min(5 * 10**9, 2 * full)
    if shape.trainable is not None:  # LoRA loads a pretrained base in setup.load_bytes (and its reads, states.py)
        init_host = setup.load_bytes * shape.num_params + init_host_buffers if stage < 3 else init_host
    if preloaded_bytes is not None:
        init_host = preloaded_bytes * full
    nvme = {off_opt, off_par} & {"nvme"}
    offloaded_to_host = 0 if nvme else host_states
    # pin_memory defaults to true in DeepSpeed 0.19.8 (runtime/zero/offload_config.py): pinned unless a file says false
    pinned = any(
        isinstance(zero.get(k), dict)
        and zero[k].get("device") not in (None, "none")
        and zero[k].get("pin_memory", True)
        for k in ("offload_optimizer", "offload_param")
    )
    return {
        "cpu_bytes": num_gpus * max(offloaded_to_host, init_host),
        "pinned_bytes": num_gpus * offloaded_to_host if pinned else 0,
        "nvme_bytes": num_gpus * host_states if nvme else 0,
    }
