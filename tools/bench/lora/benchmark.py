"""LoRA against full fine-tuning of the same pretrained base: tokens/s, per-rank peak memory, checkpoint size
on disk and time to save, each as a LoRA / full ratio.

Every run is train.py through the real `deepspeed` launcher with 2 ranks, on the model, data, batch and
DeepSpeed config of the `train` benchmark's 100M size (tools/bench/speed/benchmark.py), fine-tuning the same base:
train.py's seeded init of that model, saved as an HF directory (make_base). The variants differ only
in `--lora_r 16 --lora_target_modules all-linear`. Per precision:

- timed rounds, runners alternating (full, LoRA, then LoRA, full, ...) so drift in machine load hits both:
  tokens/s per logging window from metrics.jsonl (the first window, warm-up, left out); the one checkpoint,
  saved after the last window so its disk writes touch no timed window: its size (all files under
  checkpoints/step-N) and its save time from the files' own timestamps (first rng_state_<rank>.pt written,
  the save's first file, to the last file written);
- one profiled run per variant (tools/bench/runners/profiled_train.py: train.py's main under torch.profiler's
  allocator events): the per-rank peak of live torch bytes, overall, in the optimizer steps and in the save,
  and the save's time measured around Checkpointer.save (a cross-check of the timestamps).
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from ..common import REPO, embedded_tokenizer_dir, footer, free_port, new_report, run_checked, spread, write_report
from ..speed.benchmark import QUICK as SPEED_QUICK, SIZES as SPEED_SIZES, flags as speed_flags

VARIANTS = {"full": [], "lora": ["--lora_r", "16", "--lora_target_modules", "all-linear"]}
PRECISION_FRAGMENTS = {"fp32": [], "bf16": ["ds_configs/bf16.json"]}  # added after ds_configs/zero2.json
SIZES = {"100M": SPEED_SIZES["100M"], "tiny": SPEED_QUICK["tiny"]}  # (model_config, block, micro, steps, window)
QUICK_SIZE = (None, 64, 4, 6, 2)  # the test's smoke run: the embedded tiny Llama, 2 steady windows


def launcher() -> list[str]:
    return ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port())]


def run_flags(size, precision: str, base: Path, variant: str) -> list[str]:
    """speed/benchmark.py's flags for the size without its model config (the base brings the model), plus the precision
    fragment, the base and the variant; one logging window per `window` steps, the only save at the end."""
    _model, *rest = size
    out = speed_flags((None, *rest))
    at = out.index("ds_configs/zero2.json") + 1
    out[at:at] = PRECISION_FRAGMENTS[precision]
    window = str(size[4])
    return out + [
        "--model_name_or_path",
        str(base),
        "--logging_steps",
        window,
        "--eval_steps",
        "0",
        "--max_eval_batches",
        "1",
        "--save_steps",
        "0",
        "--report_to",
        "none",
        *VARIANTS[variant],
    ]


def make_base(size, tmp: Path) -> Path:
    """The pretrained base: train.py's seeded init of the size's model (zero_recipes.modeling.model.build_model,
    bench/dpo/data.base_model), saved as an HF model directory with the embedded tokenizer. Made in this process:
    a train.py launch for it (one step, then its export) cost a 2-rank start-up, about 15 s on 2 cores, for the
    same shapes."""
    from zero_recipes import data
    from zero_recipes.config.train_config import TrainConfig

    from ..dpo.data import base_model

    tok = data.load_tokenizer(TrainConfig(tokenizer_name_or_path=str(embedded_tokenizer_dir())))
    return base_model(tmp / "base", tok, size[0] or {})


def checkpoint_files(step_dir: Path) -> dict:
    """Bytes on disk (apparent sizes) of one checkpoint, by kind, and its save time from file timestamps."""
    files = [p for p in step_dir.rglob("*") if p.is_file()]
    kinds = {"model_states": 0, "optim_states": 0, "other": 0}
    for p in files:
        kind = next((k for k in ("model_states", "optim_states") if k in p.name), "other")
        kinds[kind] += p.stat().st_size
    first = min(p.stat().st_mtime_ns for p in files if p.name.startswith("rng_state_"))
    last = max(p.stat().st_mtime_ns for p in files)
    return {"bytes": sum(kinds.values()), "by_kind": kinds, "save_seconds": (last - first) / 1e9}


def read_run(out: Path, log: str) -> dict:
    """What a finished run left: its tokens/s windows, rank 0's RSS, its one checkpoint; then the run's
    directory is removed (a full fp32 checkpoint of the 100M model is ~1.6 GB)."""
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    [step_dir] = [p for p in (out / "checkpoints").glob("step-*") if p.is_dir()]
    result = {
        "tokens_per_sec_windows": [r["tokens_per_sec"] for r in records if "tokens_per_sec" in r],
        "cpu_rss_gb_rank0": max(r.get("cpu_rss_gb", 0) for r in records),
        "checkpoint": checkpoint_files(step_dir),
        "lora_line": next((x for x in log.splitlines() if x.startswith("lora:")), None),
    }
    shutil.rmtree(out)
    return result


def timed_run(size, precision: str, base: Path, variant: str, out: Path) -> dict:
    cmd = launcher() + ["train.py"] + run_flags(size, precision, base, variant) + ["--output_dir", str(out)]
    return read_run(out, run_checked(cmd, None, 3600, f"{variant} {precision}: {' '.join(cmd)}"))


def profiled_run(size, precision: str, base: Path, variant: str, out: Path) -> dict:
    """The same run under the allocator profiler: its per-rank peaks and save times, and what read_run reads
    (used for tokens/s only when there are no timed rounds: the profiler slows the steps)."""
    probe = out.with_name(out.name + "-probe")
    cmd = (
        launcher()
        + ["--module", "bench.runners.profiled_train"]
        + run_flags(size, precision, base, variant)
        + ["--output_dir", str(out), "--probe_out", str(probe)]
    )
    log = run_checked(cmd, None, 3600, f"{variant} {precision} (profiled): {' '.join(cmd)}")
    ranks = [json.loads(Path(f"{probe}.rank{r}.json").read_text()) for r in range(2)]
    return {**read_run(out, log), "ranks": ranks}


def measure(size, precisions: list[str], rounds: int, tmp: Path) -> dict:
    base = make_base(size, tmp)
    raw = {}
    for precision in precisions:
        runs = {v: {"timed": [], "profiled": None} for v in VARIANTS}
        for rnd in range(rounds):
            order = list(VARIANTS) if rnd % 2 == 0 else list(VARIANTS)[::-1]  # ABBA: linear drift cancels
            for variant in order:
                r = timed_run(size, precision, base, variant, tmp / f"{precision}-{variant}-{rnd}")
                runs[variant]["timed"].append(r)
                print(
                    f"  {precision} round {rnd + 1}/{rounds} {variant}: "
                    f"{statistics.median(r['tokens_per_sec_windows'][1:]):,.0f} tokens/s, checkpoint "
                    f"{r['checkpoint']['bytes'] / 2**20:,.1f} MiB saved in {r['checkpoint']['save_seconds']:.2f} s",
                    flush=True,
                )
        for variant in VARIANTS:
            runs[variant]["profiled"] = profiled_run(size, precision, base, variant, tmp / f"{precision}-{variant}-p")
            peaks = [r["peak_bytes"] / 2**20 for r in runs[variant]["profiled"]["ranks"]]
            print(f"  {precision} {variant} profiled: peak {', '.join(f'{p:,.0f}' for p in peaks)} MiB", flush=True)
        raw[precision] = runs
    return raw


def ratio(lora: dict, full: dict) -> dict:
    """LoRA / full of two spreads: the ratio of the medians, and the widest ratio the samples allow
    (lowest LoRA over highest full, highest LoRA over lowest full)."""
    return {
        "median": lora["median"] / full["median"],
        "min": lora["min"] / full["max"],
        "max": lora["max"] / full["min"],
    }


def summarise_variant(runs: dict) -> dict:
    """One variant's figures from its raw runs. tokens/s: every timed run's windows after the first;
    checkpoint bytes and save seconds: one per timed run; peaks: one per rank of the profiled run. With no
    timed rounds (--rounds 0, the smoke test) the profiled run stands in for them."""
    timed, ranks = runs["timed"] or [runs["profiled"]], runs["profiled"]["ranks"]
    return {
        "tokens_per_sec": spread([w for r in timed for w in r["tokens_per_sec_windows"][1:]]),
        "checkpoint_bytes": spread([r["checkpoint"]["bytes"] for r in timed]),
        "checkpoint_by_kind": timed[0]["checkpoint"]["by_kind"],
        "save_seconds": spread([r["checkpoint"]["save_seconds"] for r in timed]),
        "save_seconds_profiled": spread([s for r in ranks[:1] for s in r["save_seconds"]]),
        # the same save read from its files' timestamps: how far the timed rounds' method is from the wrapper's
        "save_seconds_profiled_timestamps": spread([runs["profiled"]["checkpoint"]["save_seconds"]]),
        "peak_bytes": spread([r["peak_bytes"] for r in ranks]),
        "train_step_peak_bytes": spread([r["phase_peak_bytes"]["train_step"] for r in ranks]),
        "save_peak_bytes": spread([r["phase_peak_bytes"]["save"] for r in ranks]),
        "cpu_rss_gb_rank0": spread([r["cpu_rss_gb_rank0"] for r in timed]),
    }


def summarise(raw: dict) -> dict:
    """Per precision: each variant's figures and the LoRA / full ratio of each."""
    out = {}
    for precision, runs in raw.items():
        v = {name: summarise_variant(r) for name, r in runs.items()}
        out[precision] = {
            "variants": v,
            "ratios": {k: ratio(v["lora"][k], v["full"][k]) for k in v["full"] if k != "checkpoint_by_kind"},
        }
    return out


