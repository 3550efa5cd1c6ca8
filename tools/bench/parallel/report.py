"""The tensor-parallelism report: benchmarks/parallel-DATE.md from the figures tools/bench/parallel/benchmark.py
measured, one function per section."""

from __future__ import annotations

from ..common import footer, yes
from ..speed.benchmark import HUNDRED_M

# What benchmark.py runs and this report states: the baseline, the loss tolerance, the sizes
BASELINE = "ZeRO-2"
PARITY_TOL = 1e-5  # fp32, same rows per step: only the summation order differs
SIZES = {
    # rounds: timed rounds; profiled_steps: steps of the profiled run (0: none); window = 1 step
    "cpu": dict(model=HUNDRED_M, block=256, micro=2, steps=8, skip=2, rounds=2, profiled_steps=3),
    "quick": dict(model=None, block=64, micro=4, steps=3, skip=1, rounds=0, profiled_steps=3),
    "gpu": dict(model=HUNDRED_M, block=1024, micro=8, steps=40, skip=10, rounds=2, profiled_steps=0),
}


def mib(b: float) -> str:
    return f"{b / 2**20:,.0f}"


def markdown(r: dict) -> str:
    lines = [f"# Tensor parallelism vs ZeRO, {r['date']}", "", f"Command: `{r['command']}`", ""]
    lines += results_table(r["configs"]) + method(r) + cpu_and_gpu(r) + gpu_run(r)
    lines += [*footer(r)]
    return "\n".join(lines) + "\n"


