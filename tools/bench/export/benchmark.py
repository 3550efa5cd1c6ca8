"""The export benchmark: peak host memory of tools/export_hf.py on a model of a few hundred MB.

train.py saves a 2-rank checkpoint per ZeRO stage (one step, random init), then each export runs in its own
process while this one samples /proc/<pid>/status every 10 ms. Three figures per export:
- RssAnon: memory the export itself allocated (what the goal is about);
- RssFile: pages of the memory-mapped rank files (DeepSpeed loads them with mmap=True). They are page cache,
  shared and dropped under pressure, so they are reported but not counted against the goal;
- VmRSS: their sum, what `top` shows.
The baseline is the same interpreter importing what the export imports, so the figures are net of Python,
torch and DeepSpeed themselves.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..common import REPO, footer, free_port, new_report, run_checked, write_report, yes

# ~91M parameters (365 MB in fp32): "a model of a few hundred MB"; --quick: ~7M, for the test
MODELS = {
    "full": {
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 12,
        "intermediate_size": 2048,
    },
    "quick": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 688,
    },
}
SHARD = {"full": "100MB", "quick": "10MB"}
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
TOLERANCE = 1.15  # the goal allows "about" one copy plus one shard: 15 % for allocator slack and metadata
IMPORTS = "import deepspeed.utils.zero_to_fp32, huggingface_hub, safetensors.torch, torch"
FIELDS = ("VmRSS", "RssAnon", "RssFile")


def peak_memory(cmd: list[str]) -> dict:
    """Run cmd to completion; the peaks of its VmRSS, RssAnon and RssFile in bytes."""
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = dict.fromkeys(FIELDS, 0)
    while proc.poll() is None:
        try:
            for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                key = line.split(":", 1)[0]
                if key in peak:
                    peak[key] = max(peak[key], int(line.split()[1]) * 1024)
        except (FileNotFoundError, ProcessLookupError):
            pass
        time.sleep(0.01)
    output = proc.stdout.read()
    if proc.returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} failed (exit {proc.returncode})\n{output[-3000:]}")
    return peak


def parameters(shard: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(shard), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def make_checkpoint(tmp: Path, stage: int, size: str) -> Path:
    out = tmp / f"zero{stage}"
    cmd = [
        "deepspeed",
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        "train.py",
        "--deepspeed",
        f"ds_configs/zero{stage}.json",
        "--model_config",
        json.dumps(MODELS[size]),
        "--max_steps",
        "1",
        "--block_size",
        "64",
        "--per_device_train_batch_size",
        "1",
        "--eval_steps",
        "0",
        "--output_dir",
        str(out),
    ]
    run_checked(cmd, None, 1200, f"train.py (ZeRO-{stage} checkpoint)")
    return out / "checkpoints"


def measure(quick: bool) -> dict:
    size = "quick" if quick else "full"
    tmp = Path(tempfile.mkdtemp(prefix="zr-bench-export-"))
    try:
        base = peak_memory([sys.executable, "-c", IMPORTS])
        rows = []
        for stage in (2, 3):  # ZeRO-1 goes through ZeRO-2's consolidation code
            ckpt = make_checkpoint(tmp, stage, size)
            for dtype in ("fp32", "bf16"):
                dest = tmp / f"out-{stage}-{dtype}"
                peak = peak_memory(
                    [
                        sys.executable,
                        "tools/export_hf.py",
                        str(ckpt),
                        str(dest),
                        "--dtype",
                        dtype,
                        "--max_shard_size",
                        SHARD[size],
                    ]
                )
                files = sorted(dest.glob("*.safetensors"))
                weights = sum(f.stat().st_size for f in files)
                largest = max(f.stat().st_size for f in files)
                num_params = sum(parameters(f) for f in files)
                net = {k: peak[k] - base[k] for k in FIELDS}
                budget = weights + largest
                rows.append(
                    {
                        "zero_stage": stage,
                        "dtype": dtype,
                        "num_params": num_params,
                        "weights_bytes": weights,
                        "largest_shard_bytes": largest,
                        "shards": len(files),
                        "peak": peak,
                        "net": net,
                        "anon_over_budget": net["RssAnon"] / budget,
                        "met": net["RssAnon"] <= TOLERANCE * budget,
                    }
                )
                print(
                    f"  ZeRO-{stage} {dtype}: RssAnon +{net['RssAnon'] / 1e6:.0f} MB, RssFile +"
                    f"{net['RssFile'] / 1e6:.0f} MB, weights {weights / 1e6:.0f} MB + shard {largest / 1e6:.0f} MB",
                    flush=True,
                )
                shutil.rmtree(dest)
            shutil.rmtree(ckpt.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "model_config": MODELS[size],
        "max_shard_size": SHARD[size],
        "baseline": base,
        "exports": rows,
        "tolerance": TOLERANCE,
    }


def markdown(r: dict) -> str:
    mb = lambda b: f"{b / 1e6:,.0f}"  # noqa: E731
    lines = [
        f"# Export peak memory, {r['date']}",
        "",
        f"Command: `{r['command']}`",
        "",
        "| checkpoint | dtype | weights MB | largest shard MB | RssAnon MB (net) | RssFile MB (net) | "
        "VmRSS MB (total) | anon / (weights + shard) | goal met? |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e in r["exports"]:
        lines.append(
            f"| 2-rank ZeRO-{e['zero_stage']} | {e['dtype']} | {mb(e['weights_bytes'])} | "
            f"{mb(e['largest_shard_bytes'])} | {mb(e['net']['RssAnon'])} | {mb(e['net']['RssFile'])} | "
            f"{mb(e['peak']['VmRSS'])} | {e['anon_over_budget']:.2f} | {yes(e['met'])} |"
        )
    n = r["exports"][0]["num_params"]
    lines += [
        "",
        f"- Model: Llama, {json.dumps(r['model_config'])}"
        + (f", {n / 1e6:.2f}M parameters" if n else "")
        + f"; checkpoints from `train.py` on 2 ranks, 1 step; `--max_shard_size {r['max_shard_size']}`.",
        f"- Goal: net RssAnon <= {r['tolerance']:.2f} x (weights in the output dtype + one shard). Net = peak "
        f'minus the peak of `python -c "{IMPORTS}"` (RssAnon {mb(r["baseline"]["RssAnon"])} MB, '
        f"RssFile {mb(r['baseline']['RssFile'])} MB).",
        "- ZeRO-1/2: DeepSpeed's `_zero2_merge_trainable_params` concatenates the rank partitions into one "
        "fp32 vector before any dtype cast, so the anonymous peak is one fp32 copy plus a shard whatever the "
        "output dtype: bf16 exports need twice the goal. ZeRO-3's lazy mode gathers one parameter at a time.",
        "- RssFile is the memory-mapped rank files (page cache, reclaimable); it is not counted in the goal.",
        *footer(r),
    ]
    return "\n".join(lines) + "\n"


def cmd_export(args) -> int:
    result = new_report(**measure(args.quick))
    write_report(args.out_dir, f"export-{result['date']}", result, markdown(result))
    return 0


def add_parsers(sub) -> None:
    e = sub.add_parser("export", help="peak host memory of tools/export_hf.py on 2-rank ZeRO-2/3 checkpoints")
    e.add_argument("--quick", action="store_true", help="a ~7M-parameter model (for tests)")
    e.add_argument("--out-dir", default=str(REPO / "benchmarks"), help="where export-DATE.{md,json} go")
    e.set_defaults(func=cmd_export)
