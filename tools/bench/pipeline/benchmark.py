"""Pipeline parallelism against ZeRO on the same work, and the pipeline bubble as the micro-batch count grows.

    python tools/benchmark.py pipeline            # ~17M Llama, 2 CPU ranks: benchmarks/pipeline-DATE.{md,json}
    python tools/benchmark.py pipeline --quick    # tiny model, ZeRO-1 and PP2 once each, profiled (the test)
    python tools/benchmark.py pipeline --gpu      # the prepared GPU run (bf16, 2 GPUs); refuses without them

Part 1, throughput and memory: ZeRO-1 and ZeRO-2 (2 data-parallel ranks, micro-batch B/2 each) and PP2 x
ZeRO-1 (one pipeline of 2 stages, micro-batch 1, B micro-batches a step) train the same global batch of B
sequences, each train.py through the real `deepspeed` launcher, in rotated rounds (A B C, B C A); tokens/s
from train.py's own per-step records, paired step by step within a round (bench/paired.py), the first steps
(warm-up) left out. Per-rank peak memory: one more run per configuration under the allocator profiler
(bench/runners/profiled_train.py; for PP2 bench/pipeline/probe.py, which profiles the same way). fp32 losses must
agree step by step (the same rows each step).

Part 2, the bubble: PP2 at micro-batch 1 and m = 1, 2, 4, 8 micro-batches a step, each under
bench/pipeline/probe.py (every schedule instruction timed on every rank); bench/pipeline/bubble.py turns
the records into the measured bubble, the formula's, the one the measured stage times predict and the one
a fit of the step span against m implies.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from zero_recipes.config.shipped import PIPELINE_PARALLEL, PRECISIONS, select

from .. import paired
from ..common import REPO, free_port, new_report, run_checked, spread, write_report
from ..parallel.benchmark import max_loss_delta, model_fields, read_run, slug
from . import bubble
from .report import PARITY_TOL, PP, SIZES, markdown

_Z = select("zero1", "zero2")
CONFIGS: dict[str, tuple[str, ...]] = {
    "ZeRO-1": _Z["zero1"],
    "ZeRO-2": _Z["zero2"],
    PP: (*_Z["zero1"], PIPELINE_PARALLEL[2]),
}
BASELINES = ("ZeRO-1", "ZeRO-2")
RANKS = 2
PROBES = {
    "profiled_train": ["--module", "bench.runners.profiled_train"],
    "pipeline_probe": ["--module", "bench.pipeline.probe"],
}


def batch(name: str, size: dict) -> tuple[int, int]:
    """(micro-batch per rank, micro-batches per step): B sequences a step in every configuration."""
    if name == PP:
        return size["pp_micro"], size["batch"] // size["pp_micro"]
    return size["batch"] // RANKS, 1


def launch(files, micro: int, accumulation: int, size: dict, steps: int, precision: str, out, module) -> list[str]:
    """The full `deepspeed` command line of one run (module: ["train.py"] or a probe's)."""
    cmd = ["deepspeed", "--num_gpus", str(RANKS), "--master_port", str(free_port()), *module]
    cmd += ["--deepspeed", *files, *PRECISIONS[precision]]
    cmd += ["--max_steps", str(steps), "--block_size", str(size["block"])]
    cmd += ["--per_device_train_batch_size", str(micro), "--gradient_accumulation_steps", str(accumulation)]
    cmd += ["--learning_rate", "3e-3", "--warmup_steps", "1", "--logging_steps", "1", "--eval_steps", "0"]
    cmd += ["--save_steps", "0", "--max_eval_batches", "1", "--report_to", "none", "--output_dir", str(out)]
    return cmd + (["--model_config", json.dumps(size["model"])] if size["model"] else [])


def config_launch(name: str, size: dict, steps: int, precision: str, out, module) -> list[str]:
    return launch(CONFIGS[name], *batch(name, size), size, steps, precision, out, module)


def run_read(cmd: list[str], out: Path, what: str) -> dict:
    """Run, then read train.py's records; the pipeline's partition line too, when there is one."""
    log = run_checked(cmd, None, 3600, f"{what}: {' '.join(cmd)}")
    pipeline_line = next((x for x in log.splitlines() if x.startswith("pipeline:")), None)
    return {**read_run(out, log), "pipeline_line": pipeline_line}


def probe_ranks(probe: Path) -> list[dict]:
    return [json.loads(Path(f"{probe}.rank{r}.json").read_text()) for r in range(RANKS)]


def timed_run(name: str, size: dict, precision: str, out: Path) -> dict:
    started = time.perf_counter()
    run = run_read(config_launch(name, size, size["steps"], precision, out, ["train.py"]), out, name)
    return {**run, "wall_seconds": time.perf_counter() - started}


def profiled_run(name: str, size: dict, precision: str, out: Path) -> dict:
    """The same launch under the allocator profiler on every rank: its peaks (tokens/s slowed by it). PP2's
    goes through probe.py, which profiles as runners/profiled_train.py does and times the schedule too."""
    probe = out.with_name(out.name + "-probe")
    module = PROBES["pipeline_probe" if name == PP else "profiled_train"]
    cmd = config_launch(name, size, size["profiled_steps"], precision, out, module) + ["--probe_out", str(probe)]
    cmd += ["--profile_memory", "true"] if name == PP else []
    return {**run_read(cmd, out, f"{name} (profiled)"), "ranks": probe_ranks(probe)}


def bubble_run(m: int, size: dict, precision: str, out: Path) -> dict:
    """PP2 at micro-batch pp_micro and m micro-batches a step, every schedule instruction timed."""
    probe = out.with_name(out.name + "-probe")
    module = PROBES["pipeline_probe"]
    cmd = launch(CONFIGS[PP], size["pp_micro"], m, size, size["bubble_steps"], precision, out, module)
    run = run_read(cmd + ["--probe_out", str(probe)], out, f"PP2 bubble, m = {m}")
    return {**run, "ranks": probe_ranks(probe)}


def measure(size: dict, precision: str, tmp: Path) -> dict:
    names, skip = list(size["configs"]), size["skip"]
    raw = {"rounds": [], "profiled": {}, "bubble": {}}
    for i, order in enumerate(paired.rotations(names, size["rounds"])):
        runs = {}
        for name in order:
            runs[name] = r = timed_run(name, size, precision, tmp / f"r{i}-{slug(name)}")
            rate = statistics.median(r["tokens_per_sec"][skip:])
            print(
                f"  round {i + 1}/{size['rounds']} {name}: {rate:,.0f} tokens/s ({r['wall_seconds']:.0f} s)", flush=True
            )
        raw["rounds"].append({"order": order, "runs": {n: runs[n] for n in names}})
    for name in names if size["profiled_steps"] else ():
        raw["profiled"][name] = profiled_run(name, size, precision, tmp / f"p-{slug(name)}")
        peaks = ", ".join(f"{r['peak_bytes'] / 2**20:,.0f}" for r in raw["profiled"][name]["ranks"])
        print(f"  {name} profiled: per-rank peak {peaks} MiB", flush=True)
    for m in size["bubble_ms"]:
        raw["bubble"][m] = bubble_run(m, size, precision, tmp / f"b-m{m}")
        rows = bubble.summarise({m: raw["bubble"][m]["ranks"]}, size["bubble_skip"])["rows"]
        print(
            f"  PP2 m = {m}: bubble {rows[0]['measured']['median']:.3f} (formula {rows[0]['formula']:.3f})", flush=True
        )
    return raw


def ratios(rounds: list[dict], name: str, skip: int) -> dict:
    """name's tokens/s over each baseline's: per-step rates paired within each round, bootstrapped."""
    rates = [{n: run["tokens_per_sec"][skip:] for n, run in rnd.items()} for rnd in rounds]
    return {base: paired.ratio(rates, name, base) for base in BASELINES if base in rounds[0] and base != name}


def summarise(raw: dict, size: dict) -> dict:
    """Each configuration's figures. With no timed rounds (--quick) the profiled runs stand in as one round."""
    rounds, skip = [r["runs"] for r in raw["rounds"]] or [raw["profiled"]], size["skip"]
    ref = BASELINES[0]
    out = {}
    for name in size["configs"]:
        runs, prof = [r[name] for r in rounds], raw["profiled"].get(name)
        checked = [(r[name], r[ref]) for r in rounds] + ([(prof, raw["profiled"][ref])] if prof else [])
        delta = max(max_loss_delta(a, b) for a, b in checked)
        micro, accumulation = batch(name, size)
        out[name] = {
            "deepspeed": list(CONFIGS[name]),
            "ranks": RANKS,
            "micro_batch": micro,
            "accumulation": accumulation,
            "distributed_line": runs[0]["distributed_line"],
            "pipeline_line": runs[0]["pipeline_line"],
            "tokens_per_sec": spread([x for r in runs for x in r["tokens_per_sec"][skip:]]),
            "round_medians": [statistics.median(r["tokens_per_sec"][skip:]) for r in runs],
            "vs": ratios(rounds, name, skip),
            "losses": runs[0]["losses"],
            "max_abs_loss_delta_vs_zero1": delta,
            "loss_parity": delta <= PARITY_TOL,
            "cpu_rss_gb_rank0": spread([r["cpu_rss_gb_rank0"] for r in runs]),
            "mem_peak_gb_rank0": spread([r["mem_peak_gb_rank0"] for r in runs]),
        }
        if prof:
            out[name]["peak_bytes_by_rank"] = [r["peak_bytes"] for r in prof["ranks"]]
            out[name]["train_step_peak_bytes_by_rank"] = [r["phase_peak_bytes"]["train_step"] for r in prof["ranks"]]
            if name == PP:
                out[name]["export_gather_peak_bytes_by_rank"] = [r["export_gather_peak_bytes"] for r in prof["ranks"]]
    return out


def bubble_sources(raw: dict, size: dict) -> tuple[dict, int, str]:
    """The probe runs the bubble table reads, their warm-up, and where they came from. With no sweep
    (--quick) PP2's profiled run is the one row: its schedule is timed too (under the profiler)."""
    if raw["bubble"]:
        return {m: r["ranks"] for m, r in raw["bubble"].items()}, size["bubble_skip"], "sweep"
    m = batch(PP, size)[1]
    return {m: raw["profiled"][PP]["ranks"]}, size["skip"], "profiled"


def gpu_commands(size: dict) -> list[str]:
    """The `deepspeed` lines --gpu runs (bf16), for a user to run by hand on a GPU node."""
    out = []
    for name in CONFIGS:
        out.append(
            config_launch(name, size, size["steps"], "bf16", Path(f"outputs/pipeline-{slug(name)}"), ["train.py"])
        )
    for m in size["bubble_ms"]:
        cmd = launch(
            CONFIGS[PP],
            size["pp_micro"],
            m,
            size,
            size["bubble_steps"],
            "bf16",
            f"outputs/pipeline-m{m}",
            PROBES["pipeline_probe"],
        )
        out.append(["PYTHONPATH=tools", *cmd, "--probe_out", f"outputs/pipeline-m{m}-probe"])
    for cmd in out:
        cmd[cmd.index("--master_port") + 1] = "29500"  # the port of the day: any free one
    return [" ".join(f"'{c}'" if c.startswith("{") else c for c in cmd) for cmd in out]


def report(size: dict, precision: str, raw: dict, wall: float) -> dict:
    """The report's fields: settings, the configurations, the bubble, the GPU lines and the raw runs."""
    from transformers import LlamaConfig

    from zero_recipes.modeling.model import count_params_meta

    sources, bubble_skip, source = bubble_sources(raw, size)
    settings = {
        **{k: v for k, v in size.items() if k != "model"},
        "model": json.dumps(size["model"]) if size["model"] else "embedded tiny Llama",
        "precision": precision,
        "orders": [r["order"] for r in raw["rounds"]],
        "bubble_source": source,
        "bubble_skip": bubble_skip,
        "wall_seconds": wall,
    }
    return new_report(
        settings=settings,
        parameters=count_params_meta(LlamaConfig(**model_fields(size["model"]))),
        configs=summarise(raw, size),
        bubble=bubble.summarise(sources, bubble_skip),
        gpu_commands=gpu_commands(SIZES["gpu"]),
        raw={**raw, "bubble": {str(m): r for m, r in raw["bubble"].items()}},
    )


def cmd_pipeline(args) -> int:
    if args.gpu:
        import torch

        if torch.cuda.device_count() < RANKS:
            print(f"error: --gpu needs {RANKS} CUDA GPUs (PP2); this machine has fewer", file=sys.stderr)
            return 2
    precision = "bf16" if args.gpu else "fp32"
    size = dict(SIZES["gpu" if args.gpu else "quick" if args.quick else "cpu"])
    if args.rounds is not None:
        size["rounds"] = args.rounds
    started, tmp = time.perf_counter(), Path(tempfile.mkdtemp(prefix="zr-bench-pipeline-"))
    raw = measure(size, precision, tmp)
    shutil.rmtree(tmp)  # every run's checkpoint and export (GBs at the CPU size); the figures are in `raw`
    result = report(size, precision, raw, time.perf_counter() - started)
    write_report(args.out_dir, f"pipeline{'-gpu' if args.gpu else ''}-{result['date']}", result, markdown(result))
    for name, x in result["configs"].items():
        vs = ", ".join(f"{paired.text(q)} x {base}" for base, q in x["vs"].items())
        print(f"{name}: {x['tokens_per_sec']['median']:,.0f} tokens/s; {vs}")
    for row in result["bubble"]["rows"]:
        print(f"m = {row['m']}: bubble {row['measured']['median']:.3f}, formula {row['formula']:.3f}")
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("pipeline", help="PP2 against ZeRO-1/2 (tokens/s, per-rank peak) and the bubble against m")
    p.add_argument("--quick", action="store_true", help="tiny model, ZeRO-1 and PP2 profiled once each (for tests)")
    p.add_argument("--gpu", action="store_true", help="the prepared GPU run: bf16 on 2 GPUs (needs them)")
    p.add_argument("--rounds", type=int, help="timed rounds (default 2; 0: the profiled runs only)")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks"), help="where pipeline-DATE.{md,json} go")
    p.set_defaults(func=cmd_pipeline)