def results_table(c: dict) -> list[str]:
    """One row per configuration: tokens/s, its ratio to ZeRO-2, per-rank peaks and loss parity."""
    lines = []
    lines += [
        "| configuration | ranks | micro-batch | tokens/s (median) | min–max | n | vs ZeRO-2 (median of rounds) | "
        "min–max over rounds | per-rank peak, MiB: whole run | within the optimizer steps | max abs Δloss vs ZeRO-2 "
        "| loss parity |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, x in c.items():
        t, q = x["tokens_per_sec"], x["vs_zero2"]
        if "peak_bytes_by_rank" in x:
            peak = " / ".join(mib(b) for b in x["peak_bytes_by_rank"])
            step = " / ".join(mib(b) for b in x["train_step_peak_bytes_by_rank"])
        else:  # a GPU run: rank 0's torch.cuda.max_memory_allocated
            peak, step = f"rank 0: {x['mem_peak_gb_rank0']['max'] * 1024:,.0f}", "—"
        lines.append(
            f"| {name} | {x['ranks']} | {x['micro_batch']} | {t['median']:,.0f} | {t['min']:,.0f}–{t['max']:,.0f} | "
            f"{t['n']} | {q['median']:.3f} | {q['min']:.3f}–{q['max']:.3f} | {peak} | {step} | "
            f"{x['max_abs_loss_delta_vs_zero2']:.2g} | {yes(x['loss_parity'])} |"
        )
    return lines


def noise_note(r: dict) -> str:
    """The widest round-to-round range of a ratio to ZeRO-2 (timed rounds only; else empty)."""
    c, timed = r["configs"], r["settings"]["rounds"] > 0
    widest = max(c, key=lambda n: c[n]["vs_zero2"]["max"] - c[n]["vs_zero2"]["min"])
    w = c[widest]["vs_zero2"]
    noise = (
        f"The widest round-to-round range of a ratio to ZeRO-2 here is {widest}'s, {w['min']:.2f}–{w['max']:.2f}: "
        "differences between configurations smaller than that are the machine's load, not the layout."
        if timed
        else ""
    )
    return noise


def method(r: dict) -> list[str]:
    s, c = r["settings"], r["configs"]
    timed = s["rounds"] > 0
    return [
        "",
        "## Method",
        "",
        f"- Model: {s['model']}; {s['precision']}; global batch {s['global_batch']} sequences x {s['block_size']} "
        f"tokens per step in every configuration; {s['steps']} steps, the first {s['skip']} left out of tokens/s "
        "(one window = one step, train.py's own records); the embedded corpus. train.py's mesh lines: "
        + "; ".join(f"{n}: `{x['distributed_line']}`" for n, x in c.items())
        + ".",
        (
            f"- {s['rounds']} timed round(s), the order rotated each round: "
            + "; ".join(" ".join(o) for o in s["orders"])
            + ". Ratios: each configuration's median over its steps / ZeRO-2's in the same round, "
            "then the median and range over rounds. tokens/s is the global rate (a TP group's tokens counted once)."
            if timed
            else "- No timed rounds (--quick): tokens/s comes from the profiled runs (the profiler slows the "
            "steps; a smoke run, not a measurement)."
        )
        + f" Whole benchmark: {s['wall_seconds'] / 60:.1f} min wall time.",
        "- Per-rank peak memory: one more run per configuration "
        f"({s['profiled_steps']} steps) through tools/bench/runners/profiled_train.py, train.py's main under "
        "torch.profiler with profile_memory: the running sum of each rank's CPU allocator events (torch tensors "
        "only, exact; not the Python heap or libraries), the whole run (model build, steps, export), as the "
        "estimator and LoRA benchmarks measure it. Rank 0's RSS (psutil, metrics.jsonl): "
        + ", ".join(f"{n} {x['cpu_rss_gb_rank0']['median']:.2f} GiB" for n, x in c.items())
        + ".",
        "- Loss parity: every run's per-step loss against ZeRO-2's in the same round (and the profiled runs "
        f"against each other), tolerance {PARITY_TOL:g}.",
    ]


def cpu_and_gpu(r: dict) -> list[str]:
    """What the CPU ranking can and cannot say about NVLink GPUs."""
    s, z2 = r["settings"], r["configs"][BASELINE]
    traffic, gpu = r["tp_traffic"], r["gpu_estimate"]
    noise = noise_note(r)
    step_s = s["global_batch"] * s["block_size"] / z2["tokens_per_sec"]["median"]
    return [
        "",
        "## What the CPU ranking can and cannot say about NVLink GPUs",
        "",
        f"- Communication volume per step: TP's collectives (DeepSpeed `module_inject/layers.py`: RowParallel "
        "all-reduces the output of o_proj and down_proj in the forward, ColumnParallel the input gradient of q, "
        f"k, v, gate and up in the backward) are {traffic['all_reduces']} blocking all-reduces of "
        f"{traffic['bytes_each'] / 2**20:.1f} MiB (one TP group's tokens x hidden, {s['precision']}), "
        f"{traffic['bytes'] / 2**20:,.0f} MiB per step; ZeRO-2 reduce-scatters the gradients and all-gathers the "
        f"updated weights once per step (~2 x {r['parameters'] * s['bytes_per_value'] / 2**20:,.0f} MiB), "
        "ZeRO-3 all-gathers every weight in the forward and again in the backward and reduce-scatters the "
        f"gradients (~3 x {r['parameters'] * s['bytes_per_value'] / 2**20:,.0f} MiB).",
        "- On this machine all ranks share 2 cores and talk through gloo over shared memory: a collective "
        "costs CPU time taken from the matmuls, and TP's all-reduces sit on the critical path between layers, "
        f"so every one of them is paid in full (a ZeRO-2 step takes {step_s:.1f} s here). With 4 ranks on 2 "
        "cores (TP2 x DP2) each rank gets half a core, so that row measures oversubscription as much as the "
        "layout, and on a shared machine the scheduler gives 4 processes a larger share of the 2 cores against "
        "other users' jobs than 2 processes get: that row is flattered whenever the machine is loaded. "
        f"{noise} Compute per rank halves under TP (each rank multiplies half of every split weight) but the "
        "replicated parts (embedding, norms, the residual stream, the loss over the whole vocabulary) run on "
        "the whole TP group's batch on every rank, and a TP rank holds the activations of the whole "
        "data-parallel batch: 2 ranks of TP2 see the 2m sequences two ZeRO-2 ranks split.",
        "- What the run shows reliably: the loss parity (the layouts train the same model), the per-rank "
        "memory in fp32 (allocator bytes do not depend on the interconnect; bf16 and CUDA's own buffers "
        "change them on a GPU), and how many collectives each layout issues. What it cannot show: the speed ranking on "
        "GPUs. There TP's all-reduces run on NVLink: at the GPU run's size (bf16, "
        f"{gpu['tokens']:,} tokens per TP group per step) they are {gpu['all_reduces']} all-reduces of "
        f"{gpu['bytes_each'] / 2**20:.0f} MiB, {gpu['bytes'] / 2**30:.1f} GiB per step, ~{gpu['nvlink_ms']:.1f} ms "
        "at 450 GB/s each way (NVLink 4, 900 GB/s bidirectional; a 2-rank ring all-reduce sends and receives "
        f"the tensor's size per rank), against ~{gpu['compute_ms']:.0f} ms of matmuls per step per TP rank at 40 % "
        "of the 989 TFLOP/s bf16 peak (6 x parameters x tokens / 2 ranks), while ZeRO-3's all-gathers cross the same links and are prefetched behind compute (zero3.json: overlap_comm true), "
        f"and ZeRO-2 moves ~2 x {r['parameters'] * 2 / 2**20:,.0f} MiB of bf16 gradients and weights once per "
        f"step (~{2 * r['parameters'] * 2 / 450e9 * 1e3:.1f} ms at the same rate). Whether halving the matmuls (which "
        "also makes them smaller and less efficient on a GPU at hidden 768) beats the blocking all-reduces "
        "is a GPU measurement: the command below.",
    ]


def gpu_run(r: dict) -> list[str]:
    """The prepared GPU run, its command and its launches by hand."""
    return [
        "",
        "## The GPU run (prepared, not run here)",
        "",
        "`python tools/benchmark.py parallel --gpu` runs the same four configurations in bf16 on 2 and 4 GPUs "
        f"(block {SIZES['gpu']['block']}, micro-batch {SIZES['gpu']['micro']}, {SIZES['gpu']['steps']} steps, "
        f"{SIZES['gpu']['rounds']} rotated rounds; peak memory: rank 0's torch.cuda.max_memory_allocated). "
        "The same launches by hand:",
        "",
        "```",
        *r["gpu_commands"],
        "```",
        "",
    ]
