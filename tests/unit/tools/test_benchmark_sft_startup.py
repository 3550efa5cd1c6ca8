"""The SFT benchmark's start-up breakdown as `benchmark.py sft --quick` takes it (tools/bench/sft/startup.py and
startup_probe.py): its one round's train.py and TRL launches traced and left running past their first step, instead
of two more launches stopped there. What the launch itself proves is in
tests/integration/benchmarks/test_benchmark_speed.py::test_sft_benchmark_quick."""

import json
from pathlib import Path

from bench.sft import benchmark as sft, startup, startup_probe


def test_a_traced_command_puts_the_probe_before_the_runner_module_and_leaves_the_rest():
    cmd = ["python", "-m", "deepspeed.launcher.runner", "--master_port", "1", "--module", "bench.sft.train_run", "--x"]
    out = startup.traced(cmd, Path("/o"))
    assert out == cmd[:6] + ["bench.sft.startup_probe", "--startup_out", "/o/startup", "bench.sft.train_run", "--x"]
    going = startup.traced(cmd, Path("/o"), keep_going=True)
    assert going[6:9] == ["bench.sft.startup_probe", "--startup_keep_going", "--startup_out"]
    assert cmd[-2:] == ["bench.sft.train_run", "--x"]  # the caller's list untouched


def test_a_trace_that_keeps_going_writes_its_record_and_returns(tmp_path):
    """Without keep_going the rank ends itself (os._exit) once the record is written; with it, write returns and
    the run goes on. No process group here: the record is rank 0's."""
    trace = startup_probe.Trace(str(tmp_path / "startup"), keep_going=True)
    trace.phases["first step"] = 0.5
    trace.imports["torch"] = 1.0
    trace.write(engine=None)  # returns: the test goes on
    record = json.loads((tmp_path / "startup.rank0.json").read_text())
    assert record["rank"] == 0 and record["phases"]["first step"] == 0.5 and record["imports"] == {"torch": 1.0}
    assert record["time_to_first_step"] > 0 and startup.read(tmp_path)["imports"] == {"torch": 1.0}


def test_the_quick_report_names_the_round_launches_as_the_traced_ones():
    x = {"time_to_first_step": 9.0, "imports": {"torch": 2.0}, "phases": {"data": 0.1}, "other": 1.0}
    breakdown = {"train.py, cold": x, "TRL SFTTrainer, cold": {**x, "time_to_first_step": 12.0}}
    quick = "\n".join(startup.markdown(breakdown, rounds_traced=True))
    assert "the round's train.py and TRL launches above, traced" in quick and "| | train.py, cold |" in quick
    assert "a little slower than the rounds above" in "\n".join(startup.markdown(breakdown))
    first = {"median": 0.75, "low": 0.75, "high": 0.75, "half_width": 0.0, "pairs": 1}
    r = {
        "settings": dict(sft.QUICK, quick=True),
        "data": {"length_percentiles": {5: 20, 100: 200}, "mean_length": 100.0, "tokens": 1000},
        "ratios": {k: first for k in ("vs_trl", "vs_hf", "sft_vs_text", "first_step_traced_vs_trl")},
        "runners": {
            name: {
                "label_tokens_per_sec": 100.0,
                "real_tokens_per_sec": 300.0,
                "padding_share": 0.0,
                "steps": 3,
                "trained_tokens": 300,
                "epoch_seconds": 3.0,
                "first_step_cold": 9.0,
                "first_step_cached": None,
                "max_rss_gib": [1.0, 1.0],
                "eval_loss": None,
            }
            for name in sft.RUNNERS
        },
        "startup": breakdown,
        "startup_pairs": [[9.0, 12.0]],
        "date": "2026-12-05",
        "command": "python tools/benchmark.py sft --quick",
        "versions": {"torch": "x"},
        "machine": {"cpu": "cpu", "cores": 2, "cores_usable": 2, "ram_gib": 1.0, "gpus": []},
    }
    page = sft.markdown(r)
    assert "| cold time to first step, train.py / TRL, the round's traced launches | 0.750" in page
    assert "stopped at the first step" not in page
