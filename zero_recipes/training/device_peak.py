"""One device's peak matmul FLOP/s, MFU's denominator: the datasheet's figure for a GPU in flops.PEAK_FLOPS,
else measured, and the measurement kept in a JSON cache so later runs on the same device read it back."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from zero_recipes.checkpointing import atomic
from zero_recipes.training.flops import fp32_matmul_kind, peak_flops_from_table


def measure_matmul_peak(dtype_name: str = "fp32", seconds: float = 0.5, device: str = "cpu") -> float:
    """Measured matmul FLOP/s, for devices with no trustworthy datasheet figure: every CPU (per rank,
    with this process's threads; all ranks measure at once, so contention is included) and GPUs missing
    from flops.PEAK_FLOPS."""
    import torch

    dtype = {
        "fp32": torch.float32,
        "tf32": torch.float32,  # as torch.backends.fp32_precision has it
        "bf16": torch.bfloat16,
        "fp16": torch.float16 if device != "cpu" else torch.float32,
    }[dtype_name]
    n = 1024 if device == "cpu" else 8192
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    torch.mm(a, b)
    sync()
    iters, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        iters += 1
        if iters % 8 == 0:
            sync()
    sync()
    return 2 * n**3 * iters / (time.perf_counter() - start)


def device_peak_flops(dtype_name: str, cache: Path | None = None) -> tuple[float, str]:
    """(peak FLOP/s of one device, where the figure comes from). A measured peak is kept in `cache` (a JSON
    file) under the device, dtype, threads, ranks on the node and torch version it was measured with, and read
    back by later runs: the measurement holds the first step back half a second on every CPU launch otherwise,
    and the device does not change between runs (the figure only sets the MFU's scale)."""
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        dtype_name = fp32_matmul_kind() if dtype_name == "fp32" else dtype_name
        peak = peak_flops_from_table(name, dtype_name)
        if peak:
            return peak, f"{name} datasheet dense {dtype_name}"
        device, source = "cuda", f"{name} not in the peak table: measured {dtype_name} matmul"
    else:
        name, device = cpu_name(), "cpu"
        source = f"measured {dtype_name} matmul, {torch.get_num_threads()} threads"
    ranks = os.environ.get("LOCAL_WORLD_SIZE", "1")
    key = f"{name} | {dtype_name} | {torch.get_num_threads()} threads | {ranks} ranks | torch {torch.__version__}"
    known = _read_json(cache) if cache else {}
    if key in known:
        return known[key]["flops"], f"{source} on {known[key]['date']}"
    peak = measure_matmul_peak(dtype_name, device=device)
    if cache:
        _write_json(cache, {**known, key: {"flops": peak, "date": time.strftime("%Y-%m-%d")}})
    return peak, source


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo; only without it platform's, which runs `uname -p` on Linux)."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: measure again and rewrite it


def _write_json(path: Path, value: dict) -> None:
    """Atomic (ranks measure and write at once); a read-only cache costs the next run the measurement, no more."""
    try:
        atomic.write_text(path, json.dumps(value, indent=1))
    except OSError:
        pass
