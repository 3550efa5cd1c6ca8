"""train.py's own main(), run under torch.profiler's allocator events, for a per-rank peak memory.

    PYTHONPATH=tools deepspeed --num_gpus 2 --module bench.runners.profiled_train <train.py's flags> --probe_out /tmp/p

Nothing in the run changes: train.py is loaded from the repository root and its main() called with the same
flags. Every allocation and free of torch's CPU allocator is a profiler event, so the live bytes at each
moment are their running sum (the method of zero_recipes/memory/probe.py): exact for torch tensors
(DeepSpeed's flat buffers and optimizer states, gloo's staging tensors, torch.save's copies), blind to
non-torch memory (the Python heap, libraries). Two calls are marked with record_function, so the peak is also
split by phase: each optimizer step (the runner's train_step) and each checkpoint save (Checkpointer.save), which is
timed here too. Each rank writes <probe_out>.rank<N>.json. With `--no_checkpoints` the run saves none
(bench/runners/unsaved_train.py's checkpointer: the GPU benchmark's --quick, whose GPU runs save none either).
"""

from __future__ import annotations

import dataclasses
import json
import runpy
import sys
import time
from pathlib import Path

from zero_recipes.memory.probe import allocator_events, count_every_thread

from ..common import REPO
from .unsaved_train import NoCheckpoints
from .workload import pop_flag

PHASES = ("train_step", "save")


def peaks(prof) -> dict:
    """Peak live bytes over the whole run and within each marked phase, from the profiler's run."""
    marks, mem = allocator_events(prof)
    live, overall, by_phase, i = 0, 0, dict.fromkeys(PHASES, 0), 0
    for t, nbytes in mem:
        live += nbytes
        overall = max(overall, live)
        while i < len(marks) and marks[i][1] < t:  # marks are disjoint and in order: skip the finished ones
            i += 1
        if i < len(marks) and marks[i][0] <= t:
            by_phase[marks[i][2]] = max(by_phase[marks[i][2]], live)
    return {"peak_bytes": overall, "phase_peak_bytes": by_phase, "end_bytes": live}


class MarkedRunner:
    """The run's own runner, each optimizer step marked for the profiler; everything else is the runner's."""

    def __init__(self, runner):
        self.runner = runner

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def train_step(self, *args, **kwargs):
        from torch.profiler import record_function

        with record_function("phase:train_step"):
            return self.runner.train_step(*args, **kwargs)


class TimedCheckpointer:
    """The run's own checkpointer, each save marked and timed from its call to its return: Checkpointer.save
    ends with a barrier, so rank 0's time covers every rank."""

    def __init__(self, checkpointer, save_seconds: list):
        self.checkpointer, self.save_seconds = checkpointer, save_seconds

    def __getattr__(self, name):
        return getattr(self.checkpointer, name)

    def save(self, *args, **kwargs):
        from torch.profiler import record_function

        with record_function("phase:save"):
            start = time.perf_counter()
            path = self.checkpointer.save(*args, **kwargs)
            self.save_seconds.append(time.perf_counter() - start)
        return path


def instrument(save_seconds: list, checkpoints: bool = True):
    """train.py's `instrument` hook: the loop it assembled, with its runner and checkpointer wrapped (the real
    ones are called unchanged; without `checkpoints`, the one that saves nothing)."""

    def wrap(run):
        saver = run.checkpointer if checkpoints else NoCheckpoints()
        return dataclasses.replace(
            run, runner=MarkedRunner(run.runner), checkpointer=TimedCheckpointer(saver, save_seconds)
        )

    return wrap


def main(argv: list[str]) -> int:
    argv, out = pop_flag(argv, "--probe_out")
    checkpoints = "--no_checkpoints" not in argv
    argv = [a for a in argv if a != "--no_checkpoints"]
    count_every_thread()  # gloo's threads' frees counted (probe.allocator_events)
    train = runpy.run_path(str(REPO / "train.py"), run_name="profiled_train")  # its imports and main()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from zero_recipes.distributed import process_group
    from zero_recipes.training import metrics_log

    save_seconds: list[float] = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        code = train["main"](argv, instrument=instrument(save_seconds, checkpoints))
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    result = {
        "rank": rank,
        "exit_code": code,
        "save_seconds": save_seconds,
        **peaks(prof),
    }
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(result) + "\n")
    metrics_log.close_open_logs()
    process_group.finish(code)  # as train.py ends: barrier, then os._exit
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
