"""Helpers that run train.py for real: the real launchers, real DeepSpeed, 2 CPU ranks."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Small, fast settings shared by the training tests: the embedded model and corpus, 64-token blocks.
FAST = ["--max_steps", "8", "--block_size", "64", "--per_device_train_batch_size", "4",
        "--logging_steps", "1", "--eval_steps", "0", "--save_steps", "0", "--learning_rate", "3e-3",
        "--warmup_steps", "1", "--max_eval_batches", "4"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Run:
    proc: subprocess.CompletedProcess
    output_dir: Path

    @property
    def records(self) -> list[dict]:
        path = self.output_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.records if "loss" in r]

    @property
    def log(self) -> str:
        return self.proc.stdout + self.proc.stderr

    def check(self) -> "Run":
        assert self.proc.returncode == 0, f"train.py failed ({self.proc.returncode}):\n{self.log[-6000:]}"
        return self


def launch(args: list[str], output_dir: Path, nproc: int = 2, launcher: str = "deepspeed",
           timeout: int = 600, env: dict | None = None) -> Run:
    port = str(free_port())
    if launcher == "deepspeed":
        cmd = ["deepspeed", "--num_gpus", str(nproc), "--master_port", port, "train.py"]
    elif launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", port,
               "train.py"]
    elif launcher == "python":
        cmd = [sys.executable, "train.py"]
    else:
        raise ValueError(launcher)
    full_env = dict(os.environ)
    full_env.pop("OMP_NUM_THREADS", None)  # as under the deepspeed launcher: train.py must set it
    full_env.update(env or {})
    proc = subprocess.run(cmd + list(args) + ["--output_dir", str(output_dir)], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    return Run(proc, Path(output_dir))


@pytest.fixture(scope="session", autouse=True)
def shared_cache(tmp_path_factory):
    """One embedded corpus/tokenizer/blocks cache for the session (train.py builds it on first use)."""
    cache = tmp_path_factory.mktemp("zero-recipes-cache")
    os.environ["ZERO_RECIPES_CACHE"] = str(cache)
    return cache
