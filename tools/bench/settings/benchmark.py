"""DeepSpeed settings that matter for speed, measured on train.py with a loss-parity check each.

`overlap_comm` and the bucket sizes are the knobs users are told to turn, and the ones tied to silent
gradient bugs (DeepSpeed #5545, #6351, #7718, #8224; OpenRLHF reverted overlap_comm). Each variant here is
one of the shipped configs plus one fragment, trained on identical work (same seed, data and steps) with
2 ranks; its per-step losses are compared with the shipped config's. A setting is worth shipping only if
it is faster *and* its losses match. The same runs measure the per-step cost of the preemption check
(StopRequest's all-reduce), timed on its own in the same world.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

from ..common import REPO, footer, free_port, new_report, run_checked, write_report, yes
from ..speed.benchmark import HUNDRED_M

# (name, shipped config, fragment on top). The first variant of each stage is the shipped baseline.
VARIANTS = [
    ("zero2.json (shipped: overlap_comm false, reduce_bucket_size 5e7)", "ds_configs/zero2.json", {}),
    ("zero2.json + overlap_comm true", "ds_configs/zero2.json", {"zero_optimization": {"overlap_comm": True}}),
    (
        "zero2.json + reduce_bucket_size auto (h^2, the HF Trainer's rule)",
        "ds_configs/zero2.json",
        {"zero_optimization": {"reduce_bucket_size": "auto"}},
    ),
    (
        "zero2.json + reduce_bucket_size 5e8",
        "ds_configs/zero2.json",
        {"zero_optimization": {"reduce_bucket_size": 500_000_000}},
    ),
    ("zero3.json (shipped: overlap_comm true)", "ds_configs/zero3.json", {}),
    ("zero3.json + overlap_comm false", "ds_configs/zero3.json", {"zero_optimization": {"overlap_comm": False}}),
]
PARITY_TOL = 1e-5  # fp32, same data and seed: only summation order may differ
# The tiny model shows per-collective overhead (little compute per step), the 100M model a realistic ratio.
FULL = {
    "tiny": dict(model=None, block=256, micro=8, steps=20, skip=5, reps=2),
    "100M": dict(model=HUNDRED_M, block=256, micro=2, steps=8, skip=2, reps=1),
}
QUICK = {"tiny": dict(model=None, block=64, micro=4, steps=4, skip=1, reps=1)}


def run_variant(base: str, fragment: dict, size: dict, out: Path) -> dict:
    frag = out.with_suffix(".json")
    frag.write_text(json.dumps(fragment))
    cmd = [
        "deepspeed",
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        "train.py",
        "--deepspeed",
        base,
        str(frag),
        "--max_steps",
        str(size["steps"]),
        "--block_size",
        str(size["block"]),
        "--per_device_train_batch_size",
        str(size["micro"]),
        "--learning_rate",
        "3e-3",
        "--warmup_steps",
        "1",
        "--logging_steps",
        "1",
        "--eval_steps",
        "0",
        "--save_steps",
        "0",
        "--max_eval_batches",
        "1",
        "--report_to",
        "none",
        "--output_dir",
        str(out),
    ]
    cmd += ["--model_config", json.dumps(size["model"])] if size["model"] else []
    run_checked(cmd, None, 3600, " ".join(cmd))
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    return {"losses": [r["loss"] for r in steps], "tokens_per_sec": [r["tokens_per_sec"] for r in steps]}


def stop_check_seconds(calls: int) -> float:
    """Median seconds of one StopRequest.agreed() across 2 ranks (tools/bench/settings/stop_probe.py)."""
    out = Path(tempfile.mkdtemp(prefix="zr-bench-stop-")) / "stop.json"
    run_checked(
        [
            "deepspeed",
            "--num_gpus",
            "2",
            "--master_port",
            str(free_port()),
            "--module",
            "bench.settings.stop_probe",
            str(out),
            str(calls),
        ],
        None,
        600,
        "stop_probe",
    )
    return json.loads(out.read_text())["median_seconds"]


def measure(size: dict, reps: int) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="zr-bench-settings-"))
    print(f"{size}", flush=True)
    runs: dict[str, list[dict]] = {name: [] for name, *_ in VARIANTS}
    for rep in range(reps):  # A/B/C/... repeated, so drift in machine load hits every variant alike
        for i, (name, base, fragment) in enumerate(VARIANTS):
            runs[name].append(run_variant(base, fragment, size, tmp / f"{rep}-{i}"))
            print(
                f"  rep {rep + 1}/{reps} {name}: {statistics.median(runs[name][-1]['tokens_per_sec'][size['skip'] :]):,.0f} "
                "tokens/s",
                flush=True,
            )
    return summarise(runs, size["skip"])


def summarise(runs: dict[str, list[dict]], skip: int) -> dict:
    """Per variant: median tokens/s over every run's steps after the first `skip`, its ratio to the shipped
    config it modifies, and the largest per-step loss difference from that config's first run."""
    out, baseline = {}, None
    for name, base, fragment in VARIANTS:
        if not fragment:
            baseline = name
        rates = [x for run in runs[name] for x in run["tokens_per_sec"][skip:]]
        ref = runs[baseline][0]["losses"]
        delta = max(abs(a - b) for run in runs[name] for a, b in zip(run["losses"], ref))
        med = statistics.median(rates)
        base_med = out[baseline]["tokens_per_sec"] if baseline != name else med
        out[name] = {
            "config": base,
            "fragment": fragment,
            "tokens_per_sec": med,
            "min": min(rates),
            "max": max(rates),
            "windows": len(rates),
            "vs_shipped": med / base_med,
            "max_abs_loss_delta": delta,
            "loss_parity": delta <= PARITY_TOL,
            "losses": runs[name][0]["losses"],
        }
    return out


