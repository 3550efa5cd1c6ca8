"""`tools/benchmark.py dpo --quick`: train.py's DPO, TRL's DPOTrainer with a live reference model and with
precomputed reference log-probs each train one epoch of the same 8 generated pairs under ZeRO-3 on 2 ranks through
the launcher, and the report carries what a user reads. The figures are a busy 2-core machine's: their presence,
counts and signs are checked, not speed."""

import json

import pytest

from helpers import run_quick

RUNNERS = {"train.py", "TRL live reference", "TRL precomputed reference"}


def test_dpo_benchmark_quick(tmp_path):
    report = run_quick("dpo", tmp_path, timeout=600)
    r = json.loads(report.read_text())
    d, [(stage, x)] = r["data"], r["stages"].items()
    assert stage == "zero3" and set(x["runners"]) == RUNNERS
    pairs = r["settings"]["pairs"]
    for name, v in x["runners"].items():
        assert v["pairs"] == pairs and v["steps"] == 2, (name, v)  # one epoch, every pair, 2 pairs x 2 ranks a step
        assert v["pairs_per_sec"] > 0 and v["time_to_first_step"] > 0 and min(v["max_rss_gib"]) > 0.1, (name, v)
        assert v["reference_seconds"] > 0 and 0 < v["reference_share"] < 1, (name, v)
    ours = x["runners"]["train.py"]
    assert ours["padding_share"] == 0 and ours["computed_tokens"] == d["pair_tokens"]  # each prompt once, no padding
    for name in RUNNERS - {"train.py"}:  # each prompt twice, padded to the batch's longest side
        v = x["runners"][name]
        assert v["computed_tokens"] > d["side_tokens"] > d["pair_tokens"] and 0 < v["padding_share"] < 0.5, (name, v)
    assert set(x["ratios"]) == {f"{k}_{p}" for k in ("vs_trl", "memory_vs_trl", "first_step_vs_trl")
                                for p in ("live", "precompute")}  # fmt: skip
    for name, q in x["ratios"].items():
        assert 0 < q["low"] <= q["median"] <= q["high"], (name, q)
    assert x["ratios"]["vs_trl_live"]["median"] == pytest.approx(
        ours["pairs_per_sec"] / x["runners"]["TRL live reference"]["pairs_per_sec"]
    )
    page = report.with_suffix(".md").read_text()
    for line in ("| TRL live: pairs/s |", "| TRL precompute: peak RSS |", "| TRL live: time to first step |"):
        assert line in page
