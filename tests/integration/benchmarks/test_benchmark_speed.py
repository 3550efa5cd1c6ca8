"""The speed benchmarks against the neighbours: tools/benchmark.py data, train and sft --quick run end to end on
the real pipelines (train.py, run_clm.py, the HF Trainer, TRL) and write their reports. The figures themselves
are machine-dependent; only their signs and orderings are checked. (The memory benchmarks are in
test_benchmark_memory.py: two files, so that pytest-xdist runs them on both workers.)"""

import json
import os
import signal
import statistics
import subprocess
import sys
import time

import pytest

from bench import common, host_load
from helpers import run_quick, tool_in_process


def test_data_benchmark_quick(tmp_path):
    """One corpus copy and one A/B pair: train.py's data preparation and run_clm.py's both tokenise the same
    corpus, train.py starts cold and cached, and packing is measured with and without; the report carries
    every section with the right signs."""
    report = run_quick("data", tmp_path, timeout=600)
    assert report.with_suffix(".md").exists()
    r = json.loads(report.read_text())
    prep, first, packing = r["prep"], r["time_to_first_step"], r["packing"]
    assert prep["ours"]["tokens_per_sec"] > 0 and prep["run_clm"]["tokens_per_sec"] > 0
    assert prep["ours"]["tokens"] >= prep["run_clm"]["tokens"]  # ours drops only the final tail
    assert packing["with_packing"]["utilisation"] > packing["without_packing"]["utilisation"]
    assert first["cold_seconds"] > 0 and first["cached_seconds"] > 0
    assert r["versions"]["deepspeed"] and r["machine"]["cores"] > 0


def test_train_speed_benchmark_quick(tmp_path):
    """train.py, the HF Trainer and the bare DeepSpeed loop all train the same tiny workload through the
    launcher, and the report's ratios are the medians of the window-paired ratios, inside their intervals.
    (--quick leaves out the compiled runner, train.py with one flag: its column says so.)"""
    report = run_quick("train", tmp_path, timeout=900)
    m = json.loads(report.read_text())["models"]["tiny"]
    t = m["tokens_per_sec"]
    assert set(t) == {"train.py", "HF Trainer", "bare DeepSpeed loop"} and "compiled_vs_hf_trainer" not in m
    assert "| not run |" in report.with_suffix(".md").read_text()
    for runner in t.values():
        assert runner["windows"] == 2 and 0 < runner["min"] <= runner["median"] <= runner["max"]
    [one_round] = m["rounds"]
    for key, a, b in (("vs_hf_trainer", "train.py", "HF Trainer"), ("vs_bare_loop", "train.py", "bare DeepSpeed loop")):
        pairs = [x / y for x, y in zip(one_round[a], one_round[b])]
        r = m[key]
        assert r["pairs"] == 2 and abs(r["median"] - statistics.median(pairs)) < 1e-9
        assert min(pairs) - 1e-9 <= r["low"] <= r["median"] <= r["high"] <= max(pairs) + 1e-9


