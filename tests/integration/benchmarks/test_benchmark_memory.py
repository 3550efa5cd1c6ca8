"""The memory and parallelism benchmarks: tools/benchmark.py lora, parallel, pipeline, longctx and estimator-preloaded --quick under the
allocator profiler, and the export benchmark's memory sampler (the GPU script: test_benchmark_gpu.py). The figures
themselves are machine-dependent; only their signs, orderings and parities are checked."""

import json
import sys

from bench.export.benchmark import peak_memory
from helpers import run_quick


def test_lora_benchmark_quick(tmp_path):
    """Full fine-tuning and LoRA of the same base, each launched once under the allocator profiler: the report's
    ratios are the ratios of its figures, and the LoRA checkpoint holds the adapter's states, not the model's."""
    report = run_quick("lora", tmp_path, timeout=600)
    assert "LoRA / full" in report.with_suffix(".md").read_text()
    r = json.loads(report.read_text())
    assert r["settings"]["lora_line"].startswith("lora: r 16, alpha 16 on all-linear; trains")
    fp32 = r["results"]["fp32"]
    full, lora, q = fp32["variants"]["full"], fp32["variants"]["lora"], fp32["ratios"]
    for key in ("tokens_per_sec", "peak_bytes", "checkpoint_bytes", "save_seconds"):
        assert full[key]["median"] > 0 and lora[key]["median"] > 0
        assert abs(q[key]["median"] - lora[key]["median"] / full[key]["median"]) < 1e-9
    # the base is frozen: no fp32 master copy, gradients or Adam moments of its weights, on disk or in memory
    assert lora["checkpoint_by_kind"]["optim_states"] < 0.2 * full["checkpoint_by_kind"]["optim_states"]
    assert lora["train_step_peak_bytes"]["max"] < full["train_step_peak_bytes"]["min"]


def test_parallel_benchmark_quick(tmp_path):
    """ZeRO-2, ZeRO-3, TP2 x ZeRO-1 (2 ranks) and TP2 x DP2 (4 ranks) each train the same global batch under
    the allocator profiler: every configuration reports tokens/s and a peak per rank, and the tensor-parallel
    ones lose exactly what ZeRO-2 loses at every step (fp32), which is what makes their speeds comparable."""
    report = run_quick("parallel", tmp_path, timeout=600)
    assert "## What the CPU ranking can and cannot say about NVLink GPUs" in report.with_suffix(".md").read_text()
    c = json.loads(report.read_text())["configs"]
    assert list(c) == ["ZeRO-2", "ZeRO-3", "TP2 x ZeRO-1", "TP2 x DP2 (ZeRO-1)"]
    assert c["TP2 x DP2 (ZeRO-1)"]["distributed_line"].startswith("distributed: 4 ranks = 2 data-parallel x 2")
    for name, x in c.items():
        assert x["tokens_per_sec"]["min"] > 0, name
        assert len(x["peak_bytes_by_rank"]) == x["ranks"] and min(x["peak_bytes_by_rank"]) > 0, name
    zero2 = c["ZeRO-2"]["losses"]
    assert len(zero2) == 3
    for name in ("TP2 x ZeRO-1", "TP2 x DP2 (ZeRO-1)"):
        assert len(c[name]["losses"]) == len(zero2)
        assert all(abs(a - b) <= 1e-5 for a, b in zip(c[name]["losses"], zero2)), (name, c[name]["losses"], zero2)
        assert c[name]["loss_parity"]


def test_pipeline_benchmark_quick(tmp_path):
    """ZeRO-1 and PP2 x ZeRO-1 train the same global batch under the allocator profiler (PP2's schedule timed
    on every rank): both report tokens/s and a peak per rank, PP2 loses exactly what ZeRO-1 loses at every
    step, and the bubble row carries the formula (p - 1) / (m + p - 1) beside a measured share of idle
    stage-time, with each stage computing its m micro-batches inside the step's span."""
    report = run_quick("pipeline", tmp_path, timeout=300)
    md = report.with_suffix(".md").read_text()
    assert "## The bubble against (p − 1) / (m + p − 1)" in md and "--module bench.pipeline.probe" in md
    r = json.loads(report.read_text())
    c = r["configs"]
    assert list(c) == ["ZeRO-1", "PP2 (ZeRO-1)"]
    assert "1 data-parallel x 2 pipeline-parallel" in c["PP2 (ZeRO-1)"]["distributed_line"]
    for name, x in c.items():
        assert x["tokens_per_sec"]["min"] > 0, name
        assert len(x["peak_bytes_by_rank"]) == 2 and min(x["peak_bytes_by_rank"]) > 0, name
    pp = c["PP2 (ZeRO-1)"]
    assert pp["loss_parity"] and len(pp["losses"]) == len(c["ZeRO-1"]["losses"]) == 3
    assert 0 < pp["vs"]["ZeRO-1"]["low"] <= pp["vs"]["ZeRO-1"]["median"] <= pp["vs"]["ZeRO-1"]["high"]
    [row] = r["bubble"]["rows"]
    m, p = row["m"], row["stages"]
    assert (m, p) == (pp["accumulation"], 2) and row["formula"] == (p - 1) / (m + p - 1)
    for value in (row["measured"]["median"], *row["by_stage"], row["expected_from_stage_times"]):
        assert 0 < value < 1, row
    assert all(t > 0 for t in row["busy_per_micro_seconds"]) and row["span_seconds"]["min"] > 0
    assert row["expected_from_stage_times"] >= row["formula"] - 1e-12  # unequal stages only add to it