def mib(b: float) -> str:
    return f"{b / 2**20:,.1f}"


def precision_section(precision: str, p: dict) -> list[str]:
    v, q = p["variants"], p["ratios"]
    lines = [
        f"## {precision}",
        "",
        "| figure | full: median | min–max | n | LoRA: median | min–max | n | LoRA / full | range |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    figures = [
        ("tokens/s (steady windows)", "tokens_per_sec", lambda x: f"{x:,.0f}"),
        ("peak live torch bytes per rank, MiB (whole run)", "peak_bytes", mib),
        ("peak per rank within the optimizer steps, MiB", "train_step_peak_bytes", mib),
        ("peak per rank within the checkpoint save, MiB", "save_peak_bytes", mib),
        ("checkpoint on disk, MiB", "checkpoint_bytes", mib),
        ("time to save, s (file timestamps)", "save_seconds", lambda x: f"{x:.2f}"),
        ("time to save, s (around Checkpointer.save, profiled run)", "save_seconds_profiled", lambda x: f"{x:.2f}"),
        ("rank 0 RSS at the last log, GiB (psutil)", "cpu_rss_gb_rank0", lambda x: f"{x:.2f}"),
    ]
    for label, key, fmt in figures:
        f, lo = v["full"][key], v["lora"][key]
        r = q[key]
        lines.append(
            f"| {label} | {fmt(f['median'])} | {fmt(f['min'])}–{fmt(f['max'])} | {f['n']} | "
            f"{fmt(lo['median'])} | {fmt(lo['min'])}–{fmt(lo['max'])} | {lo['n']} | "
            f"{r['median']:.4f} | {r['min']:.4f}–{r['max']:.4f} |"
        )
    kinds = ", ".join(
        f"{name}: " + ", ".join(f"{k} {mib(b)} MiB" for k, b in v[name]["checkpoint_by_kind"].items())
        for name in ("full", "lora")
    )
    check = "; ".join(
        f"{name} {v[name]['save_seconds_profiled_timestamps']['median']:.2f} s from the files' timestamps, "
        f"{v[name]['save_seconds_profiled']['median']:.2f} s around Checkpointer.save"
        for name in ("full", "lora")
    )
    lines += ["", f"Checkpoint contents: {kinds}.", "", f"The profiled runs' save, both ways: {check}."]
    return lines


