"""`tools/benchmark.py lora`'s arithmetic, without a launcher: the LoRA / full ratios and their ranges, the
checkpoint's size and save time read from its files, and the per-phase peak from real allocator events."""

import os

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from bench.lora.benchmark import checkpoint_files, markdown, summarise
from bench.runners.profiled_train import peaks


def run(windows, ckpt_bytes, save_s, rss=1.0):
    return {
        "tokens_per_sec_windows": windows,
        "cpu_rss_gb_rank0": rss,
        "checkpoint": {
            "bytes": ckpt_bytes,
            "by_kind": {"model_states": ckpt_bytes, "optim_states": 0, "other": 0},
            "save_seconds": save_s,
        },
        "lora_line": None,
    }


def probe(peak, step_peak, save_peak, save_s):
    return {
        "peak_bytes": peak,
        "phase_peak_bytes": {"train_step": step_peak, "save": save_peak},
        "save_seconds": save_s,
    }


def raw():
    full = {
        "timed": [run([1.0, 100.0, 110.0], 4000, 2.0), run([1.0, 90.0, 100.0], 4000, 4.0)],
        "profiled": {
            **run([1.0, 50.0], 4000, 3.0),
            "ranks": [probe(1000, 900, 800, [3.0]), probe(1200, 1200, 700, [3.5])],
        },
    }
    lora = {
        "timed": [run([2.0, 150.0, 160.0], 100, 0.5), run([2.0, 140.0, 150.0], 100, 0.25)],
        "profiled": {**run([2.0, 70.0], 100, 0.4), "ranks": [probe(400, 400, 100, [0.3]), probe(500, 450, 90, [0.2])]},
    }
    return {"fp32": {"full": full, "lora": lora}}


def test_ratios_are_of_medians_over_steady_windows_with_the_widest_range():
    s = summarise(raw())["fp32"]
    full, lora, q = s["variants"]["full"], s["variants"]["lora"], s["ratios"]
    # the first window of each run (warm-up) is left out; the profiled run's windows are not timed ones
    assert full["tokens_per_sec"] == {"median": 100.0, "min": 90.0, "max": 110.0, "n": 4}
    assert lora["tokens_per_sec"] == {"median": 150.0, "min": 140.0, "max": 160.0, "n": 4}
    assert q["tokens_per_sec"] == pytest.approx({"median": 1.5, "min": 140 / 110, "max": 160 / 90})
    # peaks: one per rank of the profiled run
    assert full["peak_bytes"] == {"median": 1100.0, "min": 1000, "max": 1200, "n": 2}
    assert q["peak_bytes"] == pytest.approx({"median": 450 / 1100, "min": 400 / 1200, "max": 500 / 1000})
    assert q["train_step_peak_bytes"]["median"] == pytest.approx(425 / 1050)
    assert q["checkpoint_bytes"] == pytest.approx({"median": 0.025, "min": 0.025, "max": 0.025})
    assert q["save_seconds"] == pytest.approx({"median": 0.375 / 3.0, "min": 0.25 / 4.0, "max": 0.5 / 2.0})
    assert full["save_seconds_profiled"]["median"] == 3.0  # rank 0's own timing: the save ends on a barrier


def test_without_timed_rounds_the_profiled_run_stands_in():
    r = raw()
    for v in r["fp32"].values():
        v["timed"] = []
    s = summarise(r)["fp32"]
    assert s["variants"]["full"]["tokens_per_sec"]["n"] == 1
    assert s["ratios"]["tokens_per_sec"]["median"] == pytest.approx(70 / 50)


def test_report_states_each_ratio():
    summary = summarise(raw())
    settings = dict(model="m", lora="--lora_r 16", ranks=2, block_size=8, micro_batch=1, global_batch=2, steps=3)
    settings.update(window_steps=1, rounds=2, wall_seconds=60.0, lora_line="lora: r 16")
    r = {
        "date": "2026-11-30",
        "command": "python tools/benchmark.py lora",
        "settings": settings,
        "results": summary,
        "machine": {"cpu": "x", "cores": 2, "cores_usable": 2, "ram_gib": 1.0, "gpus": []},
        "versions": {"torch": torch.__version__},
    }
    md = markdown(r)
    assert "fp32: tokens/s 1.50×, peak memory 0.41×, checkpoint 0.0250×, save time 0.125×" in md
    assert "| tokens/s (steady windows) | 100 | 90–110 | 4 | 150 | 140–160 | 4 | 1.5000 | 1.2727–1.7778 |" in md
    assert "shared machine" in md
    assert "full 3.00 s from the files' timestamps, 3.00 s around Checkpointer.save" in md


def test_checkpoint_size_and_save_time_come_from_its_files(tmp_path):
    """Size: every file under the step directory; save time: first rng_state file to the newest file."""
    step = tmp_path / "step-9"
    (step / "hf").mkdir(parents=True)
    files = {
        "rng_state_0.pt": (10, 100.0),
        "rng_state_1.pt": (10, 100.5),
        "hf/tokenizer.json": (30, 101.0),
        "mp_rank_00_model_states.pt": (1000, 104.0),
        "zero_pp_rank_0_mp_rank_00_optim_states.pt": (3000, 106.25),
        "zero_pp_rank_1_mp_rank_00_optim_states.pt": (3000, 105.0),
    }
    for name, (size, mtime) in files.items():
        (step / name).write_bytes(b"x" * size)
        os.utime(step / name, ns=(int(mtime * 1e9), int(mtime * 1e9)))
    c = checkpoint_files(step)
    assert c["bytes"] == 7050
    assert c["by_kind"] == {"model_states": 1000, "optim_states": 6000, "other": 50}
    assert c["save_seconds"] == pytest.approx(6.25)


def test_phase_peaks_from_real_allocator_events():
    """The running sum of torch's CPU allocator events: the whole run's peak, and the peak inside each marked
    phase, which counts what was already live when the phase began."""
    mib = 2**20
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        a = torch.empty(4 * mib, dtype=torch.uint8)
        with record_function("phase:train_step"):
            b = torch.empty(8 * mib, dtype=torch.uint8)
            del b
        with record_function("phase:save"):
            c = torch.empty(2 * mib, dtype=torch.uint8)
            del c
        del a
    p = peaks(prof)
    assert p["peak_bytes"] == 12 * mib
    assert p["phase_peak_bytes"] == {"train_step": 12 * mib, "save": 6 * mib}
    assert p["end_bytes"] == 0


def test_a_free_on_another_thread_is_counted():
    """gloo frees its collectives' copies on its worker threads, which the profiler does not record: the probe
    reads the allocator's own count (`count_every_thread`), so memory freed there is not counted as live. The
    profiler's own events miss that free, and their sum stays 8 MiB high."""
    import threading

    from zero_recipes.memory.probe import count_every_thread

    mib = 2**20
    was = count_every_thread()
    held = []
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            held.append(torch.empty(8 * mib, dtype=torch.uint8))
            worker = threading.Thread(target=held.clear)  # the last reference dropped on another thread
            worker.start()
            worker.join()
            with record_function("phase:train_step"):
                after = torch.empty(1 * mib, dtype=torch.uint8)
            del after
    finally:
        count_every_thread(was)
    p = peaks(prof)
    assert p["phase_peak_bytes"]["train_step"] == 1 * mib
    assert p["peak_bytes"] == 8 * mib and p["end_bytes"] == 0
    events = [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    assert sum(events) == 8 * mib  # what summing the events' sizes, the old reading, gave
