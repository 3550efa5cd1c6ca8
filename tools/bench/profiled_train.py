"""train.py's own main(), run under torch.profiler's allocator events, for a per-rank peak memory.

    PYTHONPATH=tools deepspeed --num_gpus 2 --module bench.profiled_train <train.py's flags> --probe_out /tmp/p

Nothing in the run changes: train.py is loaded from the repository root and its main() called with the same
flags. Every allocation and free of torch's CPU allocator is a profiler event, so the live bytes at each
moment are their running sum (the method of zero_recipes/memory/probe.py): exact for torch tensors
(DeepSpeed's flat buffers and optimizer states, gloo's staging tensors, torch.save's copies), blind to
non-torch memory (the Python heap, libraries). Two calls are marked with record_function, so the peak is also
split by phase: each optimizer step (loop.train_step) and each checkpoint save (Checkpointer.save), which is
timed here too. Each rank writes <probe_out>.rank<N>.json.
"""

from __future__ import annotations

import json
import runpy
import sys
import time
from pathlib import Path

from zero_recipes.memory.probe import allocator_events

from .common import REPO
from .workload import pop_flag

PHASES = ("train_step", "save")


def peaks(events) -> dict:
    """Peak live bytes over the whole run and within each marked phase, from the profiler's events."""
    marks, mem = allocator_events(events)
    live, overall, by_phase, i = 0, 0, dict.fromkeys(PHASES, 0), 0
    for t, nbytes in mem:
        live += nbytes
        overall = max(overall, live)
        while i < len(marks) and marks[i][1] < t:  # marks are disjoint and in order: skip the finished ones
            i += 1
        if i < len(marks) and marks[i][0] <= t:
            by_phase[marks[i][2]] = max(by_phase[marks[i][2]], live)
    return {"peak_bytes": overall, "phase_peak_bytes": by_phase, "end_bytes": live}


def instrument(save_seconds: list) -> None:
    """Mark the optimizer steps and the saves (the real functions are called unchanged), and time each save
    from its call to its return: Checkpointer.save ends with a barrier, so rank 0's time covers every rank."""
    from torch.profiler import record_function

    from zero_recipes import checkpoint, loop

    train_step, save = loop.train_step, checkpoint.Checkpointer.save

    def marked_step(*args, **kwargs):
        with record_function("phase:train_step"):
            return train_step(*args, **kwargs)

    def timed_save(self, engine, step, *args, **kwargs):
        with record_function("phase:save"):
            start = time.perf_counter()
            path = save(self, engine, step, *args, **kwargs)
            save_seconds.append(time.perf_counter() - start)
        return path

    loop.train_step = marked_step  # fit() looks the name up at each call
    checkpoint.Checkpointer.save = timed_save


def main(argv: list[str]) -> int:
    argv, out = pop_flag(argv, "--probe_out")
    train = runpy.run_path(str(REPO / "train.py"), run_name="profiled_train")  # its imports and main()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from zero_recipes import distributed, metrics

    save_seconds: list[float] = []
    instrument(save_seconds)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        code = train["main"](argv)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    result = {
        "rank": rank,
        "exit_code": code,
        "save_seconds": save_seconds,
        **peaks(prof.profiler.kineto_results.events()),
    }
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(result) + "\n")
    metrics.close_open_logs()
    distributed.finish(code)  # as train.py ends: barrier, then os._exit
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
