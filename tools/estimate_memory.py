"""Will this run fit? Peak memory per GPU and host memory per node, before you launch.

    python tools/estimate_memory.py --model meta-llama/Llama-3.1-8B --deepspeed ds_configs/zero3.json ds_configs/bf16.json \
        --num_gpus 8 --micro_batch_size 2 --seq_len 4096 --gradient_checkpointing --gpu_memory 80GiB
    python tools/estimate_memory.py --recipe recipes/tiny-llama.yaml --deepspeed ds_configs/zero2.json --num_gpus 2
    python tools/estimate_memory.py --model path/to/config.json --table --gpu_memory 80GiB     # what fits where
    python tools/estimate_memory.py --model path/to/config.json --table --gpu_memory 80GiB --num_gpus 8  # 8 only
    python tools/estimate_memory.py --model path/to/config.json --tokens 1e12 --num_gpus 64 --gpu H100  # compute
    python tools/estimate_memory.py --model meta-llama/Llama-3.1-8B --deepspeed ds_configs/zero2.json \
        ds_configs/bf16.json --lora_r 16 --gpu_memory 24GiB                                           # LoRA

--model takes a hub id, a local model directory or a config.json; the architecture is built on the meta
device from the config alone, so no weights are read and a local config works offline. --deepspeed
fragments merge and their "auto"s resolve exactly as in train.py. Model states and DeepSpeed's buffers
come from zero_recipes/memory/states.py (checked against DeepSpeed on the CPU accelerator, see
benchmarks/estimator.md); activations are traced through the installed transformers model code.
LoRA (--lora_r and the other LoRA options of train.py, or a recipe's `lora:` block): the adapters are counted
by peft's own get_peft_model on the meta model; only they get grads and optimizer states. --table, when LoRA
is not set, also tries LoRA r=16 on all-linear, before any offload.
Tensor parallelism (DeepSpeed's AutoTP): the size comes from the merged config's tensor_parallel.autotp_size, or
--tensor_parallel N; AutoTP's split linear layers (their grads and optimizer states) and the activations inside
attention and the MLP are divided by it, embeddings, norms and the rest stay whole, and ZeRO partitions over the
data-parallel ranks (world / N). --table tries TP sizes 2, 4 and 8 where they divide the GPUs per node.
--table shows the --num_gpus given and the --table_gpus asked for (neither: 1 to 64 GPUs per node), its precision
in the first line, in 120 columns (--wide: every GPU count on one line); docs/memory.md "The table" says more.
Sequence parallelism (DeepSpeed's Ulysses): the size comes from the merged config's sequence_parallel_size, or
--sequence_parallel N; each rank's activations are those of seq_len / N tokens (attention on the whole sequence
with 1/N of the heads), ZeRO partitions over every rank. The loss is train.py's: tiled once a micro-batch has
more tokens than one tile (--tiled_loss, --loss_tile_tokens), the MLP tiled with --tiled_mlp true. --table adds
the longest sequence that fits on those GPU counts (neither option: 1, 2, 4 and 8) with sequence parallelism over
all of them, printed after the table while it searches (a progress line on a terminal).
Pipeline parallelism (DeepSpeed's PipelineModule, ZeRO-0 or ZeRO-1): the stage count comes from the merged config's
pipeline.stages, or --pipeline_parallel N; the layers are split as DeepSpeed splits them (pipeline.partition), each
stage's states are those of its layers over its data-parallel replicas, its activations those of the micro-batches
it holds at once under the 1F1B schedule (--gradient_accumulation_steps micro-batches a step; the first stage holds
the most), the last stage's the whole logits' loss. The peak per GPU is the worst stage's; --tokens counts the
bubble. --table tries 2 and 4 stages with ZeRO-0/1 where they divide the GPUs of all nodes.
Mixtures of experts (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek): total and active parameters are printed; every expert's
weights, grads and optimizer states are counted. Expert parallelism (DeepSpeed AutoEP) comes from the merged config's
expert_parallel.autoep_size, or --expert_parallel N: each rank holds E/N of every layer's experts, their states
sharded over world/N ranks, the dense ones over all; the most-loaded rank's routed tokens are counted at
--expert_imbalance (default 2) x the balanced share. With --gpu_memory, every ZeRO-1/2/3 x EP size that divides the
world and the experts is estimated and the first that fits recommended (memory/moe_advice.py says in which order).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

# DeepSpeed's logger writes to the stdout it finds at import, and the config check (zero_recipes/ds/schema.py)
# imports it: bound to stderr here, so stdout (--json) carries the estimate alone.
with contextlib.redirect_stdout(sys.stderr):
    import deepspeed  # noqa: F401

from zero_recipes.errors import ConfigError
from zero_recipes.memory import stack
from zero_recipes.memory.from_args import loader, one
from zero_recipes.memory.table import gpu_counts, table
from zero_recipes.memory.table_text import WIDTH, gb, longest, render


def optimizer_states_line(o: dict) -> str:
    """One rank's master weights and optimizer state: bytes, dtypes and where they live (states.optimizer_states)."""
    master = f"master weights {gb(o['master_bytes'])} ({o['master_dtype']}) + " if o["master_bytes"] else ""
    return (
        f"optimizer states per rank: {master}optimizer {gb(o['optimizer_bytes'])} ({o['moment_dtype']} moments"
        + (
            f"; Muon's {o['muon_params']:,} matrix parameters a momentum each{o['muon_note']}"
            if o.get("muon_params")
            else ""
        )
        + f"), on the {o['where']}"
    )


