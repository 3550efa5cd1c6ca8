"""The GPU benchmark: one prepared script for a single NVIDIA H100/H200, under 8 minutes.

    python tools/benchmark.py gpu                  # writes benchmarks/gpu-DATE.{md,json}

A ~1.2B Llama (Llama-3.2-1B's shape), random init, bf16, sequence 2048, trained by train.py for 30 steps on
one GPU under zero1, zero2, zero3 and zero3 + optimizer offload. For each: steady tokens/s (the first
window left out), MFU against the dense bf16 peak in zero_recipes/metrics.py (989 TFLOP/s for H100/H200),
`torch.cuda.max_memory_allocated` from train.py's metrics, and tools/estimate_memory.py's prediction for
the same launch with the error. Data is the embedded corpus (it needs no network).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

from zero_recipes.shipped import PRECISIONS, select

from .common import REPO, footer, free_port, new_report, run_checked, write_report

LLAMA_1B = {
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": True,
    "max_position_embeddings": 4096,
    "rope_theta": 500000.0,
}
CONFIGS = select("zero1", "zero2", "zero3", "zero3+offload_optimizer")
BF16 = PRECISIONS["bf16"]
SEQ, MICRO, STEPS, WINDOW = 2048, 4, 30, 5


def run(name: str, files: tuple[str, ...], tmp: Path) -> dict:
    out = tmp / name
    cmd = [
        "deepspeed",
        "--num_gpus",
        "1",
        "--master_port",
        str(free_port()),
        "train.py",
        "--deepspeed",
        *files,
        *BF16,
        "--model_config",
        json.dumps(LLAMA_1B),
        "--block_size",
        str(SEQ),
        "--per_device_train_batch_size",
        str(MICRO),
        "--max_steps",
        str(STEPS),
        "--logging_steps",
        str(WINDOW),
        "--eval_steps",
        "0",
        "--save_steps",
        "0",
        "--learning_rate",
        "3e-4",
        "--warmup_steps",
        "2",
        "--output_dir",
        str(out),
    ]
    run_checked(cmd, None, 600, f"train.py {name}")
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in records if "tokens_per_sec" in r][1:]
    return {
        "tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in steady),
        "mfu": statistics.median(r["mfu"] for r in steady),
        "max_memory_allocated": max(r.get("mem_peak_gb", 0) for r in records) * 2**30,
        "final_loss": steady[-1]["loss"] if steady else None,
    }


def predicted(files: tuple[str, ...]) -> int:
    from transformers import AutoConfig

    from zero_recipes import ds_config
    from zero_recipes.cli import parse_args
    from zero_recipes.memory import Launch, estimate

    fields = dict(LLAMA_1B)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    cfg, explicit = parse_args(
        ["--deepspeed", *files, *BF16, "--block_size", str(SEQ), "--per_device_train_batch_size", str(MICRO)]
    )
    resolved = ds_config.resolve(ds_config.load_fragments(cfg.deepspeed), cfg, explicit, 1, config.hidden_size)
    ds = ds_config.with_steps(resolved.ds, resolved.cfg, STEPS)
    return estimate(config, ds, Launch(1, 1, MICRO, SEQ)).per_gpu["peak_bytes"]


def markdown(r: dict) -> str:
    lines = [
        f"# GPU benchmark, {r['date']}",
        "",
        f"Command: `{r['command']}`",
        "",
        "| config | tokens/s | MFU | max_memory_allocated GiB | estimate GiB | estimate error |",
        "|---|---|---|---|---|---|",
    ]
    for name, x in r["runs"].items():
        err = x["predicted_bytes"] / x["max_memory_allocated"] - 1 if x["max_memory_allocated"] else float("nan")
        lines.append(
            f"| {name} | {x['tokens_per_sec']:,.0f} | {x['mfu']:.1%} | {x['max_memory_allocated'] / 2**30:.2f} | "
            f"{x['predicted_bytes'] / 2**30:.2f} | {err:+.1%} |"
        )
    lines += [
        "",
        f"- Model: {json.dumps(LLAMA_1B)}; bf16, sequence {SEQ}, micro-batch {MICRO}, {STEPS} steps, "
        f"windows of {WINDOW} (the first left out). Goal: >= 50 % MFU with ZeRO-2.",
        *footer(r),
    ]
    return "\n".join(lines) + "\n"


def cmd_gpu(args) -> int:
    import torch

    if not torch.cuda.is_available():
        print(
            "error: no CUDA GPU here; this benchmark needs one (an H100/H200 for the 989 TFLOP/s peak)", file=sys.stderr
        )
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="zr-bench-gpu-"))
    runs = {}
    for name, files in CONFIGS.items():
        runs[name] = run(name, files, tmp)
        runs[name]["predicted_bytes"] = predicted(files)
        print(
            f"  {name}: {runs[name]['tokens_per_sec']:,.0f} tokens/s, MFU {runs[name]['mfu']:.1%}, "
            f"max allocated {runs[name]['max_memory_allocated'] / 2**30:.2f} GiB",
            flush=True,
        )
    result = new_report(runs=runs)
    write_report(args.out_dir, f"gpu-{result['date']}", result, markdown(result))
    return 0


def add_parsers(sub) -> None:
    g = sub.add_parser("gpu", help="1.2B Llama on one H100/H200: tokens/s, MFU, memory vs the estimate (< 8 min)")
    g.add_argument("--out-dir", default=str(REPO / "benchmarks"), help="where gpu-DATE.{md,json} go")
    g.set_defaults(func=cmd_gpu)
