"""tools/estimate_memory.py --table: every GPU count x ZeRO config x gradient checkpointing, and which to use.

The recommendation is the first config that fits (verdict "yes", never "tight") in this order: full
fine-tuning without offload; then tensor parallelism within a node; then, when the run does not set LoRA,
LoRA r=16 on every linear layer; then offload. Lower stages communicate less; recomputation (gradient
checkpointing, ~1/3 more compute) costs less than moving the optimizer step to the CPU, and offloading
parameters too costs most. Training fewer parameters changes the result, but less than offload costs in
speed, so LoRA comes before offload, and the full fine-tuning choice is kept beside it.

Tensor parallelism (AutoTP, `tensor_parallel.autotp_size`) divides what ZeRO cannot, the activations inside
attention and the MLP, at the price of two all-reduces of the activations per layer and direction. Those
belong on NVLink: DeepSpeed's mesh makes a TP group of consecutive ranks (utils/groups.py
`_init_tp_mesh_device`), one node when the size divides the GPUs per node, and the table's GPU counts are
per node, so it tries only sizes that divide them and never puts a TP group across nodes. It comes after
checkpointing (simpler, and no all-reduce on the critical path) and before LoRA (it trains every parameter).
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
# Tensor-parallel sizes the table tries, each where it divides the GPUs per node (a TP group within a node)
TP_SIZES = (2, 4, 8)
TP_CONFIGS = ("zero1", "zero2", "zero3")


def lora_of(cfg):
    """The run's peft LoraConfig (zero_recipes.lora.lora_config, as train.py wraps the model), or None."""
    from .. import lora

    return lora.lora_config(cfg) if lora.enabled(cfg) else None


def table_variants(cfg, config, precision: str) -> list[dict]:
    """What the table tries: the run as given (full fine-tuning, or the LoRA it sets) over every config, and,
    when LoRA is not set, LoRA r=TABLE_LORA_R on all-linear over the configs without offload. Each with its
    shape (peft's count on the meta model) and activations traced once per checkpointing choice."""
    import dataclasses

    runs = [(cfg, list(TABLE_CONFIGS))]
    if cfg.lora_r == 0:
        runs.append((dataclasses.replace(cfg, lora_r=TABLE_LORA_R, lora_target_modules=["all-linear"]), LORA_CONFIGS))
    return [variant(cfg, config, precision, lora_of(run_cfg), run_cfg.lora_r, names) for run_cfg, names in runs]


def variant(cfg, config, precision: str, lora, lora_r: int, names, tp: int = 1) -> dict:
    """One kind of run the table tries over `names`: its shape and its activations per checkpointing choice."""
    import torch

    from .activations import activation_bytes
    from .estimate import ModelShape

    dtype = torch.float32 if precision == "fp32" else torch.bfloat16  # activations: 2 bytes in bf16 and fp16 alike
    shape = ModelShape.of(config, lora, tp=tp, tp_block={"autotp_size": tp})
    attn = cfg.attn_implementation or "sdpa"
    acts = {
        gc: activation_bytes(config, 1, cfg.block_size, dtype, gc, attn, lora, tp, shape.vocab_parallel)
        for gc in (False, True)
    }
    return {"lora_r": lora_r, "lora": lora, "configs": names, "shape": shape, "acts": acts, "tp": tp}


def tp_variants(cfg, config, ds: dict, precision: str, notes: list) -> list[dict]:
    """Full fine-tuning under each TP size this model can be split by (train.py's own check, parallel.py
    `check_tensor_parallel`: a TP plan, heads divisible, no LoRA); the sizes it cannot take are a note."""
    from .. import parallel
    from ..config import ConfigError

    if cfg.lora_r:
        return []
    out, refused = [], []
    for tp in TP_SIZES:
        try:
            # as its cells will run: ZeRO-1 at least (TP_CONFIGS), at this TP size
            tried = {**ds, "zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": tp}}
            parallel.check_tensor_parallel(parallel.Mesh(tp, tp), config, tried, cfg)
        except ConfigError as err:
            refused.append(f"{tp} ({str(err).split(': ', 1)[-1].split(';')[0]})")
            continue
        out.append(variant(cfg, config, precision, None, 0, TP_CONFIGS, tp))
    if refused:
        notes.append("tensor parallelism not tried for autotp_size " + ", ".join(refused))
    return out


