"""The speed benchmark: train.py against the HF Trainer and a bare DeepSpeed loop on identical work.

Each run is its own process through the real `deepspeed` launcher with 2 ranks; the four runners alternate
in rotated rounds (A B C D, B C D A, ...) and every ratio is the median of window-paired ratios within a round
with a bootstrap interval (paired.py), so drift in machine load cancels. All three
take train.py's flags, build the same model (same config, same seeded init), the same rows in the same
per-rank order, the same torch AdamW and schedule and the same resolved DeepSpeed config; the baselines
start from tools/bench/runners/workload.py. Throughput is tokens/s over windows of steps, measured at the step
boundary; the first window (warm-up: allocation, first-touch, JIT) is left out.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

from .. import paired
from ..common import REPO, footer, free_port, new_report, run_checked, write_report, yes

HUNDRED_M = {
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "intermediate_size": 2048,
}
SIZES = {  # name: (model_config or None for the embedded tiny Llama, block, micro, steps, window)
    "tiny": (None, 256, 8, 30, 5),
    "100M": (HUNDRED_M, 256, 2, 15, 3),
}
QUICK = {"tiny": (None, 64, 4, 6, 2)}
RUNNERS = {
    "train.py": ["train.py"],
    "HF Trainer": ["--module", "bench.runners.hf_trainer_run"],  # after the launcher's flags
    "bare DeepSpeed loop": ["--module", "bench.speed.bare_loop"],
    "train.py --torch_compile": ["train.py"],
}
EXTRA = {"train.py --torch_compile": ["--torch_compile", "true"]}  # compile time falls in the warm-up window
# --quick proves the code path, not a speed: the compiled runner is train.py with one more flag (EXTRA), and with
# inductor's compile its quick launch took 29.6 s against train.py's 17.6 s (2-core EPYC). Its column then says
# "not run" (that branch runs instead); torch.compile itself is tested by test_train_configs.py.
QUICK_RUNNERS = [r for r in RUNNERS if r not in EXTRA]
GOALS = {"tiny": 1.2, "100M": 1.0, "floor": 0.97}
RATIOS = {  # report key: (runner, over runner)
    "vs_hf_trainer": ("train.py", "HF Trainer"),
    "vs_bare_loop": ("train.py", "bare DeepSpeed loop"),
    "compiled_vs_hf_trainer": ("train.py --torch_compile", "HF Trainer"),
}


def flags(size) -> list[str]:
    model, block, micro, steps, _window = size
    out = [
        "--deepspeed",
        "ds_configs/zero2.json",
        "--max_steps",
        str(steps),
        "--block_size",
        str(block),
        "--per_device_train_batch_size",
        str(micro),
        "--learning_rate",
        "3e-3",
        "--warmup_steps",
        "1",
    ]
    return out + (["--model_config", json.dumps(model)] if model else [])


def run_one(runner: str, size, tmp: Path, tag: str) -> list[float]:
    """Window seconds of one run, warm-up window included."""
    window = size[4]
    launch = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), *RUNNERS[runner]]
    out = tmp / f"{tag}-{runner.replace(' ', '_')}"
    if RUNNERS[runner] == ["train.py"]:
        cmd = (
            launch
            + flags(size)
            + EXTRA.get(runner, [])
            + ["--logging_steps", str(window), "--eval_steps", "0", "--save_steps", "0", "--output_dir", str(out)]
        )
        run_checked(cmd, None, 3600, f"{runner}: {' '.join(cmd)}")
        records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        tokens = size[2] * size[1] * 2 * window
        return [tokens / r["tokens_per_sec"] for r in records if "tokens_per_sec" in r]
    timing = tmp / f"{tag}-{runner.replace(' ', '_')}.json"
    cmd = launch + flags(size) + ["--timing_out", str(timing), "--window", str(window)]
    run_checked(cmd, None, 3600, f"{runner}: {' '.join(cmd)}")
    return json.loads(timing.read_text())["window_seconds"]


def measure(sizes: dict, rounds: int, runners: list[str]) -> dict:
    """Each size: the runners in rotated rounds; every timing ratio paired within rounds (paired.py)."""
    tmp = Path(tempfile.mkdtemp(prefix="zr-bench-speed-"))
    out = {}
    for name, size in sizes.items():
        _model, block, micro, steps, window = size
        tokens = micro * block * 2 * window
        measured = []  # per round: runner -> steady-state window rates
        for r, order in enumerate(paired.rotations(runners, rounds)):
            measured.append({})
            for runner in order:
                seconds = run_one(runner, size, tmp, f"{name}-{r}")
                measured[-1][runner] = [tokens / x for x in seconds[1:]]  # warm-up window left out
                print(
                    f"  {name} round {r + 1}/{rounds} {runner}: {statistics.median(measured[-1][runner]):,.0f} tokens/s"
                )
        rates = {runner: [x for m in measured for x in m[runner]] for runner in runners}
        out[name] = {
            "settings": {
                "model_config": size[0] or "embedded tiny Llama",
                "block_size": block,
                "micro_batch": micro,
                "steps": steps,
                "window_steps": window,
                "ranks": 2,
                "config": "ds_configs/zero2.json",
                "precision": "fp32",
                "rounds": rounds,
            },
            "tokens_per_sec": {
                r: {"median": statistics.median(v), "min": min(v), "max": max(v), "windows": len(v)}
                for r, v in rates.items()
            },
            "rounds": measured,
            **{key: paired.ratio(measured, a, b) for key, (a, b) in RATIOS.items() if {a, b} <= set(runners)},
            "goal_vs_hf_trainer": GOALS.get(name, 1.0),
            "goal_vs_bare_loop": GOALS["floor"],
        }
    return out


def markdown(r: dict) -> str:
    lines = [
        f"# Training speed, {r['date']}",
        "",
        f"Command: `{r['command']}`",
        "",
        "| model | runner | tokens/s (median) | min–max | windows |",
        "|---|---|---|---|---|",
    ]
    for name, m in r["models"].items():
        for runner, t in m["tokens_per_sec"].items():
            lines.append(
                f"| {name} | {runner} | {t['median']:,.0f} | {t['min']:,.0f}–{t['max']:,.0f} | {t['windows']} |"
            )
    lines += [
        "",
        "Ratios: median of the window-paired ratios (runner A's window i over runner B's window i of the same "
        "round), 95 % interval from a bootstrap over rounds and pairs (tools/bench/paired.py).",
        "",
        "| model | train.py / HF Trainer | goal | met? | with --torch_compile | goal | met? | "
        "train.py / bare loop | goal | met? | train.py / HF Trainer within ±3 %? |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in r["models"].items():
        goal, floor = m["goal_vs_hf_trainer"], m["goal_vs_bare_loop"]
        cells = [name]
        for key, bound in (("vs_hf_trainer", goal), ("compiled_vs_hf_trainer", goal), ("vs_bare_loop", floor)):
            x = m.get(key)
            cells += [ratio_text(m, key), f">= {bound:g}", yes(x["median"] >= bound)] if x else ["not run", "", ""]
        cells.append(yes(m["vs_hf_trainer"]["half_width"] <= 0.03))
        lines.append("| " + " | ".join(cells) + " |")
    for name, x in r["models"].items():
        s = x["settings"]
        lines.append("")
        lines.append(
            f"- {name}: {json.dumps(s['model_config']) if isinstance(s['model_config'], dict) else s['model_config']}; "
            f"{s['config']}, {s['precision']}, {s['ranks']} ranks x 1 thread, micro-batch {s['micro_batch']} x "
            f"{s['block_size']} tokens, {s['steps']} steps in windows of {s['window_steps']} (the first left out), "
            f"{s['rounds']} rotated rounds."
        )
    lines += ["", *footer(r)]
    return "\n".join(lines) + "\n"


def ratio_text(m: dict, key: str) -> str:
    """A ratio with the two runners' median rates beside it: a loaded host shows in the rates, not in the ratio."""
    a, b = RATIOS[key]
    rates = m["tokens_per_sec"]
    return f"{paired.text(m[key])}; {rates[a]['median']:,.0f} / {rates[b]['median']:,.0f} tokens/s"


