"""Will this run fit? Peak memory per GPU and host memory per node, before you launch.

    python tools/estimate_memory.py --model meta-llama/Llama-3.1-8B --deepspeed ds_configs/zero3.json ds_configs/bf16.json \
        --num_gpus 8 --micro_batch_size 2 --seq_len 4096 --gradient_checkpointing --gpu_memory 80GiB
    python tools/estimate_memory.py --recipe recipes/tiny-llama.yaml --deepspeed ds_configs/zero2.json --num_gpus 2
    python tools/estimate_memory.py --model path/to/config.json --table --gpu_memory 80GiB     # what fits where
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
Sequence parallelism (DeepSpeed's Ulysses): the size comes from the merged config's sequence_parallel_size, or
--sequence_parallel N; each rank's activations are those of seq_len / N tokens (attention on the whole sequence
with 1/N of the heads), ZeRO partitions over every rank. The loss is train.py's: tiled once a micro-batch has
more tokens than one tile (--tiled_loss, --loss_tile_tokens), the MLP tiled with --tiled_mlp true. --table adds
the longest sequence that fits on 1, 2, 4 and 8 GPUs with sequence parallelism over all of them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

# DeepSpeed's logger writes to the stdout it finds at import, and the config check (zero_recipes/ds_schema.py)
# imports it: bound to stderr here, so stdout (--json) carries the estimate alone.
with contextlib.redirect_stdout(sys.stderr):
    import deepspeed  # noqa: F401

from zero_recipes.config import ConfigError
from zero_recipes.memory.from_args import load, one
from zero_recipes.memory.table import GPU_COUNTS, table


def gb(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


def print_one(e, cfg, args, gpu_memory) -> None:
    from zero_recipes.memory.estimate import FRAGMENTATION, OUTSIDE_ALLOCATOR_BYTES

    g, n = e.per_gpu, e.per_node
    off = ", ".join(f"{k} -> {v}" for k, v in e.offload.items() if v) or "none"
    print(
        f"model: {e.num_params / 1e9:.3f}B parameters; ZeRO-{e.zero_stage}, {e.precision}, offload {off}; "
        f"{args.num_gpus} GPU(s) x {args.num_nodes} node(s); micro-batch {cfg.per_device_train_batch_size} x "
        f"{cfg.block_size} tokens; gradient checkpointing {'on' if cfg.gradient_checkpointing else 'off'}"
    )
    if e.sequence_parallel > 1:
        print(
            f"sequence parallel: {args.num_gpus * args.num_nodes // e.sequence_parallel} data-parallel x "
            f"{e.sequence_parallel} sequence-parallel (Ulysses); each rank holds {cfg.block_size // e.sequence_parallel} "
            f"of every {cfg.block_size} tokens, ZeRO partitions over all {e.data_parallel} ranks"
        )
    if e.tensor_parallel > 1:
        print(
            f"tensor parallel: {e.data_parallel} data-parallel x {e.tensor_parallel} tensor-parallel (AutoTP); each "
            f"rank holds {e.params_per_rank:,} of the {e.num_params:,} parameters before ZeRO partitions them over "
            f"the {e.data_parallel} data-parallel rank(s)"
        )
    if e.trainable_params is not None:
        print(
            f"lora: r {cfg.lora_r} on {', '.join(cfg.lora_target_modules)}; trains {e.trainable_params:,} of "
            f"{e.num_params:,} parameters ({100 * e.trainable_params / e.num_params:.2f} %); the frozen base at "
            f"{2 if e.precision != 'fp32' else 4} bytes each, no grads or optimizer states"
        )
    else:
        print(f"trainable: all {e.num_params:,} parameters (full fine-tuning)")
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
                f"{gb(OUTSIDE_ALLOCATOR_BYTES + FRAGMENTATION * g['peak_bytes'])}; it may run out of memory",
                "no": f"fits in {gb(gpu_memory)}: NO",
            }[e.fit]
            + ("" if e.fits else "; try --table to see which config fits")
        )


def print_table(t: dict) -> None:
    lora = f", LoRA r {t['lora_r']}" if t["lora_r"] else ""
    print(
        f"model: {t['num_params'] / 1e9:.3f}B parameters, {t['precision']}{lora}, micro-batch {t['micro_batch_size']} x "
        f"{t['seq_len']} tokens; peak per GPU (* fits in {gb(t['gpu_memory'])}, ~ tight: the allocated peak "
        "fits, not with the CUDA context, NCCL and fragmentation)"
    )
    if t["lora_tried"]:
        print(f"+lora: LoRA r {t['lora_tried']['r']} on all-linear (not set: tried before any offload)")
    if t["tensor_parallel_tried"]:
        print(
            "+tpN: AutoTP with N GPUs per group, tried where N divides the GPUs per node (never across nodes); "
            "ZeRO partitions over the GPUs / N data-parallel ranks"
        )
    for note in t["notes"]:
        print(f"note: {note}")
    rows = t["rows"] + t["lora_rows"] + t["tp_rows"]
    columns = list(dict.fromkeys((r["config"], r["lora_r"], r["tensor_parallel"]) for r in rows))
    label = {
        k: k[0] + (f"+lora{k[1]}" if t["lora_tried"] and k[1] else "") + (f"+tp{k[2]}" if k[2] > 1 else "")
        for k in columns
    }
    print(f"{'GPUs':>5s} {'GC':>3s} " + " ".join(f"{label[k]:>24s}" for k in columns))
    mark = {"yes": "*", "tight": "~", "no": " "}
    for n in GPU_COUNTS:
        for gc in (False, True):
            cells = {
                (r["config"], r["lora_r"], r["tensor_parallel"]): r
                for r in rows
                if r["num_gpus"] == n and r["gradient_checkpointing"] == gc
            }
            print(
                f"{n:>5d} {'on' if gc else 'off':>3s} "
                + " ".join(
                    f"{gb(cells[k]['peak_bytes']) + mark[cells[k]['fit']] if k in cells else '-':>24s}" for k in columns
                )
            )
    print()
    for n in GPU_COUNTS:
        b = t["recommended"].get(n)
        print(f"{n:>3d} GPU(s): " + (recommendation(b, t["lora_r"]) if b else "nothing fits"))
    if t["longest_sequence"]:
        print_longest(t["longest_sequence"], t["gpu_memory"])


def print_longest(ls: dict, gpu_memory: int) -> None:
    """The longest sequence per GPU count (Ulysses over all of them), checkpointing off and on."""
    print(
        f"\nlongest sequence that fits in {gb(gpu_memory)} (tokens; {ls['config']}, {ls['precision']}, sequence parallel "
        f"over all GPUs of the node, micro-batch {ls['micro_batch_size']}, loss "
        f"{'tiled' if ls['tiled_loss'] else 'untiled'}{', MLP tiled' if ls['tiled_mlp'] else ''}):"
    )
    print(f"{'GPUs':>5s} {'SP':>3s} {'GC off':>14s} {'GC on':>14s}")
    for n in dict.fromkeys(r["num_gpus"] for r in ls["rows"]):
        cells = {r["gradient_checkpointing"]: r for r in ls["rows"] if r["num_gpus"] == n}
        if any("refused" in r for r in cells.values()):
            print(f"{n:>5d} {n:>3d}  refused: {cells[False]['refused']}")
            continue

        def cell(r):
            if r["seq_len"] is None:
                return "nothing fits"
            return (">= " if r["at_cap"] else "") + f"{r['seq_len']:,}"

        print(f"{n:>5d} {n:>3d} {cell(cells[False]):>14s} {cell(cells[True]):>14s}")


def recommendation(b: dict, lora_given: int) -> str:
    lora = f" + LoRA r{b['lora_r']}" if b["lora_r"] and not lora_given else ""
    tp = b.get("tensor_parallel", 1)
    return (
        f"{b['config']}{lora}{f' + tensor parallel {tp} (within a node)' if tp > 1 else ''}"
        f"{' + gradient checkpointing' if b['gradient_checkpointing'] else ''}"
        f" ({gb(b['peak_bytes'])}; micro-batch up to {b['max_micro_batch_size']})"
        + (" (LoRA: full fine-tuning fits only with offload or not at all)" if lora else "")
    )


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="hub id, local model directory, or config.json")
    ap.add_argument("--recipe", help="take model, micro-batch, seq len and checkpointing from a recipe")
    ap.add_argument("--deepspeed", nargs="+", help="DeepSpeed JSON fragments, merged as train.py merges them")
    ap.add_argument("--num_gpus", type=int, default=1, help="GPUs per node (default 1)")
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
        "--tiled_loss",
        choices=["true", "false"],
        help="train.py's --tiled_loss (default true: head and loss in tiles once a micro-batch exceeds one tile)",
    )
    ap.add_argument("--loss_tile_tokens", type=int, help="train.py's --loss_tile_tokens (default 0: auto)")
    ap.add_argument("--tiled_mlp", choices=["true", "false"], help="train.py's --tiled_mlp (default false)")
    lora = ap.add_argument_group("LoRA (train.py's options; a recipe's lora: block works too)")
    lora.add_argument("--lora_r", type=int, help="LoRA rank (0: full fine-tuning, the default)")
    lora.add_argument("--lora_alpha", type=float)
    lora.add_argument("--lora_dropout", type=float)
    lora.add_argument("--lora_target_modules", nargs="+", help="default all-linear (every linear but the head)")
    lora.add_argument("--modules_to_save", nargs="+", help="modules trained in full beside the adapters")
    lora.add_argument("--load_in_4bit", action="store_true", help="QLoRA: the frozen base's linear weights in NF4")
    ap.add_argument("--json", action="store_true", help="one JSON object, sizes in bytes")
    ap.add_argument("--table", action="store_true", help="GPU counts x configs x checkpointing; recommends one")
    ap.add_argument(
        "--longest_sequence",
        choices=("true", "false"),
        default="true",
        help="--table: also search the longest sequence that fits per GPU count (about a minute for an 8B model)",
    )
    ap.add_argument("--tokens", type=float, help="training tokens: adds total FLOPs, time, GPU-hours and energy")
    ap.add_argument("--gpu", default="H100", help="GPU for --tokens (peak FLOP/s and board power), default H100")
    ap.add_argument("--mfu", type=float, default=0.40, help="MFU assumed for --tokens (default 0.40)")
    ap.add_argument("--gpu_power", type=float, help="watts per GPU for --tokens (default: the GPU's board power)")
    return ap


def check_args(args) -> None:
    if not args.model and not args.recipe:
        raise ConfigError("give --model (hub id, model dir or config.json) or --recipe recipes/X.yaml")
    if args.num_gpus < 1 or args.num_nodes < 1:
        raise ConfigError(f"--num_gpus and --num_nodes must be >= 1 (got {args.num_gpus} and {args.num_nodes})")
    if args.tensor_parallel is not None and args.tensor_parallel < 1:
        raise ConfigError(f"--tensor_parallel must be >= 1 (got {args.tensor_parallel})")
    if args.sequence_parallel is not None and args.sequence_parallel < 1:
        raise ConfigError(f"--sequence_parallel must be >= 1 (got {args.sequence_parallel})")
    if not (0 < args.mfu <= 1):
        raise ConfigError(f"--mfu is a fraction in (0, 1], e.g. 0.4; got {args.mfu}")


def run_table(args, gpu_memory) -> None:
    if gpu_memory is None:
        raise ConfigError("--table needs --gpu_memory, e.g. --gpu_memory 80GiB")
    t = table(args, gpu_memory, load)
    print(json.dumps(t, indent=2) if args.json else "", end="\n" if args.json else "")
    if not args.json:
        print_table(t)


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
        )
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print_one(e, cfg, args, gpu_memory)
        c = out.get("compute")
        if c:
            print_compute(c)


def print_compute(c: dict) -> None:
    print(
        f"compute: {c['total_flops']:.3e} FLOPs for {c['tokens']:.3g} tokens (6ND alone: "
        f"{c['six_n_d_flops']:.3e}); at {c['mfu']:.0%} MFU on {c['gpus']} x {c['device']} "
        f"({c['peak_flops_per_gpu'] / 1e12:.0f} TFLOP/s dense): {c['wall_seconds'] / 86400:,.1f} days, "
        f"{c['gpu_hours']:,.0f} GPU-hours"
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
