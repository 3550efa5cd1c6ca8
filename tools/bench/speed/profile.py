"""Where the step's time goes, train.py against the HF Trainer on the speed benchmark's work (bench/runners/phases.py).

    python tools/benchmark.py profile                 # 100M Llama, ZeRO-2, fp32, 2 ranks (about 6 minutes)
    python tools/benchmark.py profile --quick         # the embedded tiny Llama, 6 steps, no per-tensor AdamW (the test)

Three launches on the same rows, model, config and schedule as `benchmark.py train`: train.py with torch's
per-tensor AdamW (`--optim adamw_torch`, what train.py built on a CPU before 2026-12-03), train.py as shipped
(`adamw_torch_fused`) and the HF Trainer (its default, `adamw_torch_fused`). Each gives the mean seconds per
step of the engine's forward, backward and step, the collectives inside them, the optimizer's own step and
what lies outside the engine, over the steps after the first window.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from ..common import REPO, footer, free_port, new_report, run_checked, write_report
from .benchmark import QUICK, SIZES, flags

RUNNERS = {  # name: (module, extra flags)
    "train.py, adamw_torch": ("bench.runners.phases", ["--optim", "adamw_torch"]),
    "train.py": ("bench.runners.phases", []),
    "HF Trainer": ("bench.runners.hf_trainer_run", []),
}
# --quick: the per-tensor AdamW runner is the same module as train.py's with one flag, so the test's launch of it
# proved nothing the shipped runner's does not
QUICK_RUNNERS = [r for r in RUNNERS if r != "train.py, adamw_torch"]
COLUMNS = ("forward", "backward", "step", "collectives", "optimizer", "outside_engine", "step_wall")


def profile_one(runner: str, size, tmp: Path) -> dict:
    module, extra = RUNNERS[runner]
    window = size[4]
    tag = runner.replace(" ", "_").replace(",", "")
    out = tmp / f"{tag}.json"
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "--module", module]
    cmd += flags(size) + extra + ["--phases_out", str(out), "--window", str(window)]
    if module == "bench.runners.phases":
        cmd += ["--logging_steps", str(window), "--eval_steps", "0", "--save_steps", "0"]
        cmd += ["--output_dir", str(tmp / tag)]
    else:
        cmd += ["--timing_out", str(tmp / f"{tag}-timing.json")]
    run_checked(cmd, None, 3600, f"{runner}: {' '.join(cmd)}")
    return {**json.loads(out.read_text()), "op_table": out.with_suffix(".ops.txt").read_text()}


def markdown(r: dict) -> str:
    lines = [
        f"# Where the step's time goes, {r['date']}",
        "",
        f"Command: `{r['command']}`",
        "",
        "Mean seconds per optimizer step on rank 0 (torch.profiler, tools/bench/runners/phases.py); forward, backward "
        "and step are the DeepSpeed engine's calls, collectives and optimizer lie inside them.",
        "",
        "| runner | forward | backward | engine step | collectives | optimizer step | outside the engine | step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, x in r["runners"].items():
        lines.append(f"| {name} | " + " | ".join(f"{x[c]:.3f}" for c in COLUMNS) + " |")
    s = r["settings"]
    lines += [
        "",
        f"- {s['model']}: ds_configs/zero2.json, fp32, 2 ranks x 1 thread, micro-batch {s['micro_batch']} x "
        f"{s['block_size']} tokens, {s['steps']} steps, profiled after the first {s['window']}.",
        *footer(r),
    ]
    for name, x in r["runners"].items():
        lines += ["", f"Rank 0's ops, {name} (by total CPU time):", "", "```", x["op_table"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def cmd_profile(args) -> int:
    name = "tiny" if args.quick else "100M"
    size = (QUICK if args.quick else SIZES)[name]
    tmp = Path(tempfile.mkdtemp(prefix="zr-bench-profile-"))
    runners = {}
    for runner in QUICK_RUNNERS if args.quick else RUNNERS:
        runners[runner] = profile_one(runner, size, tmp)
        x = runners[runner]
        print(f"  {runner}: step {x['step_wall']:.3f} s, optimizer {x['optimizer']:.3f} s", flush=True)
    model, block, micro, steps, window = size
    settings = {"model": name, "block_size": block, "micro_batch": micro, "steps": steps, "window": window}
    result = new_report(settings=settings, runners=runners)
    write_report(args.out_dir, f"profile-{result['date']}", result, markdown(result))
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("profile", help="per-phase step time: train.py (per-tensor and fused AdamW) vs HF Trainer")
    p.add_argument("--quick", action="store_true", help="the embedded tiny Llama, 6 steps, 2 runners (for tests)")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks"), help="where profile-DATE.{md,json} go")
    p.set_defaults(func=cmd_profile)
