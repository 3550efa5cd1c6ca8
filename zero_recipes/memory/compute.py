"""The compute, time and energy of a token budget (tools/estimate_memory.py --tokens): total FLOPs, wall time and
GPU-hours at an assumed MFU, and energy at board power."""

from __future__ import annotations

from ..errors import ConfigError

# Board power in watts (datasheet TDP/TBP of the SXM or PCIe part named), for energy = power x time.
BOARD_POWER_W = {
    "H200": 700,
    "H100": 700,
    "A100": 400,
    "L40S": 350,
    "A10G": 150,
    "RTX 4090": 450,
    "V100": 300,
    "MI300X": 750,
}


def training_compute(
    model_config,
    num_params: int,
    tokens: float,
    seq_len: int,
    gpus: int,
    device: str,
    dtype: str,
    mfu: float,
    power_w: float | None,
    pipeline_stages: int = 1,
    micro_batches: int = 1,
) -> dict:
    """Total FLOPs (6N per token plus attention, the FLOPs function train.py uses), wall time and GPU-hours at
    the stated MFU, and energy at board power. Under pipeline parallelism the GPUs also idle through the 1F1B
    schedule's bubble, (p - 1) / (m + p - 1) of a step for p stages and m micro-batches (pipeline.bubble): the MFU
    is that of the busy time, so the wall time is divided by the busy fraction."""
    from zero_recipes.training.flops import model_flops_per_token, peak_flops_from_table

    from .pipeline import bubble

    flops = model_flops_per_token(model_config, seq_len) * tokens
    peak = peak_flops_from_table(device, dtype)
    if peak is None:
        raise ConfigError(f"no peak FLOP/s known for '{device}' in {dtype}; name one of {', '.join(BOARD_POWER_W)}")
    idle = bubble(pipeline_stages, micro_batches)
    seconds = flops / (gpus * peak * mfu * (1 - idle))
    power = power_w or next((w for k, w in BOARD_POWER_W.items() if k.lower() in device.lower()), None)
    out = {
        "tokens": tokens,
        "total_flops": flops,
        "six_n_d_flops": 6 * num_params * tokens,
        "device": device,
        "peak_flops_per_gpu": peak,
        "mfu": mfu,
        "gpus": gpus,
        "wall_seconds": seconds,
        "gpu_hours": seconds * gpus / 3600,
        "pipeline_bubble": idle,
        "effective_mfu": mfu * (1 - idle),
    }
    if power:
        out.update(board_power_w=power, energy_kwh=power * gpus * seconds / 3.6e6)
    return out