def print_one(e, cfg, args, gpu_memory) -> None:
    from zero_recipes.memory.estimate import margin_bytes

    g, n = e.per_gpu, e.per_node
    off = ", ".join(f"{k} -> {v}" for k, v in e.offload.items() if v) or "none"
    print(
        f"model: {e.num_params / 1e9:.3f}B parameters; ZeRO-{e.zero_stage}, {e.precision_words or e.precision}, "
        f"offload {off}; "
        f"{args.num_gpus} GPU(s) x {args.num_nodes} node(s); micro-batch {cfg.per_device_train_batch_size} x "
        f"{cfg.block_size} tokens; gradient checkpointing {'on' if cfg.gradient_checkpointing else 'off'}"
    )
    if e.sequence_parallel > 1:
        print(
            f"sequence parallel: {args.num_gpus * args.num_nodes // e.sequence_parallel} data-parallel x "
            f"{e.sequence_parallel} sequence-parallel (Ulysses); each rank holds {cfg.block_size // e.sequence_parallel} "
            f"of every {cfg.block_size} tokens, ZeRO partitions over all {e.data_parallel} ranks"
        )
    if e.pipeline:
        print_pipeline(e)
    if e.tensor_parallel > 1:
        print(
            f"tensor parallel: {e.data_parallel} data-parallel x {e.tensor_parallel} tensor-parallel (AutoTP); each "
            f"rank holds {e.params_per_rank:,} of the {e.num_params:,} parameters before ZeRO partitions them over "
            f"the {e.data_parallel} data-parallel rank(s)"
        )
    if e.moe:
        print_moe(e)
    if e.trainable_params is not None:
        print(
            f"lora: r {cfg.lora_r} on {', '.join(cfg.lora_target_modules)}; trains {e.trainable_params:,} of "
            f"{e.num_params:,} parameters ({100 * e.trainable_params / e.num_params:.2f} %); the frozen base at "
            f"{2 if e.precision != 'fp32' else 4} bytes each, no grads or optimizer states"
        )
    else:
        print(f"trainable: all {e.num_params:,} parameters (full fine-tuning)")
    if e.optimizer_states:
        print(optimizer_states_line(e.optimizer_states))
    for note in e.notes:
        print(f"note: {note}")
    print(f"\n{'phase':18s}{'per GPU':>14s}{'states':>14s}{'buffers':>14s}{'activations':>14s}{'host/rank':>14s}")
    for name, t in e.phases.items():
        mark = "  <- peak" if name == g["peak_phase"] else ""
        print(
            f"{name:18s}{gb(t['device_bytes']):>14s}{gb(t['model_states_bytes']):>14s}{gb(t['buffers_bytes']):>14s}"
            f"{gb(t['activations_bytes']):>14s}{gb(t['host_bytes']):>14s}{mark}"
        )
    print(f"\npeak per GPU: {gb(g['peak_bytes'])} in {g['peak_phase']} (activations {e.activations_method})")
    print(
        f"host per node: {gb(n['cpu_bytes'])} CPU RAM, of it pinned {gb(n['pinned_bytes'])}"
        + (f"; NVMe {gb(n['nvme_bytes'])}" if n["nvme_bytes"] else "")
    )
    if gpu_memory:
        room = gpu_memory - g["peak_bytes"]
        print(
            {
                "yes": f"fits in {gb(gpu_memory)}: yes ({gb(room)} left)",
                "tight": f"fits in {gb(gpu_memory)}: TIGHT, {gb(room)} left for the CUDA context, NCCL and the "
                "allocator's fragmentation, which need about "
                f"{gb(margin_bytes(g['peak_bytes'], e.zero_stage))}; it may run out of memory",
                "no": f"fits in {gb(gpu_memory)}: NO",
            }[e.fit]
            + ("" if e.fits else "; try --table to see which config fits")
        )


