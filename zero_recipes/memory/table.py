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

The longest sequence that fits (`longest_sequence`) answers another question: with Ulysses sequence parallelism
over every GPU of a node (`sequence_parallel_size` = GPUs, ZeRO-3, the table's precision, train.py's tiled loss),
how many tokens can one sequence have, with and without gradient checkpointing? Found by bisection over the
estimate itself: doubling from 1024 tokens until it no longer fits, then splitting the gap between the last length
that fits and the first that does not (where the peak interpolated between them meets the memory), in multiples
of 1024, until it is under 1/32 of the length.
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
# The longest sequence: sequence parallelism over all GPUs of one node, at these counts, under ZeRO-3
LONGEST_GPUS = (1, 2, 4, 8)
LONGEST_CONFIG = "zero3"
LONGEST_STEP = 1024  # lengths are multiples of this (so every SP size up to 1024 divides them)
LONGEST_CAP = 2**24  # 16M tokens: the search stops there and reports "at least"


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
    from .shape import ModelShape

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
    import tempfile

    from ..ds_config import precision as ds_precision

    with tempfile.TemporaryDirectory(prefix="zr-table-") as tmp:
        # each cell's TP size as one more fragment, last, so it overrides one the user's files may set
        fragment = {tp: tp_fragment(Path(tmp), tp) for tp in (1, *TP_SIZES)}
        cfg, config, ds, notes = load(args, [*(args.deepspeed or TABLE_CONFIGS["zero1"]), fragment[1]], 1)
        precision = ds_precision(ds)
        variants = table_variants(cfg, config, precision)
        variants += tp_variants(cfg, config, ds, precision, notes)
        rows = {"rows": [], "lora_rows": [], "tp_rows": []}
        best, best_full = {}, {}
        extra = [f for f in (args.deepspeed or []) if not Path(f).name.startswith("zero")]  # e.g. bf16.json
        micro0 = cfg.per_device_train_batch_size
        run = cell_estimator(args, cfg, config, gpu_memory)
        for n in GPU_COUNTS:
            fitting = grid_rows(args, n, variants, extra, fragment, load, run, micro0, rows)
            full = [v for v in variants if v["lora_r"] == variants[0]["lora_r"]]
            for order, into in ((preference(variants), best), (preference(full), best_full)):
                choice = first_fitting(order, fitting, lambda v, ds_n, gc, micro: run(v, ds_n, n, gc, micro), micro0)
                if choice:
                    into[n] = choice
        longest = None  # --longest_sequence false: the table alone (the search costs about a minute for an 8B)
        if getattr(args, "longest_sequence", "true") != "false":
            longest = longest_rows(args, cfg, config, extra, fragment[1], load, gpu_memory, notes)
    return summary(cfg, variants, precision, gpu_memory, rows, best, best_full, longest, notes)


def cell_estimator(args, cfg, config, gpu_memory: int):
    """run(variant, resolved ds, GPUs per node, checkpointing, micro-batch): one cell's estimate, the variant's
    activations (traced at micro-batch 1) scaled by the micro-batch."""
    import dataclasses

    from .estimate import Launch, estimate

    def run(v, ds_n, n, gc, micro):
        act = dataclasses.replace(v["acts"][gc], bytes=v["acts"][gc].bytes * micro)
        launch = Launch(n, args.num_nodes, micro, cfg.block_size, gc)
        return estimate(config, ds_n, launch, v["shape"], act, gpu_memory, lora=v["lora"])

    return run


def grid_rows(args, n: int, variants: list, extra: list, fragment: dict, load, run, micro0: int, rows: dict) -> dict:
    """One GPU count's cells, each appended as a row to rows["rows"] (the run as given), rows["lora_rows"] (the
    LoRA the table tried) or rows["tp_rows"]; returns those that fit, by (config, checkpointing, lora_r, tp), with
    what first_fitting needs of them: (resolved ds, Estimate, variant)."""
    fitting = {}
    for v in variants:
        if n % v["tp"]:  # a TP group stays within a node: its size divides the GPUs per node
            continue
        into = rows["tp_rows"] if v["tp"] > 1 else rows["rows"] if v is variants[0] else rows["lora_rows"]
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
    return fitting


