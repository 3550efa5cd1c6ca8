"""What the launcher (deepspeed, torchrun, srun, accelerate, plain python) tells a rank in its environment."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class RankInfo:
    """Where this process stands among the launch's ranks."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int  # the ranks on this node


def rank_info() -> RankInfo:
    """This process's place from the launcher's environment; 1 process if none."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    return RankInfo(
        rank=int(os.environ.get("RANK", 0)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        world_size=world,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or _local_world_from_launcher(world),
    )


def accelerate_launch_choices(values: dict) -> dict:
    """`accelerate launch` with a DeepSpeed accelerate config hands its choices to the script in the
    environment: the JSON (`deepspeed_config_file`) and `mixed_precision`. Taken when the recipe and the
    command line are silent, so an accelerate config naming one of ds_configs/ works unchanged."""
    env = os.environ
    if env.get("ACCELERATE_USE_DEEPSPEED") != "true":
        return {}
    out: dict = {}
    if "deepspeed" not in values and env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"):
        out["deepspeed"] = [env["ACCELERATE_DEEPSPEED_CONFIG_FILE"]]
    precision = env.get("ACCELERATE_MIXED_PRECISION")
    if precision in ("bf16", "fp16") and "bf16" not in values and "fp16" not in values:
        out[precision] = True
    return out


def _local_world_from_launcher(world: int) -> int:
    # The deepspeed launcher sets no LOCAL_WORLD_SIZE; it passes the node's ranks in CROSS_* or nothing.
    for var in ("LOCAL_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return world


def set_threads(local_world: int) -> int:
    """Give each rank its share of the cores when the launcher did not. The deepspeed launcher leaves
    OMP_NUM_THREADS unset, and 2 ranks x all cores on 2 cores ran 3-25x slower (measured); torchrun sets 1."""
    import torch

    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    n = max(1, cores // max(1, local_world))
    os.environ["OMP_NUM_THREADS"] = str(n)
    torch.set_num_threads(n)
    return n
