"""A mixture of experts under ZeRO-2, ZeRO-3 and ZeRO-2 + AutoEP's EP2 on the same work: tokens/s, per-rank
peak memory and per-step loss parity.

    python tools/benchmark.py moe              # a ~30M Mixtral (8 experts, top-2), CPU ranks: benchmarks/moe-DATE.*
    python tools/benchmark.py moe --quick      # a tiny Mixtral, 3 steps, profiled runs only (the test)
    python tools/benchmark.py moe --gpu        # the prepared GPU run (bf16, 2 GPUs); refuses a machine without

The runs, the rotated rounds, the ratios within a round and the profiled per-rank peaks are parallel/benchmark.py's
(its `measure` and `summarise` with these configurations); every configuration trains 2 ranks x micro m, each
rank its own rows, so fp32 losses agree step by step. tokens/s and MFU in train.py's records count active
FLOPs (moe.mlp_params: k experts per token), so a mixture of experts is not credited with every expert.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from zero_recipes.config.shipped import EXPERT_PARALLEL, select

from ..common import REPO, footer, new_report, write_report
from ..parallel.benchmark import launch, measure, slug, summarise
from ..parallel.report import results_table

_Z = select("zero2", "zero3")
CONFIGS: dict[str, tuple[int, tuple[str, ...], int]] = {
    "ZeRO-2": (2, _Z["zero2"], 1),
    "ZeRO-3": (2, _Z["zero3"], 1),
    "ZeRO-2 + EP2": (2, (*_Z["zero2"], EXPERT_PARALLEL[2]), 1),
}
MIXTRAL = {"model_type": "mixtral", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4}
MIXTRAL |= {"num_attention_heads": 8, "num_key_value_heads": 4, "num_local_experts": 8, "num_experts_per_tok": 2}
MIXTRAL |= {"vocab_size": 4096, "max_position_embeddings": 1024}
TINY = {**MIXTRAL, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_local_experts": 4}
SIZES = {
    "cpu": dict(model=MIXTRAL, block=256, micro=2, steps=8, skip=2, rounds=2, profiled_steps=3),
    "quick": dict(model=TINY, block=64, micro=4, steps=3, skip=1, rounds=0, profiled_steps=3),
    # block 2048 needs positions for it: MIXTRAL's 1024 would be refused at plan time (block_size exceeds them)
    "gpu": dict(model={**MIXTRAL, "hidden_size": 2048, "intermediate_size": 1024, "num_hidden_layers": 16}
                | {"num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 32000}
                | {"max_position_embeddings": 4096},
                block=2048, micro=4, steps=40, skip=10, rounds=2, profiled_steps=0),
}  # fmt: skip


def parameters(model: dict) -> str:
    from transformers import AutoConfig

    from zero_recipes.modeling import moe
    from zero_recipes.modeling.model import count_params_meta

    config = AutoConfig.for_model(model["model_type"], **{k: v for k, v in model.items() if k != "model_type"})
    return moe.parameters_in_words(config, count_params_meta(config))


def gpu_commands(size: dict) -> list[str]:
    out = []
    for name in CONFIGS:
        cmd = launch(name, size, size["steps"], "bf16", Path(f"outputs/moe-{slug(name)}"), ["train.py"], CONFIGS)
        cmd[4] = "29500"  # the port of the day: any free one
        out.append(" ".join(f"'{c}'" if c.startswith("{") else c for c in cmd))
    return out


def markdown(r: dict) -> str:
    s = r["settings"]
    lines = [f"# A mixture of experts under ZeRO-2, ZeRO-3 and EP2, {r['date']}", "", f"Command: `{r['command']}`", ""]
    lines += [f"Model: {s['model']} ({r['parameters']}); {s['precision']}; block {s['block_size']}, micro-batch "
              f"{s['micro_batch']} on each of 2 ranks, each rank its own rows; {s['steps']} steps per run, the first "
              f"{s['skip']} left out of tokens/s; {s['rounds']} timed rounds in rotated order, ratios to ZeRO-2 taken "
              "within a round; per-rank peaks from one profiled run per configuration (torch.profiler's "
              "allocator events, the CPU's one memory pool).", ""]  # fmt: skip
    lines += results_table(r["configs"]) + [""]
    lines += [
        "What it means. On 2 CPU cores EP2 sends every token's hidden state to its experts' rank and back by "
        "all-to-all (gloo) in every MoE layer, forward and backward, and saves no compute (each rank runs the "
        "same expert FLOPs either way); its gain is memory: each rank holds half of every layer's experts and "
        "their optimizer states. ZeRO-3 gathers a layer's packed experts whole before it runs. On GPUs the "
        "all-to-all runs over NVLink and the expert matmuls are grouped GEMMs; this run does not measure that. "
        "The prepared GPU run (not run here):",
        "",
        *[f"    {c}" for c in r["gpu_commands"]],
        "",
    ]
    return "\n".join(lines + footer(r)) + "\n"


def cmd_moe(args) -> int:
    precision = "bf16" if args.gpu else "fp32"
    if args.gpu:
        import torch

        if torch.cuda.device_count() < 2:
            print("error: --gpu needs 2 CUDA GPUs (EP2); this machine has fewer", file=sys.stderr)
            return 2
    size = dict(SIZES["gpu" if args.gpu else "quick" if args.quick else "cpu"])
    if args.rounds is not None:
        size["rounds"] = args.rounds
    started = time.perf_counter()
    raw = measure(size, precision, Path(tempfile.mkdtemp(prefix="zr-bench-moe-")), CONFIGS)
    configs = summarise(raw, size["skip"], CONFIGS)
    settings = {"model": json.dumps(size["model"]), "precision": precision, "block_size": size["block"]}
    settings |= {"micro_batch": size["micro"], "steps": size["steps"], "skip": size["skip"], "rounds": size["rounds"]}
    settings |= {"wall_seconds": time.perf_counter() - started}
    result = new_report(settings=settings, configs=configs, parameters=parameters(size["model"]), raw=raw)
    result["gpu_commands"] = gpu_commands(SIZES["gpu"])
    write_report(args.out_dir, f"moe{'-gpu' if args.gpu else ''}-{result['date']}", result, markdown(result))
    for name, x in configs.items():
        print(
            f"{name}: {x['tokens_per_sec']['median']:,.0f} tokens/s, {x['vs_zero2']['median']:.3f}x ZeRO-2, "
            f"max |dloss| {x['max_abs_loss_delta_vs_zero2']:.2g}"
        )
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("moe", help="a mixture of experts under ZeRO-2, ZeRO-3 and EP2: tokens/s, per-rank peak, loss")
    p.add_argument("--quick", action="store_true", help="tiny Mixtral, 3 steps, profiled runs only (for tests)")
    p.add_argument("--gpu", action="store_true", help="the prepared GPU run: bf16, 2 GPUs")
    p.add_argument("--rounds", type=int, help="timed rounds (default 2; 0: the profiled runs only)")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks"), help="where moe-DATE.{md,json} go")
    p.set_defaults(func=cmd_moe)