def markdown(r: dict) -> str:
    s, q = r["settings"], {p: x["ratios"] for p, x in r["results"].items()}
    head = "; ".join(
        f"{p}: tokens/s {x['tokens_per_sec']['median']:.2f}×, peak memory {x['peak_bytes']['median']:.2f}×, "
        f"checkpoint {x['checkpoint_bytes']['median']:.4f}×, save time {x['save_seconds']['median']:.3f}×"
        for p, x in q.items()
    )
    lines = [
        f"# LoRA vs full fine-tuning, {r['date']}",
        "",
        f"Command: `{r['command']}`",
        "",
        f"LoRA / full ({s['lora']}): {head}.",
        "",
    ]
    for precision, p in r["results"].items():
        lines += precision_section(precision, p) + [""]
    lines += [
        "## Method",
        "",
        f"- Model: {s['model']}; {s['ranks']} ranks x 1 thread, ds_configs/zero2.json (+ the precision's fragment), "
        f"micro-batch {s['micro_batch']} x {s['block_size']} tokens (global batch {s['global_batch']} sequences), "
        f"{s['steps']} steps logged in windows of {s['window_steps']}; the embedded corpus; the same flags for both "
        "variants but the LoRA ones. The base: train.py's seeded init of the model, saved as an HF directory.",
        f"- LoRA, as train.py logs it: `{s['lora_line']}`.",
        (
            f"- {s['rounds']} timed round(s) per precision, alternating the order (full, LoRA / LoRA, full)."
            if s["rounds"]
            else "- No timed rounds: tokens/s, checkpoint and save time come from the profiled runs (the profiler "
            "slows the steps; a smoke run, not a measurement)."
        )
        + " tokens/s: train.py's own windows in metrics.jsonl, the first (warm-up) of each run left out. Ratio "
        "range: lowest LoRA sample over highest full sample, and the reverse. Whole benchmark: "
        f"{s['wall_seconds'] / 60:.1f} min wall time.",
        "- Checkpoint: the one save at the last step, after the last timed window; size: every file under "
        "checkpoints/step-N (apparent bytes: DeepSpeed's model/optimizer states, per-rank RNG states, the HF config "
        "and tokenizer). Time to save: from the first rank's rng_state file (the save's first write) to the newest "
        "file's timestamp; not fsynced, so the page cache absorbs the writes, as in a real run.",
        "- Peak memory: one more run per variant through tools/bench/runners/profiled_train.py, train.py's main under "
        "torch.profiler with profile_memory: the running sum of the CPU allocator's events per rank (torch tensors "
        "only, exact; not the Python heap or libraries); the spread is over the 2 ranks. A whole-run peak above "
        "both phase peaks lies outside them (loading the base, eval, the export at the end). The same run times "
        "Checkpointer.save from call to return (it ends on a barrier). RSS (psutil, rank 0, in metrics.jsonl) is "
        "given beside it: it counts the interpreter and libraries too.",
        "- Timings were taken on a shared machine (2 cores, other work running), so the spreads matter more "
        "than the medians' last digits.",
        "",
        *footer(r),
    ]
    return "\n".join(lines) + "\n"