def cmd_train(args) -> int:
    sizes = QUICK if args.quick else SIZES
    if args.model:
        sizes = {args.model: sizes[args.model]}
    if args.steps:  # more windows per launch: less of a noisy machine's time goes to start-up
        sizes = {name: (*size[:3], args.steps, size[4]) for name, size in sizes.items()}
    runners = args.runners or (QUICK_RUNNERS if args.quick else list(RUNNERS))
    result = new_report(models=measure(sizes, args.rounds or (1 if args.quick else 4), runners))
    write_report(args.out_dir, f"train-{result['date']}", result, markdown(result))
    for name, m in result["models"].items():
        print(f"{name}: " + ", ".join(f"{' / '.join(RATIOS[k])} = {ratio_text(m, k)}" for k in RATIOS if k in m))
    return 0


def cmd_mfu(args) -> int:
    """train.py's MFU against the measured matmul peak of the ranks' threads (train.py measures it at start,
    all ranks at once, so contention is in the peak), and where the step's time goes (torch.profiler op
    table of the bare loop's rank 0: the same model, engine and data)."""
    name = "tiny" if args.quick else args.model
    size = (QUICK if args.quick else SIZES)[name]
    tmp = Path(tempfile.mkdtemp(prefix="zr-bench-mfu-"))
    window = size[4]
    out = tmp / "train"
    cmd = (
        ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "train.py"]
        + flags(size)
        + ["--logging_steps", str(window), "--eval_steps", "0", "--save_steps", "0", "--output_dir", str(out)]
    )
    log = run_checked(cmd, None, 3600, f"train.py: {' '.join(cmd)}")
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if "mfu" in x]
    plan = next(line for line in log.splitlines() if line.startswith("plan:"))
    ops = tmp / "ops.txt"
    cmd = (
        ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), *RUNNERS["bare DeepSpeed loop"]]
        + flags(size)
        + ["--timing_out", str(tmp / "t.json"), "--window", str(window), "--profile_out", str(ops)]
    )
    run_checked(cmd, None, 3600, "bare loop with the profiler")
    mfus = [r["mfu"] for r in records[1:]]
    result = new_report(
        model=name, mfu_median=statistics.median(mfus), mfu_windows=mfus, plan=plan, op_table=ops.read_text()
    )
    write_report(
        args.out_dir,
        f"mfu-{result['date']}",
        result,
        "\n".join(
            [
                f"# CPU MFU, {result['date']}",
                "",
                f"Command: `{result['command']}`",
                "",
                f"- train.py, {name} model, 2 ranks: MFU {result['mfu_median']:.1%} (median of {len(mfus)} steady windows: "
                + ", ".join(f"{x:.1%}" for x in mfus)
                + ").",
                f"- train.py's plan line (model FLOPs per token: 6N plus the attention term; the peak it measured): `{plan}`",
                *footer(result),
                "",
                "Where rank 0's time goes (bare DeepSpeed loop, same work, steps after the first window; torch.profiler, "
                "self CPU time):",
                "",
                "```",
                result["op_table"].rstrip(),
                "```",
                "",
            ]
        ),
    )
    print(f"MFU {result['mfu_median']:.1%}")
    return 0