def print_moe(e) -> None:
    """A mixture of experts' parameters: every expert's (what memory holds) and a token's (what compute costs)."""
    m = e.moe
    print(
        f"mixture of experts: {m['total_params']:,} parameters, {m['active_params']:,} active per token "
        f"({m['experts']} experts, {m['top_k']} per token, {m['sparse_layers']} sparse layers); every expert's "
        "weights, grads and optimizer states are counted"
    )
    if m["expert_parallel"] > 1:
        print(
            f"expert parallel: {m['expert_parallel']} (AutoEP); each rank holds {m['experts'] // m['expert_parallel']} "
            f"of every layer's {m['experts']} experts, {m['held_params']:,} parameters, the experts' states sharded "
            f"over {m['expert_shards']} rank(s), the dense ones over all; routed tokens counted at "
            f"{m['expert_imbalance']:g} x the balanced share on the most-loaded rank (--expert_imbalance)"
        )


def print_advice(advice: dict, extra: list, gpu_memory: int) -> None:
    """Every ZeRO stage x EP size tried for a mixture of experts, and the recommendation."""
    from zero_recipes.memory.moe_advice import command

    cells = "; ".join(
        f"{c['config']}{'+ep' + str(c['expert_parallel']) if c['expert_parallel'] > 1 else ''}"
        f"{' gc' if c['gradient_checkpointing'] else ''} {gb(c['peak_bytes'])}{'' if c['fits'] else ' (' + c['fit'] + ')'}"
        for c in advice["cells"]
    )
    import textwrap

    print("\n" + "\n".join(textwrap.wrap(f"mixture of experts, peak per GPU by config: {cells}", WIDTH - 1)))
    best = advice["recommended"]
    if best is None:
        print(f"recommended: none fits in {gb(gpu_memory)} without offload; try --table for offload and LoRA")
        return
    gc = " --gradient_checkpointing" if best["gradient_checkpointing"] else ""
    print(f"recommended: --deepspeed {command(best, extra)}{gc} ({gb(best['peak_bytes'])} per GPU)")


