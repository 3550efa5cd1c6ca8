"""train.py's own main() under torch.profiler's allocator events, with the memory of each step split into
model states, activations and the loss region, per rank.

    PYTHONPATH=tools deepspeed --num_gpus 2 --module bench.longctx.probe <train.py's flags> --probe_out /tmp/p

As tools/bench/runners/profiled_train.py (train.py loaded from the repository root, its main() called with
the same flags, every optimizer step marked `phase:train_step`), plus zero-length marks at three points of
each step, so the live bytes (the running sum of the CPU allocator's events) can be read at them:

- `forward`: DeepSpeedEngine.forward is entered. The live bytes here are the model states: everything
  that outlives a step (parameter partitions, gradient buffers, the optimizer's states).
- `loss_start`: the decoder's final norm has returned the last hidden state; from here the output head and
  the loss run (whole-sequence logits, or tiles of them).
- `loss_end`: the gradient of that hidden state exists: the head's and the loss's backward are done.

The activation peak of a step is its peak between `forward` and the optimizer step minus the model states;
the loss region is the peak between `loss_start` and `loss_end` minus the live bytes at `loss_start`. The
functions are wrapped, never changed. Each rank writes <probe_out>.rank<N>.json.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

from zero_recipes.memory.probe import allocator_events, count_every_thread

from ..common import REPO
from ..runners.profiled_train import instrument, peaks
from ..runners.workload import pop_flag

POINTS = ("forward", "loss_start", "loss_end", "optimizer")


def mark(name: str) -> None:
    """A zero-length profiler range: its start time places `name` among the allocator events."""
    from torch.profiler import record_function

    with record_function(f"mark:{name}"):
        pass


def final_norm(model):
    """The decoder's last module before the output head (Llama-style families: `model.model.norm`)."""
    decoder = getattr(model, getattr(model, "base_model_prefix", "model"), model)
    return getattr(decoder, "norm", None) or getattr(decoder, "final_layernorm", None)


def instrument_points() -> None:
    """Mark `forward` and `optimizer` on DeepSpeed's engine, and `loss_start` / `loss_end` around the head and
    loss through hooks on the final norm (registered on the engine's first forward)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    forward, step = DeepSpeedEngine.forward, DeepSpeedEngine.step

    def on_norm(_module, _inputs, output):
        if not (_module.training and getattr(output, "requires_grad", False)):
            return  # eval or the export check: no backward to wait for
        mark("loss_start")
        output.register_hook(lambda grad: mark("loss_end"))

    def marked_forward(self, *args, **kwargs):
        if not getattr(self, "_longctx_hooked", False):
            norm = final_norm(self.module)
            if norm is None:
                raise RuntimeError("longctx_probe: no final norm found on the model; cannot mark the loss region")
            norm.register_forward_hook(on_norm)
            self._longctx_hooked = True
        if self.training:
            mark("forward")
        return forward(self, *args, **kwargs)

    def marked_step(self, *args, **kwargs):
        mark("optimizer")
        return step(self, *args, **kwargs)

    DeepSpeedEngine.forward = marked_forward
    DeepSpeedEngine.step = marked_step


def point_marks(events) -> list[tuple[int, str]]:
    """(time_ns, name) of the `mark:` events, in time order."""
    return sorted((e.start_ns(), e.name()[len("mark:") :]) for e in events if e.name().startswith("mark:"))


def step_memory(steps: list[tuple], points: list[tuple[int, str]], mem: list[tuple[int, int]]) -> list[dict]:
    """Per optimizer step (a (start_ns, end_ns, name) range of `steps`), from the point marks and the
    allocator's (time_ns, +/-bytes) events:
    states (live bytes at `forward`), peak (whole step), forward_backward_peak (from `forward` to `optimizer`),
    activations (forward_backward_peak - states), loss_region (peak from `loss_start` to `loss_end` minus the
    live bytes at `loss_start`). A step's first `forward`, first `loss_start` and `loss_end` after it, and
    first `optimizer` after that are used (one micro-batch per step)."""
    out = []
    for start, end, _name in steps:
        inside = [(t, n) for t, n in points if start <= t <= end]

        def first(name, after=start):
            return next((t for t, n in inside if n == name and t >= after), None)

        t_fwd = first("forward")
        t_ls = first("loss_start", t_fwd or start)
        t_le = first("loss_end", t_ls or start)
        t_opt = first("optimizer", t_le or t_fwd or start)
        if None in (t_fwd, t_ls, t_le, t_opt):
            out.append({"complete": False})
            continue
        live, before = 0, {}
        peak = fb_peak = loss_peak = 0
        for t, nbytes in mem:
            for name, when in (("forward", t_fwd), ("loss_start", t_ls)):
                if name not in before and t >= when:
                    before[name] = live  # live bytes just before the mark
            if t > end:
                break
            live += nbytes
            if t >= start:
                peak = max(peak, live)
            if t_fwd <= t < t_opt:
                fb_peak = max(fb_peak, live)
            if t_ls <= t <= t_le:
                loss_peak = max(loss_peak, live)
        before.setdefault("forward", live)
        before.setdefault("loss_start", live)
        states = before["forward"]
        out.append(
            {
                "complete": True,
                "states": states,
                "peak": peak,
                "forward_backward_peak": fb_peak,
                "activations": max(fb_peak, states) - states,
                "loss_region": max(loss_peak, before["loss_start"]) - before["loss_start"],
            }
        )
    return out


def main(argv: list[str]) -> int:
    argv, out = pop_flag(argv, "--probe_out")
    count_every_thread()  # gloo's threads' frees counted (probe.allocator_events)
    train = runpy.run_path(str(REPO / "train.py"), run_name="longctx_probe")  # its imports and main()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from zero_recipes.distributed import process_group
    from zero_recipes.training import metrics_log

    instrument_points()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        code = train["main"](argv, instrument=instrument([]))
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    events = prof.profiler.kineto_results.events()
    marks, mem = allocator_events(prof)
    steps = [m for m in marks if m[2] == "train_step"]
    result = {
        "rank": rank,
        "exit_code": code,
        **peaks(prof),
        "steps": step_memory(steps, point_marks(events), mem),
    }
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(result) + "\n")
    metrics_log.close_open_logs()
    process_group.finish(code)  # as train.py ends: barrier, then os._exit
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
