"""Where a training step's wall time goes, measured the same way for every runner: torch.profiler over the
steady steps, with DeepSpeed's engine calls marked.

    PYTHONPATH=tools deepspeed --num_gpus 2 --module bench.runners.phases <train.py flags> --phases_out p.json \
        [--window 3]

runs train.py's own main(); tools/bench/runners/hf_trainer_run.py takes the same --phases_out. Both runners drive the
same DeepSpeedEngine, so its `forward`, `backward` and `step` are marked at the class (record_function), which
every caller goes through: train.py's runner and accelerate's wrapper alike. The profile covers the steps after
the first window (warm-up) and is split into:

- forward, backward, step: the engine's calls, wall time;
- collectives: time with a collective in flight (gloo's/NCCL's own events, `c10d::` ops), inside backward and
  step: ZeRO-2's gradient reduce in backward and its parameter all-gather after the optimizer;
- optimizer: the torch optimizer's own step (`Optimizer.step#...`, recorded by torch), inside the engine's step;
- outside the engine: the rest of the step's wall time (data, loss read-back, logging, callbacks).
"""

from __future__ import annotations

import functools
import json
import runpy
import sys
import time
from pathlib import Path

from ..common import REPO
from .workload import pop_flag

ENGINE_CALLS = ("forward", "backward", "step")


def mark_engine_calls() -> None:
    """DeepSpeedEngine.forward/backward/step, each inside record_function("phase:<name>")."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from torch.profiler import record_function

    for name in ENGINE_CALLS:
        original = getattr(DeepSpeedEngine, name)

        @functools.wraps(original)
        def marked(self, *args, _original=original, _label=f"phase:{name}", **kwargs):
            with record_function(_label):
                return _original(self, *args, **kwargs)

        setattr(DeepSpeedEngine, name, marked)


def split(events, steps: int, seconds: float) -> dict:
    """Mean seconds per step of each phase, from the profiler's events (microseconds)."""
    total = dict.fromkeys((*ENGINE_CALLS, "collectives", "optimizer"), 0.0)
    comm = []
    for e in events:
        if e.name.startswith("phase:"):
            total[e.name[6:]] += e.time_range.elapsed_us()
        elif e.name.startswith("Optimizer.step#"):
            total["optimizer"] += e.time_range.elapsed_us()
        elif e.name.startswith(("c10d::", "gloo:", "nccl:")):
            comm.append((e.time_range.start, e.time_range.end))
    end = 0  # collectives nest and run on the backend's threads: count the time any is in flight once
    for a, b in sorted(comm):
        total["collectives"] += max(0, b - max(a, end))
        end = max(end, b)
    out = {k: v / 1e6 / steps for k, v in total.items()}
    out["step_wall"] = seconds / steps
    out["outside_engine"] = out["step_wall"] - sum(out[k] for k in ENGINE_CALLS)
    return out


class PhaseProfile:
    """Profiles from the end of step `window` to the end of step `last`; rank 0 writes the split to `out`."""

    def __init__(self, window: int, last: int, out: str, rank: int):
        self.window, self.last, self.out, self.rank = window, last, out, rank
        self.profiler, self.start = None, 0.0

    def step_done(self, step: int) -> None:
        from torch.profiler import ProfilerActivity, profile

        if step == self.window:
            self.profiler = profile(activities=[ProfilerActivity.CPU])
            self.profiler.__enter__()
            self.start = time.perf_counter()
        elif step == self.last and self.profiler is not None:
            seconds = time.perf_counter() - self.start
            self.profiler.__exit__(None, None, None)
            if self.rank == 0:
                result = split(self.profiler.events(), self.last - self.window, seconds)
                Path(self.out).write_text(json.dumps({"steps": self.last - self.window, **result}) + "\n")
                table = self.profiler.key_averages().table(sort_by="cpu_time_total", row_limit=25)
                Path(self.out).with_suffix(".ops.txt").write_text(table)


class CountedRunner:
    """train.py's runner, unchanged, telling the profile when each optimizer step is done."""

    def __init__(self, runner, profile: PhaseProfile):
        self.runner, self.profile, self.steps = runner, profile, 0

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def train_step(self, *args, **kwargs):
        out = self.runner.train_step(*args, **kwargs)
        self.steps += 1
        self.profile.step_done(self.steps)
        return out


def main(argv: list[str]) -> int:
    import dataclasses

    argv, out = pop_flag(argv, "--phases_out")
    argv, window = pop_flag(argv, "--window", "3")
    train = runpy.run_path(str(REPO / "train.py"), run_name="phases")  # its imports and main()
    import torch

    from zero_recipes.distributed import process_group
    from zero_recipes.training import metrics_log

    mark_engine_calls()
    last = int(argv[argv.index("--max_steps") + 1])

    def instrument(run):
        rank = torch.distributed.get_rank()
        profile = PhaseProfile(int(window), last, out, rank)
        return dataclasses.replace(run, runner=CountedRunner(run.runner, profile))

    code = train["main"](argv, instrument=instrument)
    metrics_log.close_open_logs()
    process_group.finish(code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