def print_pipeline(e) -> None:
    """The layout, the worst stage and every stage, in the style of the TP and SP lines."""
    pp, worst = e.pipeline, e.pipeline["stages"][e.pipeline["worst_stage"]]
    last = len(pp["stages"]) - 1
    which = " (the first)" if worst["stage"] == 0 else " (the last)" if worst["stage"] == last else ""
    print(
        f"pipeline parallel: {e.data_parallel} data-parallel x {e.pipeline_parallel} stages; stage {worst['stage']}"
        f"{which} holds the most: {worst['holds']}, {worst['params']:,} of the {e.num_params:,} parameters, "
        f"{worst['in_flight']} of {pp['micro_batches']} micro-batches in flight; {pp['micro_batches']} micro-batches "
        f"a step, bubble {100 * pp['bubble']:.0f} %; ZeRO partitions a stage over its {e.data_parallel} replica(s)"
    )
    for st in pp["stages"]:
        print(
            f"  stage {st['stage']}: {st['holds']}, {st['params']:,} parameters, {st['in_flight']} in flight, peak "
            f"{gb(st['peak_bytes'])} in {st['peak_phase']} (activations {gb(st['activations_bytes'])})"
        )


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="hub id, local model directory, or config.json")
    ap.add_argument("--recipe", help="take model, micro-batch, seq len and checkpointing from a recipe")
    ap.add_argument("--deepspeed", nargs="+", help="DeepSpeed JSON fragments, merged as train.py merges them")
    ap.add_argument("--num_gpus", type=int, help="GPUs per node (default 1; --table: this count only, default 1 to 64)")
    ap.add_argument("--num_nodes", type=int, default=1)
    ap.add_argument("--micro_batch_size", type=int, help="per-GPU micro-batch (default: the recipe's, else 1)")
    ap.add_argument("--seq_len", type=int, help="tokens per sequence (default: the recipe's block_size)")
    ap.add_argument("--gradient_checkpointing", action="store_true")
    ap.add_argument("--gpu_memory", help="memory per GPU, e.g. 80GiB; says whether it fits")
    ap.add_argument(
        "--tensor_parallel",
        type=int,
        help="AutoTP size (GPUs per tensor-parallel group); default: the config's tensor_parallel.autotp_size, else 1",
    )
    ap.add_argument(
        "--sequence_parallel",
        type=int,
        help="Ulysses size (GPUs per sequence-parallel group); default: the config's sequence_parallel_size, else 1",
    )
    ap.add_argument(
        "--pipeline_parallel",
        type=int,
        help="pipeline stages (DeepSpeed PipelineModule, ZeRO-0/1); default: the config's pipeline.stages, else 1",
    )
    ap.add_argument(
        "--expert_parallel",
        type=int,
        help="AutoEP size (a mixture of experts' experts split over N ranks); default: the config's "
        "expert_parallel.autoep_size, else 1",
    )
    ap.add_argument(
        "--expert_imbalance",
        type=float,
        help="under expert parallelism, the most-loaded rank's routed tokens over the balanced share (default 2)",
    )
    ap.add_argument(
        "--gradient_accumulation_steps",
        type=int,
        help="train.py's; under a pipeline, its micro-batches a step (default: the recipe's, else 1)",
    )
    ap.add_argument(
        "--tiled_loss",
        choices=["true", "false"],
        help="train.py's --tiled_loss (default true: head and loss in tiles once a micro-batch exceeds one tile)",
    )
    ap.add_argument("--loss_tile_tokens", type=int, help="train.py's --loss_tile_tokens (default 0: auto)")
    ap.add_argument(
        "--objective",
        choices=["lm", "dpo"],
        help="train.py's --objective (default: the recipe's, else lm); dpo: micro-batches count pairs of at most "
        "--seq_len tokens, their answers' logits whole, the reference computed once (no reference model held)",
    )
    ap.add_argument("--tiled_mlp", choices=["true", "false"], help="train.py's --tiled_mlp (default false)")
    lora_arguments(ap.add_argument_group("LoRA (train.py's options; a recipe's lora: block works too)"))
    stack.add_arguments(ap)
    ap.add_argument("--json", action="store_true", help="one JSON object, sizes in bytes")
    ap.add_argument("--table", action="store_true", help="GPU counts x configs x checkpointing; recommends one")
    ap.add_argument(
        "--table_gpus",
        help="--table: GPU counts per node to show, e.g. 1,8,64, or all (1 to 64); with --num_gpus, both",
    )
    ap.add_argument("--wide", action="store_true", help=f"--table: every GPU count side by side, not {WIDTH} columns")
    ap.add_argument(
        "--longest_sequence",
        choices=("true", "false"),
        default="true",
        help="--table: also search the longest sequence that fits per GPU count (~10 s each for an 8B model)",
    )
    ap.add_argument("--tokens", type=float, help="training tokens: adds total FLOPs, time, GPU-hours and energy")
    ap.add_argument("--gpu", default="H100", help="GPU for --tokens (peak FLOP/s and board power), default H100")
    ap.add_argument("--mfu", type=float, default=0.40, help="MFU assumed for --tokens (default 0.40)")
    ap.add_argument("--gpu_power", type=float, help="watts per GPU for --tokens (default: the GPU's board power)")
    return ap


def lora_arguments(lora) -> None:
    lora.add_argument("--lora_r", type=int, help="LoRA rank (0: full fine-tuning, the default)")
    lora.add_argument("--lora_alpha", type=float)
    lora.add_argument("--lora_dropout", type=float)
    lora.add_argument("--lora_target_modules", nargs="+", help="default all-linear (every linear but the head)")
    lora.add_argument("--modules_to_save", nargs="+", help="modules trained in full beside the adapters")
    lora.add_argument("--load_in_4bit", action="store_true", help="QLoRA: the frozen base's linear weights in NF4")


def check_args(args) -> None:
    if not args.model and not args.recipe:
        raise ConfigError("give --model (hub id, model dir or config.json) or --recipe recipes/X.yaml")
    if not args.table and (args.table_gpus or args.wide):
        raise ConfigError("--table_gpus and --wide shape the table; add --table (or drop them for one estimate)")
    if args.table_gpus is not None:
        args.table_gpus = table_gpus(args.table_gpus)
    args.table_counts = gpu_counts(args.num_gpus, args.table_gpus)  # before --num_gpus takes its default
    args.num_gpus = 1 if args.num_gpus is None else args.num_gpus
    if args.num_gpus < 1 or args.num_nodes < 1:
        raise ConfigError(f"--num_gpus and --num_nodes must be >= 1 (got {args.num_gpus} and {args.num_nodes})")
    if args.tensor_parallel is not None and args.tensor_parallel < 1:
        raise ConfigError(f"--tensor_parallel must be >= 1 (got {args.tensor_parallel})")
    if args.sequence_parallel is not None and args.sequence_parallel < 1:
        raise ConfigError(f"--sequence_parallel must be >= 1 (got {args.sequence_parallel})")
    if args.pipeline_parallel is not None and args.pipeline_parallel < 1:
        raise ConfigError(f"--pipeline_parallel must be >= 1 (got {args.pipeline_parallel})")
    if args.expert_parallel is not None and args.expert_parallel < 1:
        raise ConfigError(f"--expert_parallel must be >= 1 (got {args.expert_parallel})")
    if args.expert_imbalance is not None and args.expert_imbalance < 1:
        raise ConfigError(f"--expert_imbalance is the most-loaded rank's share over the balanced one, >= 1; got "
                          f"{args.expert_imbalance}")  # fmt: skip
    if not (0 < args.mfu <= 1):
        raise ConfigError(f"--mfu is a fraction in (0, 1], e.g. 0.4; got {args.mfu}")
    stack.check(args)


