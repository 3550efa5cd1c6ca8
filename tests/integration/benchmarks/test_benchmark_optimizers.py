"""tools/benchmark.py optimizers --quick: Muon against AdamW through the real launcher (ZeRO-3, 2 ranks, tiny model,
5 steps), and the allocator probe's optimizer state bytes for each."""

import json

from helpers import run_quick


def test_optimizers_benchmark_quick(tmp_path):
    """Both optimizers train the same steps on the same rows (their first step's loss is the same: the same init and
    batch), Muon's optimizer states take fewer bytes than AdamW's, and the report gives the paired tokens/s ratio
    with its interval and what the rest of the host did meanwhile (bench/host_load.py)."""
    report = run_quick("optimizers", tmp_path, timeout=600)
    r = json.loads(report.read_text())
    m = r["models"]["tiny"]
    assert m["steps"]["AdamW"] == m["steps"]["Muon"] == list(range(1, m["settings"]["steps"] + 1))
    by_step = {k: v["by_step"] for k, v in m["loss"].items()}
    assert abs(by_step["AdamW"][0] - by_step["Muon"][0]) < 1e-4  # before any update: the same model and batch
    assert by_step["AdamW"][1:] != by_step["Muon"][1:]  # then the optimizers differ
    mem = m["memory"]
    assert 0 < mem["Muon"]["state_bytes"] < mem["AdamW"]["state_bytes"], mem
    assert mem["AdamW"]["state_bytes"] >= 8 * mem["AdamW"]["num_params"] * 0.99  # Adam: two fp32 moments
    ratio = m["muon_vs_adamw_tokens_per_sec"]
    assert ratio["low"] <= ratio["median"] <= ratio["high"] and ratio["pairs"] >= 1
    text = report.with_suffix(".md").read_text()
    assert r["host"]["samples"] >= 1 and ("- Quiet host:" in text or "- **Loaded host" in text)
    assert "What a CPU can and cannot show about Muon" in text
    assert f"({ratio['low']:.3f}–{ratio['high']:.3f}" in text