def preference(variants: list[dict]) -> list[tuple]:
    """(config, checkpointing, lora_r, tp) in the order the table recommends: full fine-tuning without offload,
    then tensor parallelism within a node (smaller groups first), then the LoRA the table tried, then offload;
    within each, lower stages first, checkpointing second."""
    given = variants[0]["lora_r"]
    tried = [v["lora_r"] for v in variants[1:] if v["tp"] == 1]
    tps = sorted({v["tp"] for v in variants if v["tp"] > 1})
    order = [(name, gc, given, 1) for name, gc in PREFERENCE if name in LORA_CONFIGS]
    order += [(name, gc, 0, tp) for tp in tps for gc in (False, True) for name in TP_CONFIGS]
    order += [(name, gc, r, 1) for r in tried for gc in (False, True) for name in LORA_CONFIGS]
    return order + [(name, gc, given, 1) for name, gc in PREFERENCE if name not in LORA_CONFIGS]


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
        "tensor_parallel": pick[3],
        "trainable_params": e.trainable_params,
    }


def table(args, gpu_memory: int, load) -> dict:
    """Every GPU count x config x gradient checkpointing (and the LoRA and TP sizes tried); activations scaled
    by micro-batch (exact for sdpa/flash: they are linear in it). `load(args, deepspeed_files, world)` is the
    CLI's parsing through train.py's: (TrainConfig, model config, resolved DeepSpeed dict, notes)."""
    import dataclasses
    import tempfile

    from ..ds_config import precision as ds_precision
    from .estimate import Launch, estimate

    with tempfile.TemporaryDirectory(prefix="zr-table-") as tmp:
        # each cell's TP size as one more fragment, last, so it overrides one the user's files may set
        fragment = {tp: tp_fragment(Path(tmp), tp) for tp in (1, *TP_SIZES)}
        cfg, config, ds, notes = load(args, [*(args.deepspeed or TABLE_CONFIGS["zero1"]), fragment[1]], 1)
        precision = ds_precision(ds)
        variants = table_variants(cfg, config, precision)
        variants += tp_variants(cfg, config, ds, precision, notes)
        rows, lora_rows, tp_rows, best, best_full = [], [], [], {}, {}
        extra = [f for f in (args.deepspeed or []) if not Path(f).name.startswith("zero")]  # e.g. bf16.json
        micro0 = cfg.per_device_train_batch_size

        def run(v, ds_n, n, gc, micro):
            act = dataclasses.replace(v["acts"][gc], bytes=v["acts"][gc].bytes * micro)
            launch = Launch(n, args.num_nodes, micro, cfg.block_size, gc)
            return estimate(config, ds_n, launch, v["shape"], act, gpu_memory, lora=v["lora"])

        for n in GPU_COUNTS:
            fitting = {}
            for v in variants:
                if n % v["tp"]:  # a TP group stays within a node: its size divides the GPUs per node
                    continue
                into = tp_rows if v["tp"] > 1 else rows if v is variants[0] else lora_rows
                for gc in (False, True):
                    for name in v["configs"]:
                        files = [*TABLE_CONFIGS[name], *extra, fragment[v["tp"]]]
                        _, _, ds_n, _ = load(args, files, n * args.num_nodes)
                        e = run(v, ds_n, n, gc, micro0)
                        row = {"num_gpus": n, "config": name, "gradient_checkpointing": gc}
                        row.update(peak_bytes=e.per_gpu["peak_bytes"], fits=e.fits, fit=e.fit, lora_r=v["lora_r"])
                        row["tensor_parallel"] = v["tp"]
                        into.append(row)
                        if e.fits:
                            fitting[name, gc, v["lora_r"], v["tp"]] = (ds_n, e, v)
            full = [v for v in variants if v["lora_r"] == variants[0]["lora_r"]]
            for order, into in ((preference(variants), best), (preference(full), best_full)):
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
        "tp_rows": tp_rows,
        "tensor_parallel_tried": sorted({v["tp"] for v in variants if v["tp"] > 1}),
        "lora_tried": {"r": TABLE_LORA_R, "target_modules": "all-linear"} if lora_rows else None,
        "recommended": best,
        "recommended_full_fine_tuning": best_full if cfg.lora_r == 0 else None,
        "notes": notes,
    }


def tp_fragment(tmp: Path, tp: int) -> str:
    """A --deepspeed fragment setting AutoTP's size (1: none)."""
    import json

    out = tmp / f"tensor_parallel_{tp}.json"
    out.write_text(json.dumps({"tensor_parallel": {"autotp_size": tp}}) + "\n")
    return str(out)