def test_sft_benchmark_quick(tmp_path):
    """train.py, TRL's SFTTrainer and the HF Trainer each fine-tune on the same generated conversations for one
    epoch through the launcher: each trains about the same label tokens (whole conversations, nothing dropped),
    padding only where its batching pads, and the same held-out scorer sees a loss below the untrained ~8.3."""
    report = run_quick("sft", tmp_path, timeout=900)
    r = json.loads(report.read_text())
    runners = r["runners"]
    assert set(runners) == {"train.py", "TRL SFTTrainer", "HF Trainer", "train.py, text"}
    trained = {k: runners[k]["trained_tokens"] for k in ("train.py", "TRL SFTTrainer", "HF Trainer")}
    assert max(trained.values()) < 1.1 * min(trained.values()), trained  # one epoch of the same conversations
    assert runners["TRL SFTTrainer"]["padding_share"] == 0  # padding-free rows
    assert 0 < runners["HF Trainer"]["padding_share"] < 0.5 and 0 < runners["train.py"]["padding_share"] < 0.1
    for name in trained:
        x = runners[name]
        assert x["label_tokens_per_sec"] > 0 and x["real_tokens_per_sec"] > x["label_tokens_per_sec"]
        assert 0 < x["eval_loss"] < 8.0 and x["first_step_cold"] > 0 and min(x["max_rss_gib"]) > 0.1
    for ratio in r["ratios"].values():
        assert ratio["low"] <= ratio["median"] <= ratio["high"]
    assert "train.py / TRL SFTTrainer, label tokens/s" in report.with_suffix(".md").read_text()
    # the start-up breakdown (bench/sft/startup_probe.py), taken in the round's own train.py and TRL launches (traced,
    # run on to their end): each phase found in both runners, nothing counted twice, and train.py importing none of
    # what it does not use
    startup = r["startup"]
    assert set(startup) == {"train.py, cold", "TRL SFTTrainer, cold"}
    for name, x in startup.items():
        for phase in ("process group", "tokenizer", "data", "model build", "deepspeed.initialize", "first step"):
            assert x["phases"].get(phase, 0) > 0, (name, phase, x["phases"])
        assert x["imports"]["torch"] > 0.3 and x["imports"]["transformers"] > 0.3, (name, x["imports"])
        assert x["other"] >= 0, (name, x)  # the parts sum to no more than the whole
    assert startup["TRL SFTTrainer, cold"]["imports"].get("trl", 0) > 0
    assert not {"trl", "peft", "bitsandbytes", "lm_eval", "datatrove", "matplotlib", "ray"} & set(
        startup["train.py, cold"]["imports"]
    )
    # the goal's ratio on traced pairs: --quick has the breakdown's one, the same launches' first-step times, which the
    # runners' own probes time too (process start to the first step's end)
    traced = r["ratios"]["first_step_traced_vs_trl"]
    ours, trl = (startup[f"{n}, cold"]["time_to_first_step"] for n in ("train.py", "TRL SFTTrainer"))
    assert traced["pairs"] == 1 and traced["median"] == pytest.approx(ours / trl)
    for name in ("train.py", "TRL SFTTrainer"):
        probed, traced_first = runners[name]["first_step_cold"], startup[f"{name}, cold"]["time_to_first_step"]
        assert abs(probed - traced_first) < 0.25 * probed, (name, probed, traced_first)
    page = report.with_suffix(".md").read_text()
    assert "cold time to first step, train.py / TRL, the round's traced launches" in page
    assert "Where the time to first step goes" in page and "| | train.py, cold | TRL SFTTrainer, cold |" in page


def test_profile_benchmark_quick(tmp_path):
    """train.py and the HF Trainer, profiled on the same tiny workload (--quick leaves out train.py's per-tensor
    AdamW runner, the same module with one flag): the engine's forward, backward and step are found in every
    runner, the collectives and the optimizer's step inside them, and the parts do not add up to more than the
    step."""
    report = run_quick("profile", tmp_path, timeout=600)
    r = json.loads(report.read_text())["runners"]
    assert list(r) == ["train.py", "HF Trainer"]
    for name, x in r.items():
        assert x["steps"] == 4 and min(x["forward"], x["backward"], x["step"], x["collectives"]) > 0, (name, x)
        assert 0 < x["optimizer"] < x["step"], (name, x)
        assert x["forward"] + x["backward"] + x["step"] <= x["step_wall"] and x["outside_engine"] >= 0, (name, x)
        assert "phase:backward" in x["op_table"], name  # rank 0's op table, for reading where the time goes


def test_a_timed_benchmark_refuses_a_busy_host_and_a_loaded_report_says_so(tmp_path):
    """Another job taking a core: a timed benchmark refuses to start (one line naming who, and the override), and
    a report written while it runs says the host was loaded (tools/bench/host_load.py).
    The busy process is orphaned, so it is not this process's child: the benchmark's own ranks never count."""
    pid = int(
        subprocess.check_output(["sh", "-c", f"{sys.executable} -c 'while True: pass' >/dev/null 2>&1 & echo $!"])
    )
    try:
        proc = tool_in_process("benchmark", "train", "--model", "100M", "--out-dir", tmp_path)
        [line] = proc.stderr.splitlines()
        assert proc.returncode == 2 and line.startswith("error: the host is busy: other processes use"), proc.stderr
        assert "python" in line and "--allow-loaded" in line and not list(tmp_path.iterdir())
        host_load.start(allowed_loaded=True)
        time.sleep(1.5)
        r = common.new_report()
        assert r["host"]["loaded"] and r["host"]["others_cores_max"] > 0.5 and r["host"]["allowed_loaded"]
        assert any("**Loaded host" in x for x in common.footer(r))
    finally:
        os.kill(pid, signal.SIGKILL)
        host_load.stop()
    # a quiet run's line (not sampled here: under pytest-xdist the other worker is busy, and not this one's child)
    quiet = {**r["host"], "loaded": False, "busy_samples": 0, "others_cores_mean": 0.0, "others_cores_max": 0.01}
    assert host_load.footer_line(quiet).startswith("- Quiet host: other processes used 0.00 cores on average")