def cmd_lora(args) -> int:
    size = QUICK_SIZE if args.quick else SIZES[args.model]
    precisions = args.precision or (["fp32"] if args.quick else ["fp32", "bf16"])
    rounds = args.rounds if args.rounds is not None else (0 if args.quick else 2)
    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="zr-bench-lora-"))
    raw = measure(size, precisions, rounds, tmp)
    model, block, micro, steps, window = size
    settings = {
        "model": json.dumps(model) if model else "embedded tiny Llama",
        "lora": " ".join(VARIANTS["lora"]),
        "ranks": 2,
        "block_size": block,
        "micro_batch": micro,
        "global_batch": 2 * micro,
        "steps": steps,
        "window_steps": window,
        "rounds": rounds,
        "wall_seconds": time.perf_counter() - started,
        "lora_line": raw[precisions[0]]["lora"]["profiled"]["lora_line"],
    }
    result = new_report(settings=settings, results=summarise(raw), raw=raw)
    write_report(args.out_dir, f"lora-{result['date']}", result, markdown(result))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("lora", help="LoRA vs full fine-tuning: tokens/s, peak memory, checkpoint size, save time")
    p.add_argument("--model", choices=sorted(SIZES), default="100M")
    p.add_argument("--precision", action="append", choices=sorted(PRECISION_FRAGMENTS), help="repeatable")
    p.add_argument("--rounds", type=int, help="timed rounds per precision (default 2; 0: the profiled runs only)")
    p.add_argument(
        "--quick", action="store_true", help="tiny model, 64-token blocks, 6 steps, fp32, no timed rounds (for tests)"
    )
    p.add_argument("--out-dir", default=str(REPO / "benchmarks"), help="where lora-DATE.{md,json} go")
    p.set_defaults(func=cmd_lora)
