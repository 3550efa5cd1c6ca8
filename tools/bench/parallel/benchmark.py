"""Tensor parallelism against ZeRO on the same work: tokens/s, per-rank peak memory and per-step loss parity.

    python tools/benchmark.py parallel              # 100M model, CPU ranks: benchmarks/parallel-DATE.{md,json}
    python tools/benchmark.py parallel --quick      # tiny model, 3 steps, profiled runs only (the test)
    python tools/benchmark.py parallel --gpu        # the prepared GPU run (bf16, 2 and 4 GPUs); refuses a CPU

Four configurations, each train.py through the real `deepspeed` launcher on one global batch (the same rows
per step, so fp32 losses must agree step by step): ZeRO-2 and ZeRO-3 on 2 ranks (micro-batch m each), TP2 x
ZeRO-1 on 2 ranks (one tensor-parallel group: data-parallel size 1, so micro-batch 2m) and TP2 x DP2 (ZeRO-1)
on 4 ranks (micro-batch m). Timed rounds rotate the order (A B C D, B C D A, ...) so drift in machine load
hits all alike; each configuration's ratio to ZeRO-2 is taken within a round, then summarised over rounds.
tokens/s: train.py's own per-step records in metrics.jsonl (counted once per TP group), the first `skip`
steps (warm-up) left out. Per-rank peak memory: one more run per configuration under
tools/bench/runners/profiled_train.py (torch.profiler's allocator events, every rank).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from zero_recipes.config.shipped import PRECISIONS, select

from ..common import REPO, free_port, new_report, run_checked, spread, write_report
from .report import BASELINE, PARITY_TOL, SIZES, markdown

TP2 = "ds_configs/tp2.json"
_Z = select("zero1", "zero2", "zero3")
# name: (ranks, --deepspeed files, micro-batch multiple). Every configuration trains on 2 x m sequences per
# step: a TP group's ranks share one batch, so 2 ranks of TP2 are one data-parallel replica fed 2m.
CONFIGS: dict[str, tuple[int, tuple[str, ...], int]] = {
    "ZeRO-2": (2, _Z["zero2"], 1),
    "ZeRO-3": (2, _Z["zero3"], 1),
    "TP2 x ZeRO-1": (2, (*_Z["zero1"], TP2), 2),
    "TP2 x DP2 (ZeRO-1)": (4, (*_Z["zero1"], TP2), 1),
}


def launch(
    name: str, size: dict, steps: int, precision: str, out: Path, module: list[str], configs: dict = CONFIGS
) -> list[str]:
    """The full `deepspeed` command line of one configuration (module: ["train.py"] or the profiler's)."""
    ranks, files, multiple = configs[name]
    cmd = ["deepspeed", "--num_gpus", str(ranks), "--master_port", str(free_port()), *module]
    cmd += ["--deepspeed", *files, *PRECISIONS[precision]]
    cmd += ["--max_steps", str(steps), "--block_size", str(size["block"])]
    cmd += ["--per_device_train_batch_size", str(size["micro"] * multiple), "--learning_rate", "3e-3"]
    cmd += ["--warmup_steps", "1", "--logging_steps", "1", "--eval_steps", "0", "--save_steps", "0"]
    cmd += ["--max_eval_batches", "1", "--report_to", "none", "--output_dir", str(out)]
    return cmd + (["--model_config", json.dumps(size["model"])] if size["model"] else [])


def read_run(out: Path, log: str) -> dict:
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "tokens_per_sec" in r]
    return {
        "losses": [r["loss"] for r in steps],
        "tokens_per_sec": [r["tokens_per_sec"] for r in steps],
        "tokens_per_sec_per_device": [r["tokens_per_sec_per_device"] for r in steps],
        "cpu_rss_gb_rank0": max(r.get("cpu_rss_gb", 0.0) for r in steps),
        "mem_peak_gb_rank0": max(r.get("mem_peak_gb", 0.0) for r in steps),
        "distributed_line": next((x for x in log.splitlines() if x.startswith("distributed:")), None),
    }


def timed_run(name: str, size: dict, precision: str, out: Path, configs: dict = CONFIGS) -> dict:
    cmd = launch(name, size, size["steps"], precision, out, ["train.py"], configs)
    started = time.perf_counter()
    run = read_run(out, run_checked(cmd, None, 3600, f"{name}: {' '.join(cmd)}"))
    return {**run, "wall_seconds": time.perf_counter() - started}


def profiled_run(name: str, size: dict, precision: str, out: Path, configs: dict = CONFIGS) -> dict:
    """The same launch under the allocator profiler, every rank: its peaks (tokens/s slowed by the profiler)."""
    probe = out.with_name(out.name + "-probe")
    module = ["--module", "bench.runners.profiled_train"]
    cmd = launch(name, size, size["profiled_steps"], precision, out, module, configs) + ["--probe_out", str(probe)]
    run = read_run(out, run_checked(cmd, None, 3600, f"{name} (profiled): {' '.join(cmd)}"))
    ranks = [json.loads(Path(f"{probe}.rank{r}.json").read_text()) for r in range(configs[name][0])]
    return {**run, "ranks": ranks}


