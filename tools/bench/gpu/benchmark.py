"""The GPU benchmark: one prepared script for a single NVIDIA H100/H200 that measures everything in one go.

    python tools/benchmark.py gpu                  # writes benchmarks/gpu-DATE.{md,json}; about 6.3 min on one H200
    python tools/benchmark.py gpu --quick --out-dir /tmp/bench   # the same code on the CPU, tiny shapes (the test)

Parts, most valuable first (each one's failure is recorded in the report and the next still runs;
bench/gpu/parts.py):
1. ZeRO-2: a Llama-3.2-1B-shaped model (random init, `--model_config`, no hub), bf16, sequence 2048: tokens/s,
   MFU against zero_recipes/training/flops.py's dense peak for the device, `max_memory_allocated` against
   tools/estimate_memory.py's estimate for the same launch; its export is the LoRA part's base;
2. TP2, SP2, PP2: one rank's compute at the split shapes (bench/gpu/shapes.py): two ranks cannot share a GPU;
3. LoRA r 16 on all-linear of the ZeRO-2 part's export, the same figures;
4. SFT: one round of sft/benchmark.py's train.py and TRL SFTTrainer runners on one GPU, label tokens/s and their ratio;
5. MoE: moe/benchmark.py's GPU Mixtral (1.1B parameters, 8 experts, 2 per token) under ZeRO-2 on one GPU, the same;
6. DPO 8B: train.py's DPO with the 8B DPO recipe (or the 8B LoRA recipe with --objective dpo) at the
   Llama-3.1-8B shape, random init, generated pairs, 6 steps: pairs/s, peak memory, the reference pass's seconds;
7. ZeRO-3: as 1, if the time budget still allows.
The plan, with each part's time estimate, is printed first. The report (md and json) is written before the
first part and again as each part ends, so a run killed at the device's command limit keeps every finished
part. No run saves a checkpoint (bench/runners/unsaved_train.py): nothing here reads one, and a 1B model's is ~17 GB.
The full run keeps to a budget (7.5 min from its start, --budget): a part whose estimate no longer fits is
skipped (and listed), and every launch stops at 3x its part's estimate or at the budget's end, so one hang cannot
eat a 15-minute device lease. Without CUDA, and without --quick, it refuses in one line.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

from ..common import REPO, new_report, write_report
from . import parts
from .report import markdown

# name: (what, seconds on one H200, seconds --quick on 2 CPU cores, the part), in the order they run: the most
# valuable first, so a budget cut or a kill loses the least (LoRA trains from ZeRO-2's export: after it). The H200
# seconds are estimates, not measurements (no GPU has run this yet): a launch's start-up as measured on the CPU
# (imports, DeepSpeed, data from cache: ~15 s), the 1B model's seeded init on the host (~10 s), its 20 steps at
# ~40 % MFU with the first step's warm-up (~10 s), the export (2.5 GB of bf16: ~10 s) and the estimate; no
# checkpoint. The first part also builds the tokenizer and the 2048-token blocks. The first GPU run's report
# gives the real ones (each part's `seconds`).
PARTS = {
    "ZeRO-2": ("the dense Llama, ZeRO-2", 60, 25, lambda s, tmp, t: parts.dense(s, "zero2", tmp, t)),
    "TP/SP/PP shapes": ("one rank's compute at TP2, SP2, PP2 shapes", 40, 15, parts.shapes),
    "LoRA": ("LoRA r 16 of ZeRO-2's export", 40, 25, parts.lora),
    "SFT vs TRL": ("sft/benchmark.py's train.py and TRL SFTTrainer runners, one round", 100, 60, parts.sft_vs_trl),
    "MoE": ("a Mixtral, 8 experts, 2 per token, ZeRO-2", 60, 25, parts.mixture),
    # its 16 GB base saved and loaded, the reference pass over 64 pairs, 4 steps: a guess, like the others
    "DPO 8B": ("train.py's DPO at the Llama-3.1-8B shape, its recipe, 4 steps", 100, 45, parts.dpo_8b),
    "ZeRO-3": ("the dense Llama, ZeRO-3 (if time allows)", 65, 25, lambda s, tmp, t: parts.dense(s, "zero3", tmp, t)),
}
BUDGET = 450  # seconds from the start, parts included: with OVERHEAD and the report, under 8 minutes
OVERHEAD = 15  # seconds outside the parts: the interpreter's start, the report's header and its writes
LIMIT = 480  # what the whole script must keep to on one H200 (the device allows 600 s a command)
TIMEOUT_FACTOR = 3
QUICK_TIMEOUT = 900
SKIPPED = [
    (
        "TP2, SP2 and PP2 across two GPUs",
        "NCCL refuses two ranks on one device: AutoTP's all-reduces, Ulysses' all-to-alls and the pipeline's "
        "sends and bubble are not measured; one rank's compute at the split shapes is (`benchmark.py parallel "
        "--gpu` needs 4 GPUs, `pipeline --gpu` 2)",
    ),
    ("expert parallelism (EP2)", "needs 2 ranks (`benchmark.py moe --gpu`, 2 GPUs); the MoE part runs every expert"),
    (
        "ZeRO-1 and ZeRO-3 + optimizer offload",
        "ZeRO-1 holds what ZeRO-2 holds on one rank; offload needs DeepSpeed's CPUAdam op, whose JIT build on a "
        "bare machine can take minutes of the lease",
    ),
    (
        "SFT against the HF Trainer and pretraining text; more SFT rounds",
        "time: one round of train.py and TRL, so the ratio's interval is over one round's windows",
    ),
]


def seconds_of(quick: bool) -> dict[str, int]:
    return {name: p[2] if quick else p[1] for name, p in PARTS.items()}


def plan_lines(s: dict, quick: bool, budget: int = BUDGET) -> list[str]:
    est = seconds_of(quick)
    where = "on 2 CPU cores (--quick: tiny shapes, fp32)" if quick else "on one H200"
    dense = "Llama-3.2-1B shape" if s["dense"] else "the embedded tiny Llama"
    lines = [
        f"plan: {len(PARTS)} parts, about {(sum(est.values()) + OVERHEAD) / 60:.1f} min {where}; the dense Llama: "
        f"{dense}, {s['precision']}, {s['micro']} x {s['block']} tokens a step, {s['steps']} steps"
    ]
    for i, (name, (what, *_)) in enumerate(PARTS.items(), 1):
        lines.append(f"  {i}. {name}: {what}, ~{est[name]} s")
    if not quick:
        lines.append(
            f"  budget {budget / 60:.1f} min from the start: a part whose estimate no longer fits is skipped; each "
            f"launch stops at {TIMEOUT_FACTOR}x its part's estimate or at the budget's end"
        )
    return lines


def run_part(name: str, s: dict, tmp: Path, timeout: int) -> dict:
    """One part: its figures with status "ok", or "failed" with the error (run_checked exits after printing the
    child's last output, which is kept here)."""
    started, err = time.monotonic(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            result = {"status": "ok", **PARTS[name][3](s, tmp, timeout)}
    except (Exception, SystemExit) as e:  # noqa: BLE001 -- a part's failure is a result; the next part runs
        text = err.getvalue() + ("" if isinstance(e, SystemExit) else traceback.format_exc())
        print(text[-3000:], file=sys.stderr)
        result = {"status": "failed", "error": text[-2000:].strip()}
    result["seconds"] = time.monotonic() - started
    return result


def run_parts(s: dict, quick: bool, tmp: Path, budget: int, started: float, record) -> tuple[dict, list]:
    """Every part in order within the budget (counted from `started`); `record(results, skipped)` after each
    one, so what has finished is on disk before the next begins."""
    est, results, skipped = seconds_of(quick), {}, []
    for name in PARTS:
        left = budget - (time.monotonic() - started)
        if not quick and left < est[name]:
            skipped.append((name, f"time budget: {left:.0f} s of {budget} s left, the part needs about {est[name]} s"))
            results[name] = {"status": "skipped", "reason": skipped[-1][1]}
            print(f"  {name}: skipped ({skipped[-1][1]})", flush=True)
        else:
            timeout = QUICK_TIMEOUT if quick else int(min(TIMEOUT_FACTOR * est[name], left))
            print(f"  {name} (timeout {timeout} s) ...", flush=True)
            results[name] = run_part(name, s, tmp, timeout)
            print(f"  {name}: {summary(results[name])}", flush=True)
        record(results, skipped)
    return results, skipped


def summary(r: dict) -> str:
    if r["status"] != "ok":
        return f"{r['status'].upper()} after {r['seconds']:.0f} s"
    if "pairs_per_sec" in r:
        return (
            f"{r['pairs_per_sec']:.2f} pairs/s, peak {r['peak_bytes'] / 2**30:.2f} GiB, reference pass "
            f"{r['reference_seconds']:.1f} s; {r['seconds']:.0f} s"
        )
    if "tokens_per_sec" in r:
        err = r["estimate_error"]
        return (
            f"{r['tokens_per_sec']:,.0f} tokens/s, MFU {r['mfu']:.1%}, peak {r['peak_bytes'] / 2**30:.2f} GiB, "
            f"estimate {r['estimate_bytes'] / 2**30:.2f} GiB ({err:+.1%}); {r['seconds']:.0f} s"
        )
    if "shapes" in r:
        return ", ".join(f"{n} {x['tokens_per_sec']:,.0f} tokens/s" for n, x in r["shapes"].items())
    if "vs_trl" in r:
        return f"train.py / TRL label tokens/s {r['vs_trl']['median']:.2f}; {r['seconds']:.0f} s"
    return f"ok; {r['seconds']:.0f} s"


def cmd_gpu(args) -> int:
    started = time.monotonic()
    import torch

    if not args.quick and not torch.cuda.is_available():
        print("error: no CUDA GPU here; this benchmark needs one (an H100/H200: 989 TFLOP/s bf16), or --quick", file=sys.stderr)  # fmt: skip
        return 2
    s = parts.QUICK if args.quick else parts.FULL
    print("\n".join(plan_lines(s, args.quick, args.budget)), flush=True)
    est = seconds_of(args.quick)
    report = new_report(
        settings={k: v for k, v in s.items() if k != "sft"} | {"quick": args.quick, "budget_seconds": args.budget},
        plan={"seconds": est, "total_seconds": sum(est.values()), "overhead_seconds": OVERHEAD},
    )
    name = f"gpu-{report['date']}"

    def record(results: dict, budget_skips: list) -> None:  # the report so far, md and json, each part as it ends
        report.update(
            parts=dict(results),
            pending=[n for n in PARTS if n not in results],
            skipped=[{"what": w, "why": y} for w, y in SKIPPED + budget_skips],
            wall_seconds=time.monotonic() - started,
        )
        write_report(args.out_dir, name, report, markdown(report), say=False)

    record({}, [])  # the plan and the machine, before anything can hang
    print(f"the report, rewritten as each part ends: {Path(args.out_dir).resolve() / name}.md and .json", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="zr-bench-gpu-"))
    try:
        results, _ = run_parts(s, args.quick, tmp, args.budget, started, record)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the ZeRO-2 export and the SFT data: gigabytes on the device
    failed = [n for n, r in results.items() if r["status"] == "failed"]
    print(f"done in {report['wall_seconds'] / 60:.1f} min" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def add_parsers(sub) -> None:
    g = sub.add_parser(
        "gpu", help="one H200: 1B ZeRO-2/3 MFU and memory, LoRA, MoE, TP/SP/PP shapes, SFT vs TRL (< 8 min)"
    )
    g.add_argument("--quick", action="store_true", help="the same parts on the CPU: tiny shapes, fp32 (for tests)")
    g.add_argument("--out-dir", default=str(REPO / "benchmarks"), help="where gpu-DATE.{md,json} go")
    g.add_argument(
        "--budget", type=int, default=BUDGET, help=f"seconds from the start the full run keeps to (default {BUDGET})"
    )
    g.set_defaults(func=cmd_gpu)
