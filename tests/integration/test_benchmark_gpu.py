"""The prepared GPU script, `tools/benchmark.py gpu`: it refuses a machine without CUDA in one line, and its
--quick run executes every part's code on the CPU (tiny shapes, fp32) into the report a GPU run writes. The
figures are a busy 2-core machine's; only their presence and signs are checked."""

import json
import re

from bench.gpu import PARTS
from bench.gpu_parts import CONFIGS, FULL, LLAMA_1B, predicted, train_flags
from helpers import benchmark


def test_gpu_benchmark_refuses_a_machine_without_cuda_and_its_1b_estimate_fits_an_h200():
    proc = benchmark("gpu", "--out-dir", "/nonexistent", timeout=120)
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "no CUDA GPU" in errors[0], proc.stderr[-2000:]
    # the CPU accelerator's one pool counts what a GPU run keeps on the host too: more than the GPU's share
    est = predicted(train_flags(FULL, CONFIGS["zero2"], LLAMA_1B, FULL["block"], FULL["micro"]))
    assert 2.5e9 < est["estimate_bytes"] < 139 * 2**30


def test_gpu_benchmark_quick_runs_every_part_on_the_cpu(tmp_path):
    proc = benchmark("gpu", "--quick", "--out-dir", str(tmp_path), timeout=900)
    assert proc.returncode == 0, f"benchmark failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}"
    assert re.search(r"^plan: 6 parts, about \d+\.\d min on 2 CPU cores", proc.stdout, re.M), proc.stdout[:2000]
    assert all(re.search(rf"^  \d\. {re.escape(name)}: .*, ~\d+ s$", proc.stdout, re.M) for name in PARTS)
    [report] = list(tmp_path.glob("gpu-*.json"))
    r = json.loads(report.read_text())
    parts = r["parts"]
    assert list(parts) == list(PARTS) and all(x["status"] == "ok" for x in parts.values()), parts
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
    skipped = [x["what"] for x in r["skipped"]]
    assert "TP2, SP2 and PP2 across two GPUs" in skipped and "expert parallelism (EP2)" in skipped
    md = report.with_suffix(".md").read_text()
    assert "## Not measured here" in md and all(what in md for what in skipped)
    assert "| ZeRO-2 | embedded tiny Llama |" in md and "train.py / TRL, label tokens/s" in md
    assert r["machine"]["cores"] and r["versions"]["trl"]
