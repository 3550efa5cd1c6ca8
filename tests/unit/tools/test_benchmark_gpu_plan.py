"""The GPU benchmark's plan and bookkeeping, without a GPU and without launching anything: its time plan on one
H200, the report written as each part ends (a run killed at the device's command limit keeps what finished),
train.py's plan accepting every GPU shape it launches, and benchmark.py importing only the command it runs.
The parts themselves run in tests/integration/benchmarks/test_benchmark_gpu.py."""

import argparse
import json
import shlex

import benchmark
import pytest

from bench.gpu import benchmark as gpu, parts as gpu_parts
from bench.moe import benchmark as moe
from zero_recipes.plan import RunPlan


def test_the_full_run_plans_under_8_minutes_most_valuable_parts_first():
    est = gpu.seconds_of(quick=False)
    assert sum(est.values()) + gpu.OVERHEAD <= gpu.LIMIT == 480
    assert gpu.BUDGET + gpu.OVERHEAD <= gpu.LIMIT  # the budget's end, whatever the parts take
    order = ["ZeRO-2", "TP/SP/PP shapes", "LoRA", "SFT vs TRL", "MoE", "DPO 8B", "ZeRO-3"]
    assert list(gpu.PARTS) == order  # LoRA trains from ZeRO-2's export: it runs after it
    # a part that hangs stops at 3x its estimate: the longest one cannot take the rest of the lease
    assert max(est.values()) * gpu.TIMEOUT_FACTOR < 600


def test_the_report_is_on_disk_before_the_next_part_runs(tmp_path, monkeypatch):
    seen = {}

    def first(s, tmp, timeout):
        return {"figure": 1}

    def second(s, tmp, timeout):  # what a kill during this part would leave
        seen["json"] = json.loads(next(tmp_path.glob("gpu-*.json")).read_text())
        seen["md"] = next(tmp_path.glob("gpu-*.md")).read_text()
        raise RuntimeError("the device's command limit")

    monkeypatch.setattr(gpu, "PARTS", {"one": ("the first", 1, 1, first), "two": ("the second", 1, 1, second)})
    args = argparse.Namespace(quick=True, out_dir=str(tmp_path), budget=gpu.BUDGET)
    assert gpu.cmd_gpu(args) == 1  # the second part failed
    assert seen["json"]["parts"]["one"] == {"status": "ok", "figure": 1, "seconds": pytest.approx(0, abs=5)}
    assert seen["json"]["pending"] == ["two"] and "not finished (still running, or killed): two" in seen["md"]
    final = json.loads(next(tmp_path.glob("gpu-*.json")).read_text())
    assert final["pending"] == [] and final["parts"]["two"]["status"] == "failed"
    assert "the device's command limit" in final["parts"]["two"]["error"]
    assert "Partial" not in next(tmp_path.glob("gpu-*.md")).read_text()


@pytest.mark.parametrize(
    "name, model, block, micro",
    [
        ("dense 1B", gpu_parts.LLAMA_1B, gpu_parts.FULL["block"], gpu_parts.FULL["micro"]),
        ("MoE", gpu_parts.FULL["moe_model"], gpu_parts.FULL["moe_block"], gpu_parts.FULL["moe_micro"]),
    ],
)
def test_train_py_plans_every_gpu_launch_and_its_estimate_fits_an_h200(name, model, block, micro):
    for config in gpu_parts.CONFIGS:
        argv = gpu_parts.train_flags(gpu_parts.FULL, gpu_parts.CONFIGS[config], model, block, micro)
        assert RunPlan.from_args(argv + ["--dry_run", "true"]).cfg.block_size == block  # what --dry_run plans
        assert 1e9 < gpu_parts.predicted(argv)["estimate_bytes"] < 139 * 2**30, (name, config)


def test_the_1b_zero2_estimate_without_cuda_counts_the_hosts_share_too():
    """The CPU accelerator's one pool counts what a GPU run keeps on the host too: more than the GPU's share, and
    still within an H200."""
    full = gpu_parts.FULL
    argv = gpu_parts.train_flags(full, gpu_parts.CONFIGS["zero2"], gpu_parts.LLAMA_1B, full["block"], full["micro"])
    assert 2.5e9 < gpu_parts.predicted(argv)["estimate_bytes"] < 139 * 2**30


def test_the_moe_benchmarks_gpu_commands_are_plannable():
    for line in moe.gpu_commands(moe.SIZES["gpu"]):
        argv = shlex.split(line)
        RunPlan.from_args(argv[argv.index("train.py") + 1 :] + ["--dry_run", "true"])  # refused before: 2048 > 1024


def test_benchmark_py_imports_only_the_command_it_runs():
    assert benchmark.modules_for(["gpu", "--quick"]) == ["gpu.benchmark"]
    assert benchmark.modules_for(["--help"]) == list(dict.fromkeys(benchmark.COMMANDS.values()))
    for module in set(benchmark.COMMANDS.values()):  # the table names each module's own subcommands
        sub = argparse.ArgumentParser().add_subparsers()
        __import__(f"bench.{module}", fromlist=["add_parsers"]).add_parsers(sub)
        assert {c for c, m in benchmark.COMMANDS.items() if m == module} == set(sub.choices), module