def summary(cfg, variants, precision: str, gpu_memory: int, rows: dict, best, best_full, longest, notes) -> dict:
    """The table as tools/estimate_memory.py prints it (--json: as it is)."""
    micro0 = cfg.per_device_train_batch_size
    return {
        "num_params": variants[0]["shape"].num_params,
        "precision": precision,
        "seq_len": cfg.block_size,
        "micro_batch_size": micro0,
        "gpu_memory": gpu_memory,
        "lora_r": cfg.lora_r,
        "rows": rows["rows"],
        "lora_rows": rows["lora_rows"],
        "tp_rows": rows["tp_rows"],
        "tensor_parallel_tried": sorted({v["tp"] for v in variants if v["tp"] > 1}),
        "lora_tried": {"r": TABLE_LORA_R, "target_modules": "all-linear"} if rows["lora_rows"] else None,
        "recommended": best,
        "recommended_full_fine_tuning": best_full if cfg.lora_r == 0 else None,
        "longest_sequence": longest
        and {
            "config": LONGEST_CONFIG,
            "precision": precision,
            "micro_batch_size": micro0,
            "tiled_loss": cfg.tiled_loss,
            "tiled_mlp": cfg.tiled_mlp,
            "rows": longest,
        },
        "notes": notes,
    }


def longest_sequence(config, ds: dict, launch, gpu_memory: int, shape=None) -> dict:
    """The longest multiple of LONGEST_STEP tokens whose estimate fits `gpu_memory` (verdict "yes") for this
    DeepSpeed config and launch (its seq_len is what is searched). Bracketed from LONGEST_STEP upwards, each try
    where the line through the peaks of the last two lengths that fit meets the memory (the activations are close
    to linear in the length under sdpa/flash, so this lands next to the answer); then the bracket is split where
    the line between its ends meets it (the midpoint when that would not split it), and the split point's
    neighbour one resolution away closes it, until the bracket is within 1/32 of the length (or LONGEST_STEP).
    Returns {"seq_len": N, or None when even LONGEST_STEP does not fit, "peak_bytes", "at_cap": True when it
    still fits at LONGEST_CAP, "estimates": how many were made}."""
    import dataclasses

    from .estimate import FRAGMENTATION, OUTSIDE_ALLOCATOR_BYTES, estimate

    shape = shape or _shape(config)
    tried = {}
    target = (gpu_memory - OUTSIDE_ALLOCATOR_BYTES) / (1 + FRAGMENTATION)  # the most a "yes" may peak at

    def peak(seq: int) -> int:
        if seq not in tried:
            tried[seq] = estimate(config, ds, dataclasses.replace(launch, seq_len=seq), shape, gpu_memory=gpu_memory)
        return tried[seq].per_gpu["peak_bytes"]

    def fits(seq: int) -> bool:
        peak(seq)
        return bool(tried[seq].fits)

    def resolution(seq: int) -> int:
        return max(LONGEST_STEP, seq // 32 // LONGEST_STEP * LONGEST_STEP)

    def meets(a: int, b: int) -> int:
        """Where the line through the peaks at a and b reaches the target, in whole steps (0: it never does)."""
        slope = (peak(b) - peak(a)) / (b - a)
        return int(a + (target - peak(a)) / slope) // LONGEST_STEP * LONGEST_STEP if slope > 0 else 0

    if not fits(LONGEST_STEP):
        return {"seq_len": None, "peak_bytes": peak(LONGEST_STEP), "at_cap": False, "estimates": len(tried)}
    lo, hi, below = LONGEST_STEP, None, None
    while hi is None and lo < LONGEST_CAP:  # bracket: try where the line through the last two fits meets it
        guess = meets(below, lo) if below else 2 * lo
        guess = min(max(guess, lo + resolution(lo)), LONGEST_CAP) if guess else min(2 * lo, LONGEST_CAP)
        if fits(guess):
            below, lo = lo, guess
        else:
            hi = guess
    while hi is not None and hi - lo > resolution(lo):  # split the bracket where the line between its ends meets it
        mid = meets(lo, hi)
        mid = mid if lo < mid < hi else (lo + hi) // 2 // LONGEST_STEP * LONGEST_STEP
        if fits(mid):
            lo, near = mid, min(mid + resolution(mid), hi)
        else:
            hi, near = mid, max(mid - resolution(mid), lo)
        if lo < near < hi:
            lo, hi = (near, hi) if fits(near) else (lo, near)
    return {"seq_len": lo, "peak_bytes": peak(lo), "at_cap": lo >= LONGEST_CAP, "estimates": len(tried)}


def _shape(config):
    from .shape import ModelShape

    return ModelShape.of(config)


def longest_rows(args, cfg, config, extra: list, fragment, load, gpu_memory: int, notes: list) -> list[dict]:
    """longest_sequence for LONGEST_GPUS GPUs per node x gradient checkpointing off and on: sequence parallelism
    over all of a node's GPUs, ZeRO-3, the run's precision, micro-batch and loss/MLP tiling. A GPU count train.py
    would refuse as an SP size (heads it does not divide, LoRA) is a row with its reason."""
    import tempfile

    from ..config import ConfigError
    from .estimate import Launch

    shape = _shape(config)
    rows = []
    with tempfile.TemporaryDirectory(prefix="zr-longest-") as tmp:
        for n in LONGEST_GPUS:
            files = [*TABLE_CONFIGS[LONGEST_CONFIG], *extra, fragment, sp_fragment(Path(tmp), n)]
            try:
                _, _, ds_n, _ = load(args, files, n * args.num_nodes)
            except ConfigError as err:
                for gc in (False, True):
                    rows.append({"num_gpus": n, "sequence_parallel": n, "gradient_checkpointing": gc,
                                 "seq_len": None, "refused": str(err).split(";")[0]})  # fmt: skip
                continue
            for gc in (False, True):
                launch = Launch(
                    n,
                    args.num_nodes,
                    cfg.per_device_train_batch_size,
                    cfg.block_size,
                    gc,
                    cfg.attn_implementation or "sdpa",
                    tiled_loss=cfg.tiled_loss,
                    loss_tile_tokens=cfg.loss_tile_tokens,
                    tiled_mlp=cfg.tiled_mlp,
                )
                found = longest_sequence(config, ds_n, launch, gpu_memory, shape)
                rows.append({"num_gpus": n, "sequence_parallel": n, "gradient_checkpointing": gc, **found})
    positions = getattr(config.get_text_config(), "max_position_embeddings", None)
    if positions and any((r.get("seq_len") or 0) > positions for r in rows):
        notes.append(
            f"longest sequence: beyond the model's max_position_embeddings ({positions:,}) it needs RoPE scaling or "
            "training at that length; the memory is what the table shows"
        )
    return rows


def sp_fragment(tmp: Path, sp: int) -> str:
    """A --deepspeed fragment setting Ulysses' size (1: none)."""
    import json

    out = tmp / f"sequence_parallel_{sp}.json"
    out.write_text(json.dumps({"sequence_parallel_size": sp}) + "\n")
    return str(out)


def tp_fragment(tmp: Path, tp: int) -> str:
    """A --deepspeed fragment setting AutoTP's size (1: none), and no sequence parallelism: the table's cells
    are without it (an sp fragment among the user's files would otherwise apply to every GPU count), the longest
    sequence adds it after this one."""
    import json

    out = tmp / f"tensor_parallel_{tp}.json"
    out.write_text(json.dumps({"tensor_parallel": {"autotp_size": tp}, "sequence_parallel_size": 1}) + "\n")
    return str(out)