def round_orders(names: list[str], rounds: int) -> list[list[str]]:
    """A B C D, B C D A, C D A B, ...: each configuration takes each place in turn."""
    return [names[r % len(names) :] + names[: r % len(names)] for r in range(rounds)]


def round_ratios(rounds: list[dict], skip: int, baseline: str = BASELINE) -> dict:
    """Per configuration, one ratio per round: its median tokens/s over the steps after `skip` divided by the
    baseline's in the same round."""
    out = {}
    for rnd in rounds:
        base = statistics.median(rnd[baseline]["tokens_per_sec"][skip:])
        for name, run in rnd.items():
            out.setdefault(name, []).append(statistics.median(run["tokens_per_sec"][skip:]) / base)
    return out


def max_loss_delta(run: dict, ref: dict) -> float:
    assert len(run["losses"]) == len(ref["losses"]), (run["losses"], ref["losses"])
    return max(abs(a - b) for a, b in zip(run["losses"], ref["losses"]))


def summarise(raw: dict, skip: int, configs: dict = CONFIGS) -> dict:
    """Each configuration's figures. With no timed rounds (--quick) the profiled runs stand in as one round."""
    rounds = [r["runs"] for r in raw["rounds"]] or [raw["profiled"]]
    ratios = round_ratios(rounds, skip)
    out = {}
    for name, (ranks, files, multiple) in configs.items():
        runs = [r[name] for r in rounds]
        prof = raw["profiled"].get(name)
        checked = [(r[name], r[BASELINE]) for r in rounds] + ([(prof, raw["profiled"][BASELINE])] if prof else [])
        delta = max(max_loss_delta(a, b) for a, b in checked)
        out[name] = {
            "ranks": ranks,
            "deepspeed": list(files),
            "micro_batch": raw["micro"] * multiple,
            "distributed_line": runs[0]["distributed_line"],
            "tokens_per_sec": spread([x for r in runs for x in r["tokens_per_sec"][skip:]]),
            "tokens_per_sec_per_device": spread([x for r in runs for x in r["tokens_per_sec_per_device"][skip:]]),
            "vs_zero2": spread(ratios[name]),
            "vs_zero2_by_round": ratios[name],
            "losses": runs[0]["losses"],
            "max_abs_loss_delta_vs_zero2": delta,
            "loss_parity": delta <= PARITY_TOL,
            "cpu_rss_gb_rank0": spread([r["cpu_rss_gb_rank0"] for r in runs]),
            "mem_peak_gb_rank0": spread([r["mem_peak_gb_rank0"] for r in runs]),
        }
        if prof:
            out[name]["peak_bytes_by_rank"] = [r["peak_bytes"] for r in prof["ranks"]]
            out[name]["peak_bytes"] = spread(out[name]["peak_bytes_by_rank"])
            out[name]["train_step_peak_bytes_by_rank"] = [r["phase_peak_bytes"]["train_step"] for r in prof["ranks"]]
            out[name]["train_step_peak_bytes"] = spread(out[name]["train_step_peak_bytes_by_rank"])
    return out


def model_fields(model: dict | None) -> dict:
    """The model's config fields: the embedded tiny Llama's, overridden by --model_config's (as train.py)."""
    from zero_recipes.modeling.model import TINY_LLAMA

    return {**TINY_LLAMA, **(model or {})}


def tp_traffic(model: dict | None, tokens_per_group: int, bytes_per_value: int) -> dict:
    """AutoTP's collectives per training step of one TP group, from DeepSpeed's module_inject/layers.py: a
    row-parallel linear (o_proj, down_proj: LinearAllreduce) all-reduces its output in the forward
    (RowParallel), a column-parallel one (q, k, v, gate, up: LinearLayer) all-reduces its input's gradient in
    the backward (ColumnParallel), each one activation-sized tensor (tokens x hidden)."""
    cfg = model_fields(model)
    layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    per_layer = 2 + 5  # forward: o_proj, down_proj; backward: q, k, v, gate, up
    each = tokens_per_group * hidden * bytes_per_value
    return {"all_reduces": layers * per_layer, "bytes_each": each, "bytes": layers * per_layer * each}


def gpu_estimate(parameters: int, size: dict = SIZES["gpu"], link: float = 450e9, flops: float = 0.4 * 989e12) -> dict:
    """TP2's all-reduce time on NVLink against its matmul time, per step, at the GPU run's size: estimates
    from bytes and FLOPs, not measurements."""
    tokens = 2 * size["micro"] * size["block"]  # one TP group's tokens per step (the global batch)
    traffic = tp_traffic(size["model"], tokens, 2)
    return {
        **traffic,
        "tokens": tokens,
        "nvlink_ms": traffic["bytes"] / link * 1e3,
        "compute_ms": 6 * parameters * tokens / 2 / flops * 1e3,
    }


