"""The GPU script's parts for DeepSpeed 0.19.8's newer optimizer and precision knobs (ds_configs/muon.json,
bf16_states.json, deepcompile.json, zenflow.json, superoffload.json; docs/optimizers.md), each measured against the
published claim it names. They run after the script's first parts, so the default 7.5-minute budget usually skips
them (listed as skipped); `--parts` picks them for a lease of their own:

    python tools/benchmark.py gpu --parts "Muon, bf16 states" DeepCompile ZenFlow SuperOffload

On the CPU (--quick) Muon and bf16 states train the tiny model; the GPU-only knobs are not skipped but checked as
far as a CPU can: train.py must refuse each in one line naming what it needs (status "needs CUDA").
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from zero_recipes.config.shipped import select

from ..common import REPO, child_env
from . import parts

# the published figure each part is read against; a CPU and one GPU cannot reproduce a multi-GPU claim, so the
# report gives the measured ratio beside it, and the estimator's prediction for this shape where it has one
CLAIMS = {
    "Muon, bf16 states": "Muon: -9 % peak GPU memory, Qwen2.5-3B, ZeRO-2, bf16, 8 x A100-40GB (34.5 -> 31.4 GiB; "
    "https://github.com/deepspeedai/DeepSpeed/pull/7962). bf16 states: master weights and Adam moments in bf16, "
    "6 bytes of state a parameter instead of 12 (DeepSpeed runtime/precision_config.py)",
    "DeepCompile": "up to 1.28x ZeRO-3's throughput on Llama-3-70B, 1.54x on Mixtral 8x7B, 32 H100s "
    "(https://github.com/deepspeedai/DeepSpeed/blob/master/blogs/deepcompile/README.md); one GPU has no "
    "collective to overlap, so about 1x is expected here",
    "ZenFlow": "up to 5x ZeRO-Offload's throughput "
    "(https://github.com/deepspeedai/DeepSpeed/blob/master/blogs/deepspeed-zenflow/README.md)",
    "SuperOffload": "up to 4x ZeRO-Offload's throughput on GH200 "
    "(https://github.com/deepspeedai/DeepSpeed/blob/master/blogs/deepspeed-superoffload/README.md); an H200 "
    "with PCIe host memory is not a superchip",
}
FRAGMENTS = {
    "AdamW": select("zero2")["zero2"],
    "Muon": (*select("zero2")["zero2"], "ds_configs/muon.json"),
    "bf16 states": (*select("zero2")["zero2"], "ds_configs/bf16_states.json"),
    "ZeRO-3": select("zero3")["zero3"],
    "DeepCompile": (*select("zero3")["zero3"], "ds_configs/deepcompile.json"),
    "ZeRO-Offload": select("zero2+offload_optimizer")["zero2+offload_optimizer"],
    "ZenFlow": (*select("zero2")["zero2"], "ds_configs/zenflow.json"),
    "ZeRO-3 offload": select("zero3+offload_optimizer")["zero3+offload_optimizer"],
    "SuperOffload": (*select("zero3")["zero3"], "ds_configs/superoffload.json"),
}
# each part's runs: (measured, baseline); the baseline runs first
RUNS = {
    "Muon, bf16 states": ("AdamW", "Muon", "bf16 states"),
    "DeepCompile": ("ZeRO-3", "DeepCompile"),
    "ZenFlow": ("ZeRO-Offload", "ZenFlow"),
    "SuperOffload": ("ZeRO-3 offload", "SuperOffload"),
}
GPU_ONLY = ("DeepCompile", "ZenFlow", "SuperOffload")


def flags(s: dict, run: str) -> list[str]:
    """The dense part's flags (parts.train_flags) with `run`'s fragments, every run without clipping: Muon needs
    it off (DeepSpeed clips its update: docs/optimizers.md#muon), SuperOffload overlaps its step only without it,
    and each baseline matches its knob. ZenFlow's update interval (4) is its accumulation: its part's two runs
    take 4 micro-batches a step."""
    argv = parts.train_flags(s, FRAGMENTS[run], s["dense"], s["block"], s["micro"]) + ["--max_grad_norm", "0"]
    return argv + (["--gradient_accumulation_steps", "4"] if run in ("ZeRO-Offload", "ZenFlow") else [])


def part(name: str):
    """The benchmark's part function for `name` (benchmark.PARTS)."""

    def run(s: dict, tmp: Path, timeout: int) -> dict:
        if name in GPU_ONLY and not parts.cuda():
            return refused_here(name, s)
        runs = {}
        for each in RUNS[name]:
            out = tmp / f"knob-{each.replace(' ', '-')}"
            try:
                runs[each] = parts.train_run(each, flags(s, each), out, timeout)
            finally:
                shutil.rmtree(out, ignore_errors=True)
        base = runs[RUNS[name][0]]
        for r in runs.values():
            r["tokens_per_sec_vs_baseline"] = r["tokens_per_sec"] / base["tokens_per_sec"]
            r["peak_vs_baseline"] = r["peak_bytes"] / base["peak_bytes"] - 1
            r["estimate_vs_baseline"] = r["estimate_bytes"] / base["estimate_bytes"] - 1
        return {"claim": CLAIMS[name], "baseline": RUNS[name][0], "runs": runs}

    return run


def refused_here(name: str, s: dict) -> dict:
    """On a machine without CUDA: train.py --dry_run with the knob's flags must exit 2 with one `error:` line
    naming what it needs (zero_recipes/ds/gpu_only.py); anything else fails the part."""
    argv = flags(s, name)
    proc = subprocess.run(
        [sys.executable, "train.py", *argv, "--dry_run", "--output_dir", "/tmp/zr-gpu-knob-refused"],
        cwd=REPO,
        env=child_env(None),
        capture_output=True,
        text=True,
        timeout=300,
    )
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    if proc.returncode != 2 or len(errors) != 1 or "needs" not in errors[0] or "CUDA" not in errors[0]:
        raise RuntimeError(f"{name} on this CPU: exit {proc.returncode}, {errors or proc.stderr[-1500:]}")
    return {"status": "needs CUDA", "claim": CLAIMS[name], "refusal": errors[0], "deepspeed": list(FRAGMENTS[name])}
