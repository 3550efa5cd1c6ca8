"""ZenFlow's and SuperOffload's device/host split, on top of ZeRO-Offload's (states_gpu.py). Both are GPU-only in
DeepSpeed 0.19.8 (ZenFlow's ZeRO-3 path hard-codes device='cuda'; SuperOffload asserts CUDA), so these terms are
read from DeepSpeed's code, not measured; a CPU estimate (accelerator "cpu") does not apply them. Paths are under
deepspeed/.

ZenFlow (`zero_optimization.zenflow`, with optimizer offload): the offloaded master, gradient and Adam partitions
stay where ZeRO-Offload keeps them; on top, every step it updates the "critical" columns (the top `topk_ratio` of
each matrix's columns by gradient, default 0.1) on the GPU at once:
- runtime/zenflow/zenflow_stage_1_and_2.py `_process_selected_fp32_groups_grad`: `grad_buffer` (the selected
  gradients of the bucket, parameter dtype) and each parameter's `selected_grad` (a copy, parameter dtype);
- ops/adam/zenflow_torch_adam.py `ZenFlowSelectiveAdamW.step`: `exp_avg` and `exp_avg_sq` shaped like the selected
  columns (`zeros_like(selected_param)`, parameter dtype), on the GPU; with `zenflow.offload` true they are kept
  pinned on the host (`exp_avg_cpu_data`, `exp_avg_sq_cpu_data`) and brought over for the step;
- with `overlap_step` (ZenFlowZeroOptimizerParallel.initialize_optimizer_states): two pinned host gradient
  partitions in the master's dtype (`overlap_grad`) instead of one, so the host step overlaps the next backward.
The selected columns are those of the whole matrix (the selection is all-reduced), not one rank's partition.

SuperOffload (`offload_optimizer.super_offload`, ZeRO-3): runtime/superoffload/superoffload_stage3.py keeps
ZeRO-3 offload's partitions (its `ratio` of the sub-groups on the host, the rest on the GPU as
`partial_offload`), and steps the host's sub-groups in a spawned CPU-Adam process (superoffload_utils.py) that
allocates one fp32 gradient scratch buffer the size of the largest sub-group's partition
(`_allocate_worker_grad_buffer`, pinned when pin_memory); the states are shared with it, not copied.
"""

from __future__ import annotations

from .states import PhaseBytes, Setup, optimizer_state_bytes

ZENFLOW_TOPK = 0.1  # runtime/zenflow/zenflow_config.py ZenFlowConfig.topk_ratio's default


def zenflow_block(s: Setup) -> dict | None:
    block = s.zero.get("zenflow")
    return block if isinstance(block, dict) else None


def super_offload(s: Setup) -> dict | None:
    block = s.zero.get("offload_optimizer")
    return block if isinstance(block, dict) and block.get("super_offload") else None


def applies(s: Setup) -> bool:
    return s.accelerator == "gpu" and s.stage > 0 and (zenflow_block(s) is not None or super_offload(s) is not None)


def zenflow_bytes(s: Setup) -> tuple[float, float]:
    """(device, host) bytes per parameter ZenFlow adds to ZeRO-Offload on one rank (module docstring)."""
    z = zenflow_block(s)
    k = float(z.get("topk_ratio", ZENFLOW_TOPK))
    p = s.bytes_per_param
    moments = 2 * p * k
    device = 2 * p * k + (0.0 if z.get("offload") else moments)  # grad_buffer + selected_grad (+ moments)
    host = (moments if z.get("offload") else 0.0) + (s.master_bytes / s.world if z.get("overlap_step") else 0.0)
    return device, host


def super_offload_bytes(s: Setup) -> tuple[float, float]:
    """(device, host) bytes per parameter SuperOffload changes against ZeRO-3 offload on one rank: the share
    1 - ratio of the optimizer partitions kept on the GPU, and the worker's fp32 gradient scratch buffer."""
    block = super_offload(s)
    ratio = float(block.get("ratio", 1.0))
    partition = (2 * s.master_bytes + optimizer_state_bytes(s)) / s.world  # master, its gradient, the moments
    sub_group = float(s.zero.get("sub_group_size", 1e9) or 1e9)
    scratch = 4 * min(sub_group / s.num_params, 1 / s.world)
    return (1 - ratio) * partition, scratch - (1 - ratio) * partition


def adjust(by_phase: dict[str, PhaseBytes], s: Setup) -> dict[str, PhaseBytes]:
    """states.phases' result with ZenFlow's or SuperOffload's terms (none on a CPU: both are GPU-only); estimate.py
    applies it (not under a pipeline, which runs ZeRO-0/1 without them)."""
    if not applies(s):
        return by_phase
    device, host = zenflow_bytes(s) if zenflow_block(s) is not None else super_offload_bytes(s)
    P = s.num_params
    out = {}
    for phase, b in by_phase.items():
        if phase == "init":  # the selected columns and the worker's buffer exist from the first step
            out[phase] = b
            continue
        out[phase] = PhaseBytes(b.states, int(b.buffers + device * P), b.host_states, int(b.host_buffers + host * P))
    return out


def note(s: Setup) -> str | None:
    """What the estimate says it assumed, where these terms apply."""
    if not applies(s):
        return None
    if zenflow_block(s) is not None:
        z = zenflow_block(s)
        return (
            f"zenflow: the top {float(z.get('topk_ratio', ZENFLOW_TOPK)):g} of each matrix's columns updated on the "
            f"GPU every step (their gradients{'' if z.get('offload') else ' and Adam moments'} there"
            f"{', the moments pinned on the host' if z.get('offload') else ''}); read from DeepSpeed 0.19.8's code "
            "(GPU-only), not measured"
        )
    return (
        "super_offload: ZeRO-3 offload's partitions, stepped by a CPU-Adam process with one fp32 gradient buffer "
        "of the largest sub-group; read from DeepSpeed 0.19.8's code (GPU-only), not measured"
    )
