"""tools/estimate_memory.py --table: every GPU count x ZeRO config x gradient checkpointing, and which to use.

The recommendation is the first config that fits (verdict "yes", never "tight") in this order: full
fine-tuning without offload; then, when the run does not set LoRA, LoRA r=16 on every linear layer; then
offload. Lower stages communicate less; recomputation (gradient checkpointing, ~1/3 more compute) costs less
than moving the optimizer step to the CPU, and offloading parameters too costs most. Training fewer
parameters changes the result, but less than offload costs in speed, so LoRA comes before offload, and the
full fine-tuning choice is kept beside it.
"""

from __future__ import annotations

from pathlib import Path

from .. import shipped

GPU_COUNTS = (1, 2, 4, 8, 16, 32, 64)
TABLE_CONFIGS = shipped.select(
    "zero1", "zero2", "zero3", "zero2+offload_optimizer", "zero3+offload_optimizer", "zero3+offload_all"
)  # the table's columns, in order
# What the table recommends: the first that fits. Lower stages communicate less; recomputation (gradient
# checkpointing, ~1/3 more compute) costs less than moving the optimizer step to the CPU, and offloading
# parameters too costs most.
PREFERENCE = [
    (name, gc)
    for group in (
        ("zero1", "zero2", "zero3"),
        ("zero2+offload_optimizer", "zero3+offload_optimizer"),
        ("zero3+offload_all",),
    )
    for gc in (False, True)
    for name in group
]
# Without LoRA set, --table also tries LoRA at this rank on every linear layer: after full fine-tuning without
# offload, before any offload (training fewer parameters changes the result less than it costs speed to offload).
TABLE_LORA_R = 16
LORA_CONFIGS = ("zero1", "zero2", "zero3")


def lora_of(cfg):
    """The run's peft LoraConfig (zero_recipes.lora.lora_config, as train.py wraps the model), or None."""
    from .. import lora

    return lora.lora_config(cfg) if lora.enabled(cfg) else None


def table_variants(cfg, config, precision: str) -> list[dict]:
    """What the table tries: the run as given (full fine-tuning, or the LoRA it sets) over every config, and,
    when LoRA is not set, LoRA r=TABLE_LORA_R on all-linear over the configs without offload. Each with its
    shape (peft's count on the meta model) and activations traced once per checkpointing choice."""
    import dataclasses

    import torch

    from .activations import activation_bytes
    from .estimate import ModelShape

    dtype = torch.float32 if precision == "fp32" else torch.bfloat16  # activations: 2 bytes in bf16 and fp16 alike
    runs = [(cfg, list(TABLE_CONFIGS))]
    if cfg.lora_r == 0:
        runs.append((dataclasses.replace(cfg, lora_r=TABLE_LORA_R, lora_target_modules=["all-linear"]), LORA_CONFIGS))
    out = []
    for run_cfg, names in runs:
        lora = lora_of(run_cfg)
        out.append(
            {
                "lora_r": run_cfg.lora_r,
                "lora": lora,
                "configs": names,
                "shape": ModelShape.of(config, lora),
                "acts": {
                    gc: activation_bytes(config, 1, cfg.block_size, dtype, gc, cfg.attn_implementation or "sdpa", lora)
                    for gc in (False, True)
                },
            }
        )
    return out


def preference(variants: list[dict]) -> list[tuple]:
    """(config, checkpointing, lora_r) in the order the table recommends: full fine-tuning without offload,
    then the LoRA the table tried, then offload; within each, lower stages first, checkpointing second."""
    given, tried = variants[0]["lora_r"], [v["lora_r"] for v in variants[1:]]
    order = [(name, gc, given) for name, gc in PREFERENCE if name in LORA_CONFIGS]
    order += [(name, gc, r) for r in tried for gc in (False, True) for name in LORA_CONFIGS]
    return order + [(name, gc, given) for name, gc in PREFERENCE if name not in LORA_CONFIGS]


def first_fitting(order: list, fitting: dict, run, micro0: int) -> dict | None:
    """The first of `order` that fits, with the largest micro-batch that still fits (doubling from micro0)."""
    pick = next((key for key in order if key in fitting), None)
    if pick is None:
        return None
    ds_n, e, v = fitting[pick]
    micro = micro0
    while micro < 1024 and run(v, ds_n, pick[1], micro * 2).fits:
        micro *= 2
    return {
        "config": pick[0],
        "gradient_checkpointing": pick[1],
        "peak_bytes": e.per_gpu["peak_bytes"],
        "max_micro_batch_size": micro,
        "lora_r": pick[2],
        "trainable_params": e.trainable_params,
    }


def table(args, gpu_memory: int, load) -> dict:
    """Every GPU count x config x gradient checkpointing (and the LoRA tried); activations scaled by
    micro-batch (exact for sdpa/flash: they are linear in it). `load(args, deepspeed_files, world)` is the
    CLI's parsing through train.py's: (TrainConfig, model config, resolved DeepSpeed dict, notes)."""
    import dataclasses

    from ..ds_config import precision as ds_precision
    from .estimate import Launch, estimate

    cfg, config, ds, notes = load(args, args.deepspeed or TABLE_CONFIGS["zero1"], 1)
    precision = ds_precision(ds)
    variants = table_variants(cfg, config, precision)
    rows, lora_rows, best, best_full = [], [], {}, {}
    extra = [f for f in (args.deepspeed or []) if not Path(f).name.startswith("zero")]  # e.g. bf16.json
    micro0 = cfg.per_device_train_batch_size

    def run(v, ds_n, n, gc, micro):
        act = dataclasses.replace(v["acts"][gc], bytes=v["acts"][gc].bytes * micro)
        launch = Launch(n, args.num_nodes, micro, cfg.block_size, gc)
        return estimate(config, ds_n, launch, v["shape"], act, gpu_memory, lora=v["lora"])

    for n in GPU_COUNTS:
        fitting = {}
        for v in variants:
            for gc in (False, True):
                for name in v["configs"]:
                    _, _, ds_n, _ = load(args, [*TABLE_CONFIGS[name], *extra], n * args.num_nodes)
                    e = run(v, ds_n, n, gc, micro0)
                    row = {"num_gpus": n, "config": name, "gradient_checkpointing": gc}
                    row.update(peak_bytes=e.per_gpu["peak_bytes"], fits=e.fits, fit=e.fit, lora_r=v["lora_r"])
                    (rows if v is variants[0] else lora_rows).append(row)
                    if e.fits:
                        fitting[name, gc, v["lora_r"]] = (ds_n, e, v)
        for order, into in ((preference(variants), best), (preference(variants[:1]), best_full)):
            choice = first_fitting(order, fitting, lambda v, ds_n, gc, micro: run(v, ds_n, n, gc, micro), micro0)
            if choice:
                into[n] = choice
    return {
        "num_params": variants[0]["shape"].num_params,
        "precision": precision,
        "seq_len": cfg.block_size,
        "micro_batch_size": micro0,
        "gpu_memory": gpu_memory,
        "lora_r": cfg.lora_r,
        "rows": rows,
        "lora_rows": lora_rows,
        "lora_tried": {"r": TABLE_LORA_R, "target_modules": "all-linear"} if lora_rows else None,
        "recommended": best,
        "recommended_full_fine_tuning": best_full if cfg.lora_r == 0 else None,
        "notes": notes,
    }