def markdown(r: dict) -> str:
    lines = [f"# DeepSpeed settings: speed and loss parity, {r['date']}", "", f"Command: `{r['command']}`", ""]
    for name, m in r["models"].items():
        s = m["settings"]
        lines += [
            f"## {name}: {json.dumps(s['model']) if s['model'] else 'the embedded tiny Llama'}",
            "",
            f"fp32; 2 ranks x 1 thread; micro-batch {s['micro']} x {s['block']} tokens; {s['steps']} steps, the "
            f"first {s['skip']} left out of the speed figures; {s['reps']} repetition(s) in A/B/C order.",
            "",
            "| variant | tokens/s (median) | min–max | vs shipped | max abs Δloss vs shipped | loss parity "
            f"(≤ {PARITY_TOL:g}) |",
            "|---|---|---|---|---|---|",
        ]
        for variant, v in m["variants"].items():
            lines.append(
                f"| {variant} | {v['tokens_per_sec']:,.0f} | {v['min']:,.0f}–{v['max']:,.0f} | "
                f"{v['vs_shipped']:.3f} | {v['max_abs_loss_delta']:.2g} | {yes(v['loss_parity'])} |"
            )
        lines += [
            "",
            f"Preemption check (StopRequest's all-reduce, every step): {r['stop_check_seconds'] * 1e6:,.0f} µs "
            f"per call, {r['stop_check_seconds'] / m['step_seconds']:.3%} of the shipped ZeRO-2 step "
            f"({m['step_seconds']:.3f} s).",
            "",
        ]
    lines += footer(r)
    return "\n".join(lines) + "\n"


def cmd_settings(args) -> int:
    sizes = QUICK if args.quick else FULL
    models = {}
    for name, size in sizes.items():
        variants = measure(size, args.reps or size["reps"])
        step = 2 * size["micro"] * size["block"] / variants[VARIANTS[0][0]]["tokens_per_sec"]
        models[name] = {"settings": size, "variants": variants, "step_seconds": step}
    result = new_report(models=models, stop_check_seconds=stop_check_seconds(50 if args.quick else 500))
    write_report(args.out_dir, f"settings-{result['date']}", result, markdown(result))
    for name, m in models.items():
        for variant, v in m["variants"].items():
            print(f"{name} {variant}: {v['vs_shipped']:.3f}x shipped, max |dloss| {v['max_abs_loss_delta']:.2g}")
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser(
        "settings", help="overlap_comm and bucket sizes: tokens/s and loss parity vs the shipped configs"
    )
    p.add_argument("--quick", action="store_true", help="tiny model, 4 steps, 1 repetition (for tests)")
    p.add_argument("--reps", type=int, help="repetitions of the variant cycle (default: 2 tiny, 1 100M)")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks"), help="where settings-DATE.{md,json} go")
    p.set_defaults(func=cmd_settings)
