"""The prepared GPU script, `tools/benchmark.py gpu`: it refuses a machine without CUDA in one line, and its
--quick run executes every part's code on the CPU (tiny shapes, fp32) into the report a GPU run writes. The
figures are a busy 2-core machine's; only their presence and signs are checked. Both run with the packages the
script must not need made absent (ABSENT) in every process they start, so an import of one fails the test
(benchmark.py imported the cleaning benchmark's ftfy, which the GPU machine lacks)."""

import json
import os
import re
import subprocess
import sys

from bench.gpu.benchmark import PARTS
from helpers import REPO

# What the GPU script does not run: the data cleaning's (ftfy, datatrove), the evaluation's, the trackers', the
# plots' and QLoRA's packages. The GPU machine lacks ftfy, datatrove, lm_eval, wandb and bitsandbytes
# (tools/gpu_kit.sh lists what it has); peft and TRL import the last two only where they are installed.
ABSENT = ("ftfy", "datatrove", "lm_eval", "tensorboard", "wandb", "matplotlib", "bitsandbytes")
# Python imports usercustomize (after tests/inject's sitecustomize) in every process: the path finder sees none
# of ABSENT, so an import fails and importlib.util.find_spec and importlib.metadata find nothing, as where none
# is installed.
USERCUSTOMIZE = """
import importlib.machinery
import sys

ABSENT = {absent!r}


class Absent:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        return None if name.split(".")[0] in ABSENT else self.finder.find_spec(name, path, target)

    def find_distributions(self, *args, **kwargs):
        for d in self.finder.find_distributions(*args, **kwargs):
            if (d.metadata["Name"] or "").lower().replace("-", "_") not in ABSENT:
                yield d

    def invalidate_caches(self):
        self.finder.invalidate_caches()


sys.meta_path[:] = [Absent(f) if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
"""


def without_absent(tmp_path) -> dict:
    """This process's environment with ABSENT made absent for every process started with it."""
    folder = tmp_path / "absent"
    folder.mkdir()
    (folder / "usercustomize.py").write_text(USERCUSTOMIZE.format(absent=ABSENT))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])))
    probe = "import importlib.metadata as m, importlib.util as u; print(u.find_spec('ftfy'), m.version('ftfy'))"
    check = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, cwd=REPO)
    assert check.returncode != 0 and "PackageNotFoundError" in check.stderr, check.stdout + check.stderr
    return env


def benchmark(env: dict, *args, timeout: int):
    """`python tools/benchmark.py ARGS`, as a user runs it, in `env`."""
    cmd = [sys.executable, "tools/benchmark.py", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_gpu_benchmark_refuses_a_machine_without_cuda_in_one_line(tmp_path):
    """(The 1B estimate it would launch is checked in-process: tests/unit/tools/test_benchmark_gpu_plan.py.)"""
    proc = benchmark(without_absent(tmp_path), "gpu", "--out-dir", "/nonexistent", timeout=120)
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "no CUDA GPU" in errors[0], proc.stderr[-2000:]


def test_gpu_benchmark_quick_runs_every_part_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    proc = benchmark(without_absent(tmp_path), "gpu", "--quick", "--out-dir", str(out), timeout=900)
    assert proc.returncode == 0, f"benchmark failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}"
    assert re.search(r"^plan: 7 parts, about \d+\.\d min on 2 CPU cores", proc.stdout, re.M), proc.stdout[:2000]
    assert all(re.search(rf"^  \d\. {re.escape(name)}: .*, ~\d+ s$", proc.stdout, re.M) for name in PARTS)
    [report] = list(out.glob("gpu-*.json"))
    r = json.loads(report.read_text())
    parts = r["parts"]
    assert list(parts) == list(PARTS) and all(x["status"] == "ok" for x in parts.values()), parts
    assert r["pending"] == [] and "Partial" not in report.with_suffix(".md").read_text()  # the last write: whole
    assert r["plan"]["total_seconds"] == sum(r["plan"]["seconds"].values()) > 0
    for name in ("ZeRO-2", "ZeRO-3", "LoRA", "MoE"):
        x = parts[name]
        assert x["tokens_per_sec"] > 0 and 0 < x["mfu"] < 1 and x["windows"] == 2, (name, x)
        assert x["peak_bytes"] > 0 and x["estimate_bytes"] > 0 and abs(x["estimate_error"]) < 1, (name, x)
    assert parts["LoRA"]["lora_line"].startswith("lora: r 16")
    assert "active per token" in parts["MoE"]["parameters"]
    shapes = parts["TP/SP/PP shapes"]["shapes"]
    full = shapes["full model"]
    assert list(shapes) == ["full model", "TP2 rank", "SP2 rank", "PP2 stage"]
    assert shapes["TP2 rank"]["heads"] * 2 == full["heads"] and shapes["TP2 rank"]["intermediate_size"] * 2 == 352
    assert shapes["SP2 rank"]["seq"] * 2 == full["seq"] and shapes["PP2 stage"]["layers"] * 2 == full["layers"]
    for name, x in shapes.items():
        assert x["tokens_per_sec"] > 0 and x["mfu"] > 0 and x["activation_peak_bytes"] > 0, (name, x)
        assert abs(x["estimate_error"]) < 0.5, (name, x)
    sft = parts["SFT vs TRL"]
    assert list(sft["runners"]) == ["train.py", "TRL SFTTrainer"]
    assert all(x["label_tokens_per_sec"] > 0 for x in sft["runners"].values()) and sft["vs_trl"]["median"] > 0
    dpo = parts["DPO 8B"]  # the recipe's flags on the tiny Llama: one epoch's reference pass, then pairs/s
    assert dpo["reference_pairs"] == 8 and dpo["reference_seconds"] > 0 and dpo["pairs_per_step"] == 2, dpo
    assert dpo["pairs_per_sec"] > 0 and dpo["peak_bytes"] > 0 and dpo["recipe"].startswith("recipes/llama-3.1-8b-")
    skipped = [x["what"] for x in r["skipped"]]
    assert "TP2, SP2 and PP2 across two GPUs" in skipped and "expert parallelism (EP2)" in skipped
    md = report.with_suffix(".md").read_text()
    assert "## Not measured here" in md and all(what in md for what in skipped)
    assert (
        "## DPO at the 8B shape" in md
        and "| ZeRO-2 | embedded tiny Llama |" in md
        and "train.py / TRL, label tokens/s" in md
    )
    assert r["machine"]["cores"] and r["versions"]["trl"]
