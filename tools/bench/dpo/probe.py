"""What the DPO benchmark reads from inside each runner's ranks, the same way for train.py and both TRL forms.

A forward pre-hook on the policy (the module DeepSpeed wraps) stamps every training forward (grad on, training
mode: not a reference pass, which runs without gradients) with its start time and what it computes
(data.pair_tokens). A step ends when the next begins, as in the SFT benchmark (bench/sft/probe.py, whose device
wait this reuses). Time to first step: process start to the second training forward, the reference pass (train.py's
before step 1, TRL's precompute in its constructor) included. `reference` times a reference pass or a live
reference model's forwards: what the report gives as the reference's share. Every rank writes
<probe_out>.rank<N>.json with its records and its peak RSS (what the SFT benchmark reads too).
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

from ..sft.probe import wait_for
from .data import pair_tokens


class PairProbe:
    def __init__(self, shared_key: str, wait=wait_for):
        self.key, self.wait = shared_key, wait
        self.starts: list[float] = []
        self.tokens: list[tuple[int, int, int]] = []  # (pairs, computed, real) per training forward
        self.first_step_seconds = None
        self.reference_seconds = 0.0
        self.reference_forwards = 0
        self._ref_start = None

    def attach(self, model) -> None:
        model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        import psutil
        import torch

        if not (module.training and torch.is_grad_enabled()):
            return
        self.wait(kwargs["input_ids"].device)  # the previous step's kernels done: then read the clock
        if len(self.starts) == 1:
            self.first_step_seconds = time.time() - psutil.Process().create_time()
        self.starts.append(time.perf_counter())
        self.tokens.append(pair_tokens(kwargs, self.key))

    def time_reference_model(self, model) -> None:
        """Sum the wall time of every forward of a separate reference model (TRL's live one)."""

        def before(module, args, kwargs):
            self.wait(next(module.parameters()).device)
            self._ref_start = time.perf_counter()

        def after(module, args, kwargs, output):
            self.wait(next(module.parameters()).device)
            self.reference_seconds += time.perf_counter() - self._ref_start
            self.reference_forwards += 1

        model.register_forward_pre_hook(before, with_kwargs=True)
        model.register_forward_hook(after, with_kwargs=True)

    def finish(self, rank: int, out: str, **extra) -> None:
        record = {
            "rank": rank,
            "starts": self.starts,
            "tokens": self.tokens,
            "time_to_first_step": self.first_step_seconds,
            "reference_seconds": self.reference_seconds,
            "reference_forwards": self.reference_forwards,
            "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            **extra,
        }
        Path(f"{out}.rank{rank}.json").write_text(json.dumps(record) + "\n")