def table_gpus(text: str) -> tuple[int, ...] | str:
    """--table_gpus: "all", or GPU counts per node separated by commas."""
    if text.strip() == "all":
        return "all"
    try:
        counts = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        counts = []
    if not counts or counts[0] < 1:
        raise ConfigError(f"--table_gpus takes GPU counts per node like 1,8,64 (each >= 1), or all; got {text!r}")
    return tuple(counts)


def run_table(args, gpu_memory) -> None:
    if gpu_memory is None:
        raise ConfigError("--table needs --gpu_memory, e.g. --gpu_memory 80GiB")
    counts, longest_counts = args.table_counts
    show = status_line(sys.stderr)

    def grid_done(t: dict) -> None:  # the table now, the longest sequence's search after it
        if show:
            show(None)
        print("\n".join(render(t, args.wide)), flush=True)

    try:
        t = table(args, gpu_memory, loader(), counts, longest_counts, show, None if args.json else grid_done)
    finally:
        if show:
            show(None)
    if args.json:
        print(json.dumps(t, indent=2))
    elif t["longest_sequence"]:
        print("\n".join(longest(t["longest_sequence"], gpu_memory)))


def status_line(stream):
    """The table's progress as one line redrawn in place, with the seconds so far, on a terminal (an 8B model's
    table takes tens of seconds, most in the longest sequence's search); none into a file or a pipe, which get
    the result alone. show(None) clears the line."""
    import time

    if not stream.isatty():
        return None
    start = time.monotonic()

    def show(text: str | None) -> None:
        line = "" if text is None else f"[{time.monotonic() - start:4.0f} s] {text}"[: WIDTH - 1]
        stream.write(f"\r\033[K{line}")
        stream.flush()

    return show


def run_one(args, gpu_memory) -> None:
    from zero_recipes.memory import training_compute

    e, cfg, config = one(args, gpu_memory)
    out = e.as_json()
    if args.tokens:
        world = args.num_gpus * args.num_nodes
        out["compute"] = training_compute(
            config,
            e.num_params,
            args.tokens,
            cfg.block_size,
            world,
            args.gpu,
            e.precision,
            args.mfu,
            args.gpu_power,
            e.pipeline_parallel,
            e.pipeline["micro_batches"] if e.pipeline else 1,
        )
    advice = None
    if e.moe and gpu_memory:
        from zero_recipes.memory.moe_advice import advise, applies

        if applies(config, cfg, e):
            advice = out["moe_advice"] = advise(args, cfg, config, gpu_memory, loader())
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print_one(e, cfg, args, gpu_memory)
        c = out.get("compute")
        if c:
            print_compute(c)
        if advice:
            from zero_recipes.memory.moe_advice import extra_fragments

            print_advice(advice, extra_fragments(cfg), gpu_memory)


def print_compute(c: dict) -> None:
    print(
        f"compute: {c['total_flops']:.3e} FLOPs for {c['tokens']:.3g} tokens (6ND alone: "
        f"{c['six_n_d_flops']:.3e}); at {c['mfu']:.0%} MFU on {c['gpus']} x {c['device']} "
        f"({c['peak_flops_per_gpu'] / 1e12:.0f} TFLOP/s dense): {c['wall_seconds'] / 86400:,.1f} days, "
        f"{c['gpu_hours']:,.0f} GPU-hours"
        + (f" (pipeline bubble {c['pipeline_bubble']:.0%} of every step)" if c["pipeline_bubble"] else "")
        + (f", {c['energy_kwh']:,.0f} kWh at {c['board_power_w']:.0f} W per GPU" if "energy_kwh" in c else "")
    )


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        from zero_recipes.memory import parse_memory

        check_args(args)
        gpu_memory = parse_memory(args.gpu_memory) if args.gpu_memory else None
        if args.table:
            run_table(args, gpu_memory)
            return 0
        run_one(args, gpu_memory)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
