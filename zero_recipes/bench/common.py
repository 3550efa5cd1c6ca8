"""What every benchmark shares: the machine and versions for the report, ports, checked child processes."""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import sys
from pathlib import Path

from zero_recipes.distributed import free_port  # noqa: F401 -- one port policy for train.py, tests, benchmarks

REPO = Path(__file__).resolve().parent.parent.parent  # train.py, ds_configs/ and benchmarks/ are found here


def quiet(*_a, **_k):
    pass


def environment() -> dict:
    import datasets
    import deepspeed
    import tokenizers
    import torch
    import transformers

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    mem = next(
        int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal")
    )
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "deepspeed": deepspeed.__version__,
            "transformers": transformers.__version__,
            "datasets": datasets.__version__,
            "tokenizers": tokenizers.__version__,
            **optional_versions("peft", "trl"),
        },
        "machine": {
            "cpu": cpu,
            "cores": os.cpu_count(),
            "cores_usable": len(os.sched_getaffinity(0)),
            "ram_gib": round(mem / 2**20, 1),
            "gpus": gpus,
        },
    }


def optional_versions(*names: str) -> dict:
    """Versions of the packages a benchmark may use beyond the core (the SFT benchmark's TRL), when installed."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def yes(met: bool) -> str:
    return "yes" if met else "**no**"


def run_checked(cmd: list[str], env: dict, timeout: int, what: str) -> str:
    """Run from the repo root in its own process group (so a timeout also ends the deepspeed launcher's
    ranks); return stdout+stderr, or print the tail of the output and exit non-zero."""
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        fail(f"{what} timed out after {timeout}s", output)
    if proc.returncode != 0:
        fail(f"{what} failed (exit {proc.returncode})", output)
    return output


def fail(message: str, output: str) -> None:
    print(f"error: {message}\n---- last output ----\n{output[-4000:]}", file=sys.stderr)
    sys.exit(1)


def new_report(**fields) -> dict:
    """A report's header: today's date, the command that made it, the versions and the machine."""
    import datetime

    return {
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python", "tools/benchmark.py"] + sys.argv[1:]),
        **environment(),
        **fields,
    }


def write_report(out_dir: str, name: str, result: dict, markdown: str) -> Path:
    """out_dir/name.json and out_dir/name.md; returns the .md path."""
    import json

    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{name}.md").write_text(markdown)
    print(f"wrote {out / name}.md and .json")
    return out / f"{name}.md"


def footer(r: dict) -> list[str]:
    """The machine and versions lines every report ends with."""
    m, v = r["machine"], r["versions"]
    return [
        f"- Machine: {m['cpu']}, {m['cores']} cores ({m['cores_usable']} usable), {m['ram_gib']} GiB RAM"
        + (f", GPUs: {', '.join(m['gpus'])}" if m["gpus"] else ", no GPU")
        + ".",
        "- Versions: " + ", ".join(f"{k} {x}" for k, x in v.items()) + ".",
    ]


def allocator_events(events) -> tuple[list, list]:
    """torch.profiler's events (profile_memory=True) as (marks, allocations), both in time order: marks are
    (start_ns, end_ns, name) of the record_function("phase:NAME") ranges, allocations (time_ns, bytes) of the
    CPU allocator, positive for an allocation and negative for a free, so their running sum is the live bytes.
    memory_probe.py and profiled_train.py both read their runs this way."""
    marks = sorted(
        (e.start_ns(), e.start_ns() + e.duration_ns(), e.name()[len("phase:") :])
        for e in events
        if e.name().startswith("phase:")
    )
    mem = sorted(
        (e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and str(e.device_type()).endswith("CPU")
    )
    return marks, mem


def fwd_bwd_peak_bytes(model, config, micro: int, seq: int, forward=None) -> int:
    """Peak live bytes of one real forward+backward of `model` on random tokens, from the CPU allocator's
    profiler events; each trainable parameter's grad is dropped as it is made, as DeepSpeed moves it into its
    own buffers (the memory estimate counts those with the model states), but inside a tiled compute, where
    DeepSpeed leaves it in `param.grad` until the last tile. `forward(model, ids)` returns the
    loss (default: the model's own, with labels). The estimate tests and their child processes (a real AutoTP
    rank, tests/unit/test_memory_tp.py) measure with this one function."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    model.train()
    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(_to_deepspeed)
    ids = torch.randint(0, config.get_text_config().vocab_size, (micro, seq))
    forward = forward or (lambda m, x: m(input_ids=x, labels=x, use_cache=False).loss)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        forward(model, ids).backward()
    live = peak = 0
    for _, nbytes in allocator_events(prof.profiler.kineto_results.events())[1]:
        live += nbytes
        peak = max(peak, live)
    return peak


def _to_deepspeed(param) -> None:
    """What ZeRO does with a gradient as it is made: takes it into its buffers, unless DeepSpeed's tiled compute
    (sequence_tiled_compute, TiledMLP) has marked the weight not ready until its last tile."""
    if getattr(param, "ds_grad_is_ready", True):
        param.grad = None