def measure(size: dict, precision: str, tmp: Path, configs: dict = CONFIGS) -> dict:
    names = list(configs)
    raw = {"micro": size["micro"], "rounds": [], "profiled": {}}
    for i, order in enumerate(round_orders(names, size["rounds"])):
        runs = {}
        for name in order:
            runs[name] = timed_run(name, size, precision, tmp / f"r{i}-{slug(name)}", configs)
            r = runs[name]
            print(
                f"  round {i + 1}/{size['rounds']} {name}: {statistics.median(r['tokens_per_sec'][size['skip'] :]):,.0f}"
                f" tokens/s ({r['wall_seconds']:.0f} s)",
                flush=True,
            )
        raw["rounds"].append({"order": order, "runs": {n: runs[n] for n in names}})
    if size["profiled_steps"]:
        for j, name in enumerate(names):
            raw["profiled"][name] = profiled_run(name, size, precision, tmp / f"p-{slug(name)}", configs)
            peaks = ", ".join(f"{r['peak_bytes'] / 2**20:,.0f}" for r in raw["profiled"][name]["ranks"])
            print(f"  {name} profiled: per-rank peak {peaks} MiB", flush=True)
    return raw


def slug(name: str) -> str:
    """`TP2 x DP2 (ZeRO-1)` -> `tp2-x-dp2-zero-1`: a configuration's name as a directory name."""
    return "-".join("".join(ch if ch.isalnum() else " " for ch in name.lower()).split())


def gpu_commands(size: dict) -> list[str]:
    """The `deepspeed` lines --gpu runs (bf16), for a user to run by hand on a GPU node."""
    out = []
    for name in CONFIGS:
        cmd = launch(name, size, size["steps"], "bf16", Path(f"outputs/parallel-{slug(name)}"), ["train.py"])
        cmd[4] = "29500"  # the port of the day: any free one
        out.append(" ".join(f"'{c}'" if c.startswith("{") else c for c in cmd))
    return out


def cmd_parallel(args) -> int:
    precision = "bf16" if args.gpu else "fp32"
    if args.gpu:
        import torch

        if torch.cuda.device_count() < 4:
            print("error: --gpu needs 4 CUDA GPUs (TP2 x DP2); this machine has fewer", file=sys.stderr)
            return 2
    size = dict(SIZES["gpu" if args.gpu else "quick" if args.quick else "cpu"])
    if args.rounds is not None:
        size["rounds"] = args.rounds
    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="zr-bench-parallel-"))
    raw = measure(size, precision, tmp)
    configs = summarise(raw, size["skip"])
    from transformers import LlamaConfig

    from zero_recipes.modeling.model import count_params_meta

    params = count_params_meta(LlamaConfig(**model_fields(size["model"])))
    bytes_per_value = 2 if precision == "bf16" else 4
    settings = {
        "model": json.dumps(size["model"]) if size["model"] else "embedded tiny Llama",
        "precision": precision,
        "bytes_per_value": bytes_per_value,
        "block_size": size["block"],
        "micro_batch": size["micro"],
        "global_batch": 2 * size["micro"],
        "steps": size["steps"],
        "skip": size["skip"],
        "rounds": size["rounds"],
        "orders": [r["order"] for r in raw["rounds"]],
        "profiled_steps": size["profiled_steps"],
        "wall_seconds": time.perf_counter() - started,
    }
    result = new_report(
        settings=settings,
        configs=configs,
        parameters=params,
        tp_traffic=tp_traffic(size["model"], 2 * size["micro"] * size["block"], bytes_per_value),
        gpu_commands=gpu_commands(SIZES["gpu"]),
        gpu_estimate=gpu_estimate(params),
        raw=raw,
    )
    write_report(args.out_dir, f"parallel{'-gpu' if args.gpu else ''}-{result['date']}", result, markdown(result))
    for name, x in configs.items():
        print(
            f"{name}: {x['tokens_per_sec']['median']:,.0f} tokens/s, {x['vs_zero2']['median']:.3f}x ZeRO-2 "
            f"({x['vs_zero2']['min']:.3f}-{x['vs_zero2']['max']:.3f}), max |dloss| {x['max_abs_loss_delta_vs_zero2']:.2g}"
        )
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("parallel", help="TP2 x ZeRO-1 and TP2 x DP2 against ZeRO-2/3: tokens/s, per-rank peak, loss")
    p.add_argument("--quick", action="store_true", help="tiny model, 3 steps, profiled runs only (for tests)")
    p.add_argument("--gpu", action="store_true", help="the prepared GPU run: bf16, 2 and 4 GPUs (needs 4)")
    p.add_argument("--rounds", type=int, help="timed rounds (default 2; 0: the profiled runs only)")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks"), help="where parallel-DATE.{md,json} go")
    p.set_defaults(func=cmd_parallel)
