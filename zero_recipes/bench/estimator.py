"""The estimator benchmark: tools/estimate_memory.py's prediction against real DeepSpeed runs on the CPU.

Each point launches zero_recipes/bench/memory_probe.py through the real launcher (1, 2 or 4 CPU ranks), which
records every allocation of the CPU allocator during init, forward/backward and the optimizer step. On
the CPU accelerator device and host are one pool, so the comparison is measured peak vs the estimate's
device + host bytes of one rank, at the phase where the measurement peaked, for the most loaded rank.
The estimate runs with `accelerator="cpu"`: a CPU steps with torch's single-tensor AdamW.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from zero_recipes.shipped import PRECISIONS, select

from .common import REPO, footer, free_port, new_report, run_checked, write_report

MODELS = {  # Llama shapes with GQA and SwiGLU; "B" is ~34M parameters, "A" ~7M (held out)
    "B": {
        "hidden_size": 512,
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "intermediate_size": 1376,
        "vocab_size": 16000,
    },
    "A": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 688,
        "vocab_size": 8000,
    },
}
CONFIGS = select("zero0", "zero1", "zero2", "zero3", "zero2+offload_optimizer", "zero3+offload_all")
# (model, config, precision, ranks, micro-batch, seq len, gradient checkpointing)
POINTS = [
    ("B", c, prec, n, 1, 16, False)
    for c in ("zero0", "zero1", "zero2", "zero3")
    for prec, n in (("fp32", 1), ("bf16", 2))
]
POINTS += [("B", c, "bf16", n, 1, 16, False) for c in ("zero2+offload_optimizer", "zero3+offload_all") for n in (1, 2)]
POINTS += [("B", c, "bf16", 4, 1, 16, False) for c in ("zero2", "zero3")]
POINTS += [
    ("B", c, prec, n, 2, 512, gc)
    for c in ("zero2", "zero3")
    for prec, n, gc in (("bf16", 1, False), ("bf16", 1, True), ("fp32", 2, False))
]
POINTS += [("A", c, "bf16", 2, 4, 256, gc) for c in ("zero1", "zero3") for gc in (False, True)]
QUICK = [("A", "zero2", "bf16", 2, 2, 128, False), ("A", "zero3", "fp32", 1, 2, 128, True)]
TARGET = {"over": 0.10, "under": 0.05}


def probe(point, tmp: Path) -> dict:
    model, config, precision, ranks, micro, seq, gc = point
    files = [*CONFIGS[config], *PRECISIONS[precision]]
    out = tmp / f"probe-{abs(hash(point))}.json"
    launcher = (
        [sys.executable, "-m"]
        if ranks == 1
        else ["deepspeed", "--num_gpus", str(ranks), "--master_port", str(free_port()), "--module"]
    )
    cmd = (
        launcher
        + [
            "zero_recipes.bench.memory_probe",
            "--deepspeed",
            *files,
            "--model_config",
            json.dumps(MODELS[model]),
            "--per_device_train_batch_size",
            str(micro),
            "--block_size",
            str(seq),
            "--probe_out",
            str(out),
        ]
        + (["--gradient_checkpointing", "true"] if gc else [])
    )
    run_checked(cmd, None, 900, f"memory probe {point}")
    return json.loads(out.read_text())


def predict(point, measured: dict) -> dict:
    from transformers import AutoConfig

    from zero_recipes.memory import Launch, estimate, rank_total

    model, _config, _precision, ranks, micro, seq, gc = point
    config = AutoConfig.for_model("llama", **MODELS[model])
    e = estimate(config, measured["ds_config"], Launch(ranks, 1, micro, seq, gc, "sdpa", accelerator="cpu"))
    rank = max(measured["ranks"], key=lambda r: max(r["peak"].values()))
    phase = max(rank["peak"], key=rank["peak"].get)
    got, want = rank_total(e, phase), rank["peak"][phase]
    return {
        "measured_bytes": want,
        "predicted_bytes": got,
        "phase": phase,
        "error": got / want - 1,
        "num_params": rank["num_params"],
        "activations_bytes": e.phases["forward_backward"]["activations_bytes"],
        "phase_errors": {ph: rank_total(e, ph) / rank["peak"][ph] - 1 for ph in rank["peak"]},
    }


def markdown(r: dict) -> str:
    mb = lambda b: f"{b / 1e6:,.1f}"  # noqa: E731
    lines = [
        f"# Memory estimate vs measured, {r['date']}",
        "",
        f"Command: `{r['command']}`",
        "",
        "Measured: peak live bytes of the CPU allocator on the most loaded rank (torch profiler, "
        "`zero_recipes/bench/memory_probe.py`), real DeepSpeed on the CPU accelerator. Predicted: "
        "`zero_recipes.memory.estimate` for that phase, device + host of one rank (one pool on a CPU). "
        f"Target: within +{TARGET['over']:.0%} / -{TARGET['under']:.0%}.",
        "",
        "| model | config | precision | ranks | micro x seq | GC | peak phase | measured MB | predicted MB | "
        "error | in target? |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in r["points"]:
        ok = -TARGET["under"] <= p["error"] <= TARGET["over"]
        lines.append(
            f"| {p['model']} ({p['num_params'] / 1e6:.1f}M) | {p['config']} | {p['precision']} | {p['ranks']} | "
            f"{p['micro']} x {p['seq']} | {'on' if p['gc'] else 'off'} | {p['phase']} | {mb(p['measured_bytes'])} | "
            f"{mb(p['predicted_bytes'])} | {p['error']:+.1%} | {'yes' if ok else '**no**'} |"
        )
    errs = [p["error"] for p in r["points"]]
    inside = sum(-TARGET["under"] <= e <= TARGET["over"] for e in errs)
    lines += [
        "",
        f"- {inside} of {len(errs)} points in target; worst over {max(errs):+.1%}, worst under {min(errs):+.1%}.",
        "- Misses: "
        + (
            "; ".join(
                f"{p['config']} {p['precision']} on {p['ranks']} rank(s), {p['error']:+.1%}"
                for p in r["points"]
                if not -TARGET["under"] <= p["error"] <= TARGET["over"]
            )
            or "none"
        )
        + ". ZeRO-3 on several ranks is the least repeatable: with overlap_comm its "
        "gathers and releases run asynchronously, and the same run's peak moved by up to ~15 % between "
        "repetitions (measured), on the most loaded rank, which also differs from rank 0 by up to ~1.5 B/param.",
        "- Models: Llama with GQA and SwiGLU; B " + json.dumps(MODELS["B"]) + "; A (held out: the "
        "estimate's measured constants came from B) " + json.dumps(MODELS["A"]) + ".",
        *footer(r),
    ]
    return "\n".join(lines) + "\n"


def cmd_estimator(args) -> int:
    points = QUICK if args.quick else POINTS
    tmp = Path(tempfile.mkdtemp(prefix="zr-bench-estimator-"))
    rows = []
    for i, point in enumerate(points):
        measured = probe(point, tmp)
        row = dict(zip(("model", "config", "precision", "ranks", "micro", "seq", "gc"), point))
        row.update(predict(point, measured))
        rows.append(row)
        print(
            f"  [{i + 1}/{len(points)}] {point}: measured {row['measured_bytes'] / 1e6:.1f} MB, predicted "
            f"{row['predicted_bytes'] / 1e6:.1f} MB ({row['error']:+.1%}) at {row['phase']}",
            flush=True,
        )
    result = new_report(points=rows)
    write_report(args.out_dir, "estimator" if not args.quick else "estimator-quick", result, markdown(result))
    return 0


def add_parsers(sub) -> None:
    e = sub.add_parser("estimator", help="memory estimate vs real DeepSpeed runs on the CPU (benchmarks/estimator.md)")
    e.add_argument("--quick", action="store_true", help="2 points on the small model (for tests)")
    e.add_argument("--out-dir", default=str(REPO / "benchmarks"), help="where estimator.{md,json} go")
    e.set_defaults(func=cmd_estimator)