def add_parsers(sub) -> None:
    m = sub.add_parser("mfu", help="train.py's MFU against the measured CPU matmul peak, with a profiler op table")
    m.add_argument("--model", choices=sorted(SIZES), default="100M")
    m.add_argument("--quick", action="store_true", help="tiny model, 6 steps (for tests)")
    m.add_argument("--out-dir", default=str(REPO / "benchmarks"), help="where mfu-DATE.{md,json} go")
    m.set_defaults(func=cmd_mfu)
    t = sub.add_parser("train", help="tokens/s of train.py vs the HF Trainer vs a bare DeepSpeed loop")
    t.add_argument("--quick", action="store_true", help="tiny model, 6 steps, 1 round, no compiled runner (for tests)")
    t.add_argument("--rounds", type=int, help="rotated rounds of the four runners (default 4)")
    t.add_argument("--model", choices=sorted(SIZES), help="one model size only (default: both)")
    t.add_argument("--runners", nargs="+", choices=list(RUNNERS), help="a subset of the runners (default: all)")
    t.add_argument("--steps", type=int, help="optimizer steps per launch (default: the size's)")
    t.add_argument("--out-dir", default=str(REPO / "benchmarks"), help="where train-DATE.{md,json} go")
    t.set_defaults(func=cmd_train)
