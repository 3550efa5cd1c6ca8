"""tools/estimate_memory.py on a mixture of experts: which ZeRO stage and expert-parallel size to train it with.

For one run's arguments (GPUs, micro-batch, length, checkpointing, the user's other fragments such as bf16.json),
every ZeRO-1/2/3 config x every AutoEP size that divides both the world and the experts (1, 2, 4, 8) is
estimated, the activations traced once (they do not depend on the stage or EP: memory/moe.py adds EP's rows).
The recommendation is the first that fits in the order of least communication: ZeRO-1/2 without EP (one
gradient reduce a step), ZeRO-1/2 with EP, smaller sizes first (one all-to-all of the routed tokens each way
per MoE layer, small beside a weight gather for a large MoE), then ZeRO-3 (every weight gathered in the
forward and again in the backward), without EP first. Then the same with gradient checkpointing, if the run
did not ask for it. EP is not tried with LoRA, tensor, sequence or pipeline parallelism (train.py refuses them
together) nor for a family without an AutoEP preset.
"""

from __future__ import annotations

import copy
import dataclasses

from zero_recipes.config import shipped
from zero_recipes.modeling import moe

STAGES = ("zero1", "zero2", "zero3")
EP_SIZES = (1, 2, 4, 8)


def applies(config, cfg, e) -> bool:
    fam = moe.family(config)
    plain = e.tensor_parallel == 1 and e.sequence_parallel == 1 and e.pipeline_parallel == 1
    return moe.is_moe(config) and fam is not None and fam.autoep_preset is not None and plain and not cfg.lora_r


def order(world: int, experts: int) -> list[tuple[str, int]]:
    """(config, ep) in the order recommended: see the module docstring."""
    eps = [ep for ep in EP_SIZES if world % ep == 0 and experts % ep == 0]
    low = [(name, 1) for name in STAGES[:2]] + [(name, ep) for ep in eps if ep > 1 for name in STAGES[:2]]
    return low + [("zero3", ep) for ep in eps]


def advise(args, cfg, config, gpu_memory: int, load) -> dict:
    """Every (config, ep, checkpointing) cell's peak per GPU, and the first that fits (None when none does)."""
    import torch

    from zero_recipes.ds.facts import precision

    from . import stack
    from .activations import activation_bytes
    from .estimate import Precomputed, estimate
    from .shape import ModelShape

    args = copy.copy(args)
    args.expert_parallel = None  # each cell's EP size is its own fragment's, not the flag's
    world = args.num_gpus * args.num_nodes
    extra = extra_fragments(cfg)
    cells, shape = [], ModelShape.of(config)
    gcs = (cfg.gradient_checkpointing,) if cfg.gradient_checkpointing else (False, True)
    for gc in gcs:
        acts = None
        for name, ep in order(world, moe.num_experts(config)):
            files = [*shipped.COMBINATIONS[name], *extra] + ([shipped.EXPERT_PARALLEL[ep]] if ep > 1 else [])
            ds = load(args, files, world)[2]
            dtype = torch.float32 if precision(ds) == "fp32" else torch.bfloat16
            if acts is None:
                a = activation_bytes(config, 1, cfg.block_size, dtype, gc, cfg.attn_implementation or "sdpa")
                acts = dataclasses.replace(a, bytes=a.bytes * cfg.per_device_train_batch_size)
            launch = stack.launch_of(args, cfg, config, args.num_gpus, gc)
            e = estimate(config, ds, launch, gpu_memory, precomputed=Precomputed(shape, acts))
            cells.append(
                {"config": name, "expert_parallel": ep, "gradient_checkpointing": gc}
                | {"peak_bytes": e.per_gpu["peak_bytes"], "fit": e.fit, "fits": e.fits}
            )
    best = next((c for c in cells if c["fits"]), None)
    return {"cells": cells, "recommended": best}


def extra_fragments(cfg) -> list[str]:
    """The run's --deepspeed files (a recipe's or the command line's) but its ZeRO stage, offload and EP ones: what
    every cell keeps (bf16.json, the user's own settings)."""
    from pathlib import Path

    return [f for f in (cfg.deepspeed or []) if not Path(f).name.startswith(("zero", "ep", "offload", "nvme"))]


def command(best: dict, extra: list[str]) -> str:
    """The --deepspeed files of a recommendation, as train.py takes them."""
    files = [*shipped.COMBINATIONS[best["config"]], *extra]
    if best["expert_parallel"] > 1:
        files.append(shipped.EXPERT_PARALLEL[best["expert_parallel"]])
    return " ".join(files)