def test_longctx_benchmark_quick(tmp_path):
    """ZeRO-3, the tiled loss, SP=2 and both, each launched on 2 ranks under the allocator probe at a short
    block: every run trains, its peak splits into states + activations with the loss region inside the
    activations, tiled and untiled losses agree, and the report carries the goals, the search and the plot.
    The quick search starts and ends at the sweep's block (its runs read back, no launch of its own); the
    doubling and bisection are tests/unit/tools/test_benchmark_longctx.py's."""
    report = run_quick("longctx", tmp_path, timeout=900)
    assert report.with_suffix(".png").stat().st_size > 0
    assert "## Longest sequence within" in report.with_suffix(".md").read_text()
    r = json.loads(report.read_text())
    points = r["points"]
    assert len(points) == 4
    for name, by_block in points.items():
        p = by_block["256"]
        assert p["exit_code"] == 0 and len(p["peak_bytes_by_rank"]) == 2, name
        assert 0 < p["loss_region_bytes"] <= p["activation_bytes"] < p["peak_bytes"], name
        assert p["states_bytes"] + p["activation_bytes"] <= p["peak_bytes"] * 1.01, name
    assert "2 sequence-parallel" in points["ZeRO-3 + SP2"]["256"]["distributed_line"]
    assert all(d is not None and d <= 1e-5 for d in r["loss_parity"].values()), r["loss_parity"]
    [found] = r["searches"].values()  # one budget in the quick run
    for x in found.values():
        assert x["tried"][0] == 256 and (x["shortest_failing"] is None or x["longest"] < x["shortest_failing"])
    assert set(r["goals"]) == {"sp_activation", "sp_activation_tiled", "tiled_loss_region", "longest"}
    assert list(r["longest_by_budget"].values()) == [r["goals"]["longest"]]


def test_export_benchmark_samples_the_memory_a_child_allocates():
    """`benchmark.py export` judges the goal on the child's peak anonymous memory: a child that fills 300 MB
    must read as about 300 MB more than one that allocates nothing."""

    def child(nbytes):
        return peak_memory(
            [
                sys.executable,
                "-c",
                f"import time; b = bytearray({nbytes}); b[::4096] = b'1' * len(b[::4096]); time.sleep(0.5)",
            ]
        )

    idle, busy = child(0), child(300_000_000)
    grew = busy["RssAnon"] - idle["RssAnon"]
    assert 280e6 <= grew <= 330e6, (idle, busy)
    assert busy["VmRSS"] >= busy["RssAnon"]


def test_moe_benchmark_quick_measures_zero2_zero3_and_ep2_with_equal_losses(tmp_path):
    report = run_quick("moe", tmp_path, timeout=300)
    md = report.with_suffix(".md").read_text()
    assert "active per token (4 experts, 2 per token" in md and "ds_configs/ep2.json" in md  # the GPU command
    c = json.loads(report.read_text())["configs"]
    assert list(c) == ["ZeRO-2", "ZeRO-3", "ZeRO-2 + EP2"]
    assert "experts split 2 ways" in c["ZeRO-2 + EP2"]["distributed_line"]
    for name, x in c.items():
        assert x["tokens_per_sec"]["min"] > 0, name
        assert len(x["peak_bytes_by_rank"]) == 2 and min(x["peak_bytes_by_rank"]) > 0, name
        assert x["loss_parity"] and len(x["losses"]) == 3, (name, x["losses"])


def test_estimator_preloaded_quick_measures_the_kept_weights_as_estimated(tmp_path):
    """Real ZeRO-3 on 2 ranks on a model built before deepspeed.initialize, nothing kept gathered: torch's own
    linear (DeepSpeed before 0.19.4) holds 2 bytes more of every linear weight than DeepSpeed's wrapper, to the
    byte, and the estimate's term (memory/preloaded.py) is that figure."""
    r = json.loads(run_quick("estimator-preloaded", tmp_path, timeout=600).read_text())
    [row] = r["rows"]
    assert row["torch"] - row["wrapped"] == 2 * row["linear_params"] == row["estimated"]
