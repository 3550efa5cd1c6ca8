"""zero_recipes/memory/probe.py measures the CPU allocator on CPU batches: where DeepSpeed's accelerator is a GPU
it refuses in one line, before any process group or model, instead of feeding CPU batches to a CUDA engine.
DS_ACCELERATOR=cuda states the accelerator on this CPU-only machine (DeepSpeed names it without touching a GPU)."""

import os
import subprocess
import sys

from helpers import REPO


def test_the_memory_probe_refuses_a_gpu_accelerator_in_one_line(tmp_path):
    out = tmp_path / "probe.json"
    cmd = [sys.executable, "-m", "zero_recipes.memory.probe", "--deepspeed", "ds_configs/zero2.json"]
    env = dict(os.environ, DS_ACCELERATOR="cuda")
    proc = subprocess.run(
        cmd + ["--probe_out", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[-1].startswith("error: the memory probe measures the CPU accelerator's memory"), lines
    assert "accelerator here is cuda" in lines[-1] and "DS_ACCELERATOR=cpu" in lines[-1] and "mem_peak_gb" in lines[-1]
    assert not out.exists()
