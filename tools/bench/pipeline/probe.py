"""train.py's own main(), with DeepSpeed's pipeline schedule timed instruction by instruction on every rank.

    PYTHONPATH=tools deepspeed --num_gpus 2 --module bench.pipeline.probe <train.py's flags> --probe_out /tmp/p
        [--profile_memory true]

PipelineEngine.train_batch runs one step as a schedule of instructions (LoadMicroBatch, ForwardPass,
BackwardPass, Send/RecvActivation, Send/RecvGrad, ReduceTiedGrads, ReduceGrads, OptimizerStep), each looked
up in the engine's `_INSTRUCTION_MAP` and called. This probe gives the engine its own copy of that map whose
entries call the same methods between two clock reads (the accelerator synchronised first: a no-op on the
CPU), so nothing in the run changes. Per optimizer step and rank it records the seconds and count of each
instruction type, the start and end of each ForwardPass and BackwardPass, the runner's whole train_step,
and four moments, all on time.perf_counter's clock (Linux: CLOCK_MONOTONIC, one clock for every process of
a machine, so stages can be laid side by side): the first instruction's start, the first ForwardPass's
start, the last BackwardPass's end and the OptimizerStep's start.

DeepSpeed's own timers cannot do this under a pipeline: with `"wall_clock_breakdown": true`, 0.19.8's
PipelineEngine._exec_backward_pass starts `bwd_microstep` on every stage but the last, the engine's backward
hook (_backward_prologue) starts it again, and the first backward dies on "bwd_microstep timer has already
been started" (measured; DeepSpeed #745 is the same assertion outside pipelines).

--profile_memory true: the run is also under torch.profiler's allocator events, as in
tools/bench/runners/profiled_train.py (its peaks, its marked train_step), and the export's gather of every stage's
weights (PipelinedCausalLM.full_state_dict) is marked too: its own peak. Each rank writes
<probe_out>.rank<N>.json.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import runpy
import sys
import time
from pathlib import Path

from zero_recipes.memory.probe import allocator_events, count_every_thread

from ..common import REPO
from ..runners.profiled_train import instrument as profiled_instrument, peaks
from ..runners.workload import pop_flag

OPTIMIZER = "OptimizerStep"
BUSY = ("ForwardPass", "BackwardPass")  # each one's (name, start, end) is kept: when the stages overlapped
GATHER = "export_gather"  # not a "phase:" mark: profiled_train.peaks knows only its own phases


class ScheduleClock:
    """Seconds and counts per instruction type within one optimizer step, and its moments (only while `on`:
    the eval and export schedules after training run through the same map and are not recorded)."""

    def __init__(self, sync):
        self.sync, self.on = sync, False
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.moments: dict[str, float] = {}
        self.busy: list[tuple[str, float, float]] = []

    def timed(self, name: str, fn):
        def run(engine, **kwargs):
            if not self.on:
                return fn(engine, **kwargs)
            self.sync()
            start = time.perf_counter()
            self.mark("first_instruction", start, first=True)
            if name == "ForwardPass":
                self.mark("first_forward", start, first=True)
            if name == OPTIMIZER:
                self.mark("optimizer_start", start)
            try:
                return fn(engine, **kwargs)
            finally:
                self.sync()
                end = time.perf_counter()
                self.seconds[name] = self.seconds.get(name, 0.0) + end - start
                self.counts[name] = self.counts.get(name, 0) + 1
                if name in BUSY:
                    self.busy.append((name, start, end))
                if name == "BackwardPass":
                    self.mark("last_backward_end", end)

        return run

    def mark(self, moment: str, t: float, first: bool = False) -> None:
        if not (first and moment in self.moments):
            self.moments[moment] = t

    def begin(self) -> None:
        self.seconds, self.counts, self.moments, self.busy, self.on = {}, {}, {}, [], True

    def end(self) -> dict:
        self.on = False
        return {"seconds": self.seconds, "counts": self.counts, "moments": self.moments, "busy": self.busy}


class TimedRunner:
    """The run's own runner; each train_step is one record of the schedule clock."""

    def __init__(self, runner, clock: ScheduleClock, steps: list):
        self.runner, self.clock, self.steps = runner, clock, steps

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def train_step(self, *args, **kwargs):
        self.clock.begin()
        start = time.perf_counter()
        out = self.runner.train_step(*args, **kwargs)
        self.steps.append({"train_step_seconds": time.perf_counter() - start, **self.clock.end()})
        return out


def time_schedule(engine) -> ScheduleClock:
    """Give the engine an instance-level `_INSTRUCTION_MAP` of timed wrappers around its own methods."""
    from deepspeed.accelerator import get_accelerator

    clock = ScheduleClock(get_accelerator().synchronize)
    engine._INSTRUCTION_MAP = {
        kind: clock.timed(kind.__name__, fn) for kind, fn in type(engine)._INSTRUCTION_MAP.items()
    }
    return clock


def mark_gather(module) -> None:
    """The export's full_state_dict on this module, inside a profiler range named GATHER."""
    from torch.profiler import record_function

    gather = module.full_state_dict

    def marked(*args, **kwargs):
        with record_function(GATHER):
            return gather(*args, **kwargs)

    module.full_state_dict = marked


def gather_peak(prof) -> int:
    """Peak live bytes within the GATHER ranges."""
    _, mem = allocator_events(prof)
    events = prof.profiler.kineto_results.events()
    spans = [(e.start_ns(), e.start_ns() + e.duration_ns()) for e in events if e.name() == GATHER]
    live = peak = 0
    for t, nbytes in mem:
        live += nbytes
        if any(a <= t <= b for a, b in spans):
            peak = max(peak, live)
    return peak


def instrument(steps: list, seen: dict, memory: bool):
    """train.py's `instrument` hook: the loop it assembled, its runner timed (and, for the allocator
    profile, marked as runners/profiled_train.py marks it); the engine's stage is noted in `seen`."""
    marked = profiled_instrument([])

    def wrap(run):
        if memory:
            run = marked(run)
            mark_gather(run.engine.module)
        seen.update(stage=run.engine.stage_id, stages=run.engine.num_stages)
        clock = time_schedule(run.engine)
        return dataclasses.replace(run, runner=TimedRunner(run.runner, clock, steps))

    return wrap


def main(argv: list[str]) -> int:
    argv, out = pop_flag(argv, "--probe_out")
    argv, memory = pop_flag(argv, "--profile_memory", "false")
    memory = memory == "true"
    count_every_thread()  # gloo's threads' frees counted (probe.allocator_events)
    train = runpy.run_path(str(REPO / "train.py"), run_name="pipeline_probe")  # its imports and main()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from zero_recipes.distributed import process_group
    from zero_recipes.training import metrics_log

    steps: list[dict] = []
    seen: dict = {}
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True) if memory else contextlib.nullcontext()
    with prof:
        code = train["main"](argv, instrument=instrument(steps, seen, memory))
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    result = {"rank": rank, **seen, "exit_code": code, "steps": steps}
    if memory:
        result.update(peaks(prof), export_gather_peak_bytes=gather_peak(prof))
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(result) + "\n")
    metrics_log.close_open_logs()
    process_group.finish(code)  # as train.py ends: barrier, then os._exit
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
