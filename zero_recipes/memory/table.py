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
Pipeline parallelism (DeepSpeed's PipelineModule, `pipeline.stages`) with ZeRO-0 or ZeRO-1 splits the layers into
stages across GPUs, nodes included (only activations cross between stages), at the price of the 1F1B bubble,
(N - 1) / (m + N - 1) of every step with m micro-batches (the run's gradient accumulation steps). It is tried at
sizes that divide a row's GPUs over all nodes and that the model has layers for, after tensor parallelism and
before LoRA (it trains every parameter). (The longest sequence that fits, which the table ends with, is
longest.py's.)
"""

from __future__ import annotations

from pathlib import Path

from zero_recipes.config import shipped
from zero_recipes.ds.facts import autocast_dtype, precision as ds_precision, precision_words, state_bytes

from .longest import LONGEST_GPUS, longest_rows

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
# Pipeline stage counts the table tries, where they divide the GPUs of all nodes, with the ZeRO stages a pipeline
# takes (combinations.py)
PP_SIZES = (2, 4)
PP_CONFIGS = ("zero0", "zero1")


def gpu_counts(num_gpus: int | None, table_gpus: tuple | str | None) -> tuple[tuple, tuple]:
    """(GPU counts per node the table shows, those its longest sequence is searched for): the --num_gpus given
    and the --table_gpus asked for, each for both; with neither, or --table_gpus all, the sweep GPU_COUNTS and,
    for the search, LONGEST_GPUS (the sweep's counts that make one node's sequence-parallel group)."""
    if table_gpus == "all" or (num_gpus is None and not table_gpus):
        return GPU_COUNTS, LONGEST_GPUS
    counts = tuple(sorted({*(table_gpus or ()), *(() if num_gpus is None else (num_gpus,))}))
    return counts, counts


def lora_of(cfg):
    """The run's peft LoraConfig (zero_recipes.adapters.lora.lora_config, as train.py wraps the model), or None."""
    from zero_recipes.adapters import lora
    from zero_recipes.config import lora_options

    return lora.lora_config(cfg) if lora_options.enabled(cfg) else None


def table_variants(cfg, config, precision: str, autocast: str | None = None) -> list[dict]:
    """What the table tries: the run as given (full fine-tuning, or the LoRA it sets) over every config, and,
    when LoRA is not set, LoRA r=TABLE_LORA_R on all-linear over the configs without offload. Each with its
    shape (peft's count on the meta model) and activations traced once per checkpointing choice (under
    torch.autocast when the files enable `torch_autocast`: `autocast` is its dtype)."""
    import dataclasses

    runs = [(cfg, list(TABLE_CONFIGS))]
    if cfg.lora_r == 0:
        runs.append((dataclasses.replace(cfg, lora_r=TABLE_LORA_R, lora_target_modules=["all-linear"]), LORA_CONFIGS))
    return [
        variant(cfg, config, precision, lora_of(run_cfg), run_cfg.lora_r, names, autocast=autocast)
        for run_cfg, names in runs
    ]


def variant(cfg, config, precision: str, lora, lora_r: int, names, tp: int = 1, autocast: str | None = None) -> dict:
    """One kind of run the table tries over `names`: its shape and its activations per checkpointing choice."""
    import torch

    from .activations import activation_bytes
    from .shape import ModelShape

    dtype = torch.float32 if precision == "fp32" else torch.bfloat16  # activations: 2 bytes in bf16 and fp16 alike
    shape = ModelShape.of(config, lora, tp=tp, tp_block={"autotp_size": tp})
    attn = cfg.attn_implementation or "sdpa"
    acts = {
        gc: activation_bytes(
            config,
            1,
            cfg.block_size,
            dtype,
            gc,
            attn,
            lora,
            tp,
            shape.vocab_parallel,
            objective=cfg.objective,
            autocast=autocast,
        )
        for gc in (False, True)
    }
    return {"lora_r": lora_r, "lora": lora, "configs": names, "shape": shape, "acts": acts, "tp": tp, "pp": 1}


def tp_variants(cfg, config, ds: dict, precision: str, notes: list, counts: tuple, progress) -> list[dict]:
    """Full fine-tuning under each TP size that divides one of `counts` (a TP group within a node) and this model
    can be split by (train.py's own check, tensor_parallel.py `check_split`: a TP plan, heads divisible; LoRA
    does not combine with TP); the sizes it cannot take are a note."""
    from zero_recipes.parallel.mesh import Mesh
    from zero_recipes.parallel.tensor_parallel import TensorParallel

    from ..errors import ConfigError

    if cfg.lora_r:
        return []
    out, refused = [], []
    for tp in (tp for tp in TP_SIZES if any(n % tp == 0 for n in counts)):
        try:
            # as its cells will run: ZeRO-1 at least (TP_CONFIGS), at this TP size
            tried = {**ds, "zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": tp}}
            TensorParallel(Mesh(tp, tp)).check(config, tried, cfg)
        except ConfigError as err:
            refused.append(f"{tp} ({str(err).split(': ', 1)[-1].split(';')[0]})")
            continue
        progress(f"tracing the activations under tensor parallelism {tp}")
        out.append(variant(cfg, config, precision, None, 0, TP_CONFIGS, tp))
    if refused:
        notes.append("tensor parallelism not tried for autotp_size " + ", ".join(refused))
    return out


def pp_variants(cfg, config, ds: dict, precision: str, notes: list, worlds: tuple, progress) -> list[dict]:
    """Full fine-tuning under each pipeline stage count that divides one of `worlds` (the GPUs of all nodes) and
    that train.py would split this model into (parallel/pipeline/axis.py's own check: a family it splits, at most one
    stage per decoder layer; LoRA does not combine with a pipeline); the counts it cannot take are a note. Each
    stage's activations traced once per checkpointing choice at micro-batch 1 (the cells scale them)."""
    from zero_recipes.parallel.mesh import Mesh
    from zero_recipes.parallel.pipeline.axis import PipelineParallel

    from ..errors import ConfigError
    from . import pipeline
    from .estimate import Launch
    from .pipeline_trace import all_stages
    from .shape import ModelShape

    if cfg.lora_r:
        return []
    out, refused = [], []
    m = pipeline.micro_batches(ds)
    # bf16 master weights (bf16_states.json) need ZeRO 1-3: the intake refuses them on ZeRO-0
    configs = PP_CONFIGS if state_bytes(ds)[0] == 4 else tuple(c for c in PP_CONFIGS if c != "zero0")
    for pp in (pp for pp in PP_SIZES if any(n % pp == 0 for n in worlds)):
        tried = {**ds, "zero_optimization": {"stage": 1}, "pipeline": {**(ds.get("pipeline") or {}), "stages": pp}}
        axis = PipelineParallel(Mesh(pp, pp=pp))
        try:
            axis.configure(tried)
            axis.check(config, tried, cfg)
        except ConfigError as err:
            refused.append(f"{pp} ({str(err).split(': ', 1)[-1].split(';')[0]})")
            continue
        progress(f"tracing the activations of {pp} pipeline stages")
        stages = pipeline.split(config, pp, tried["pipeline"]["partition"], m)
        p = 4 if precision == "fp32" else 2
        launch = {gc: Launch(pp, 1, 1, cfg.block_size, gc, cfg.attn_implementation or "sdpa",
                             tiled_mlp=cfg.tiled_mlp) for gc in (False, True)}  # fmt: skip
        acts = {gc: all_stages(config, stages, m, launch[gc], p) for gc in (False, True)}
        out.append({"lora_r": 0, "lora": None, "configs": configs, "shape": ModelShape.of(config),
                    "acts": acts, "tp": 1, "pp": pp})  # fmt: skip
    if refused:
        notes.append("pipeline parallelism not tried for stages " + ", ".join(refused))
    return out


def preference(variants: list[dict]) -> list[tuple]:
    """(config, checkpointing, lora_r, tp, pp) in the order the table recommends: full fine-tuning without
    offload, then tensor parallelism within a node (smaller groups first), then pipeline parallelism (fewer stages
    first), then the LoRA the table tried, then offload; within each, lower stages first, checkpointing second."""
    given = variants[0]["lora_r"]
    tried = [v["lora_r"] for v in variants[1:] if v["tp"] == 1 and v["pp"] == 1]
    tps = sorted({v["tp"] for v in variants if v["tp"] > 1})
    pps = sorted({v["pp"] for v in variants if v["pp"] > 1})
    order = [(name, gc, given, 1, 1) for name, gc in PREFERENCE if name in LORA_CONFIGS]
    order += [(name, gc, 0, tp, 1) for tp in tps for gc in (False, True) for name in TP_CONFIGS]
    order += [(name, gc, 0, 1, pp) for pp in pps for gc in (False, True) for name in PP_CONFIGS]
    order += [(name, gc, r, 1, 1) for r in tried for gc in (False, True) for name in LORA_CONFIGS]
    return order + [(name, gc, given, 1, 1) for name, gc in PREFERENCE if name not in LORA_CONFIGS]


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
        "pipeline_parallel": pick[4],
        "trainable_params": e.trainable_params,
    }


def table(
    args, gpu_memory: int, load, counts=GPU_COUNTS, longest_counts=LONGEST_GPUS, progress=None, grid_done=None
) -> dict:
    """Every GPU count of `counts` x config x gradient checkpointing (and the LoRA and TP sizes tried);
    activations scaled by micro-batch (exact for sdpa/flash: they are linear in it). `load(args, deepspeed_files,
    world)` is the CLI's parsing through train.py's: (TrainConfig, model config, resolved DeepSpeed dict, notes).
    `progress(text)`, when given, hears what the slow steps are doing (the traces; the longest sequence's search);
    `grid_done(t)` gets the table before the longest sequence is searched (most of a large model's time), so the
    CLI prints it while the search runs."""
    import tempfile

    from .precision import FP32_ASSUMED, statement

    progress = progress or (lambda text: None)
    with tempfile.TemporaryDirectory(prefix="zr-table-") as tmp:
        # each cell's TP size and stage count as one more fragment, last, so it overrides what the user's files set
        sizes = [(1, 1), *((tp, 1) for tp in TP_SIZES), *((1, pp) for pp in PP_SIZES)]
        fragment = {size: mesh_fragment(Path(tmp), *size) for size in sizes}
        cfg, config, ds, notes = load(args, [*(args.deepspeed or TABLE_CONFIGS["zero1"]), fragment[1, 1]], 1)
        precision = ds_precision(ds)
        assumed = FP32_ASSUMED in notes  # the table's first line says it, not a note as well
        notes = [n for n in notes if n != FP32_ASSUMED]
        stated = statement(precision, assumed, list(args.deepspeed or []), config, precision_words(ds))
        progress("tracing the activations (full fine-tuning, LoRA)")
        variants = table_variants(cfg, config, precision, autocast_dtype(ds))
        variants += tp_variants(cfg, config, ds, precision, notes, counts, progress)
        worlds = tuple(n * args.num_nodes for n in counts)
        variants += pp_variants(cfg, config, ds, precision, notes, worlds, progress)
        rows = {"rows": [], "lora_rows": [], "tp_rows": [], "pp_rows": []}
        best, best_full = {}, {}
        extra = [f for f in (args.deepspeed or []) if not Path(f).name.startswith("zero")]  # e.g. bf16.json
        micro0 = cfg.per_device_train_batch_size
        run = cell_estimator(args, cfg, config, gpu_memory)
        for n in counts:
            progress(f"estimating {n} GPU(s) per node")
            fitting = grid_rows(args, n, variants, extra, fragment, load, run, micro0, rows)
            full = [v for v in variants if v["lora_r"] == variants[0]["lora_r"]]
            for order, into in ((preference(variants), best), (preference(full), best_full)):
                choice = first_fitting(order, fitting, lambda v, ds_n, gc, micro: run(v, ds_n, n, gc, micro), micro0)
                if choice:
                    into[n] = choice
        out = summary(cfg, variants, precision, gpu_memory, rows, best, best_full, notes)
        out.update(precision_statement=stated, gpu_counts=list(counts), num_nodes=args.num_nodes)
        if grid_done:
            grid_done(out)
        if getattr(args, "longest_sequence", "true") != "false":  # false: the table alone
            out["longest_sequence"] = longest_rows(
                args, cfg, config, precision, extra, fragment[1, 1], load, gpu_memory, longest_counts, progress
            )
    return out


def cell_estimator(args, cfg, config, gpu_memory: int):
    """run(variant, resolved ds, GPUs per node, checkpointing, micro-batch): one cell's estimate, the variant's
    activations (traced at micro-batch 1; a pipeline's per stage) scaled by the micro-batch."""
    import dataclasses

    from . import stack
    from .estimate import Precomputed, estimate

    def run(v, ds_n, n, gc, micro):
        launch = stack.launch_of(args, cfg, config, n, gc, micro)
        if v["pp"] > 1:
            stages = [a.scaled(micro) for a in v["acts"][gc]]
            return estimate(config, ds_n, launch, gpu_memory, precomputed=Precomputed(v["shape"], stage_traces=stages))
        act = dataclasses.replace(v["acts"][gc], bytes=v["acts"][gc].bytes * micro)
        return estimate(config, ds_n, launch, gpu_memory, lora=v["lora"], precomputed=Precomputed(v["shape"], act))

    return run


def grid_rows(args, n: int, variants: list, extra: list, fragment: dict, load, run, micro0: int, rows: dict) -> dict:
    """One GPU count's cells, each appended as a row to rows["rows"] (the run as given), rows["lora_rows"] (the
    LoRA the table tried), rows["tp_rows"] or rows["pp_rows"]; returns those that fit, by (config, checkpointing,
    lora_r, tp, pp), with what first_fitting needs of them: (resolved ds, Estimate, variant)."""
    fitting = {}
    for v in variants:
        # a TP group stays within a node: its size divides the GPUs per node; a pipeline's divides all nodes' GPUs
        if n % v["tp"] or n * args.num_nodes % v["pp"]:
            continue
        into = rows["tp_rows"] if v["tp"] > 1 else rows["pp_rows"] if v["pp"] > 1 else rows["rows"]
        into = rows["lora_rows"] if v["lora_r"] != variants[0]["lora_r"] else into
        # the resolved config does not depend on checkpointing: one load per config, not one per cell
        resolved = {
            name: load(args, [*shipped.COMBINATIONS[name], *extra, fragment[v["tp"], v["pp"]]], n * args.num_nodes)[2]
            for name in v["configs"]
        }
        for gc in (False, True):
            for name in v["configs"]:
                ds_n = resolved[name]
                e = run(v, ds_n, n, gc, micro0)
                row = {"num_gpus": n, "config": name, "gradient_checkpointing": gc}
                row.update(peak_bytes=e.per_gpu["peak_bytes"], fits=e.fits, fit=e.fit, lora_r=v["lora_r"])
                row.update(tensor_parallel=v["tp"], pipeline_parallel=v["pp"])
                if v["pp"] > 1:
                    row["worst_stage"] = e.pipeline["worst_stage"]
                into.append(row)
                if e.fits:
                    fitting[name, gc, v["lora_r"], v["tp"], v["pp"]] = (ds_n, e, v)
    return fitting


def summary(cfg, variants, precision: str, gpu_memory: int, rows: dict, best, best_full, notes) -> dict:
    """The table as tools/estimate_memory.py prints it (--json: as it is). `micro_batches`: a pipeline's per
    step, the run's gradient accumulation steps."""
    micro_batches = cfg.gradient_accumulation_steps
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
        "pp_rows": rows["pp_rows"],
        "tensor_parallel_tried": sorted({v["tp"] for v in variants if v["tp"] > 1}),
        "pipeline_parallel_tried": sorted({v["pp"] for v in variants if v["pp"] > 1}),
        "micro_batches": micro_batches,
        "lora_tried": {"r": TABLE_LORA_R, "target_modules": "all-linear"} if rows["lora_rows"] else None,
        "recommended": best,
        "recommended_full_fine_tuning": best_full if cfg.lora_r == 0 else None,
        "longest_sequence": None,  # longest.py's, added after the grid
        "notes": notes,
    }


def mesh_fragment(tmp: Path, tp: int, pp: int) -> str:
    """A --deepspeed fragment setting AutoTP's size and the pipeline's stages (1: none), and no sequence
    parallelism: the table's cells are without it (an sp fragment among the user's files would otherwise apply to
    every GPU count), the longest sequence adds it after this one. A pipeline block of the user's keeps its other
    settings (partition)."""
    import json

    out = tmp / f"mesh_tp{tp}_pp{pp}.json"
    sizes = {"tensor_parallel": {"autotp_size": tp}, "sequence_parallel_size": 1, "pipeline": {"stages": pp}}
    out.write_text(json.dumps(sizes) + "\n")
    return str(out)
