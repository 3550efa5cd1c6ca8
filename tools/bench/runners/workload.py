"""The identical work every speed runner does: train.py's flags, tokenizer, prepared rows, batch order,
model config and resolved DeepSpeed config, built with train.py's own modules. The baselines
(speed/bare_loop.py, hf_trainer_run.py) start here, so only the training loop differs between the three.

Timing is the same for all: wall time of each window of `window` optimizer steps, measured on rank 0 at
the step boundary, written as JSON to --timing_out.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401 -- before any zero.Init, as in train.py

from zero_recipes import data
from zero_recipes.distributed import deepspeed_logs, launcher_env, process_group
from zero_recipes.plan import RunPlan


@dataclass
class Workload:
    cfg: object
    ds: dict
    raw_ds: dict
    order: object
    prepared: object
    model_config: object
    tokenizer: object
    pad_id: int
    rank: int
    world: int
    dp: int  # data-parallel replicas (world / TP or SP size): the groups of ranks that see different rows
    threads: int
    timing_out: str
    window: int
    plan: object = None  # the completed RunPlan: its axes and adapter, as train.py picks them


def pop_flag(argv: list[str], name: str, default: str | None = None) -> tuple[list[str], str | None]:
    if name not in argv:
        return argv, default
    i = argv.index(name)
    return argv[:i] + argv[i + 2 :], argv[i + 1]


def setup(argv: list[str]) -> Workload:
    argv, timing_out = pop_flag(argv, "--timing_out")
    argv, window = pop_flag(argv, "--window", "5")
    plan = RunPlan.from_args(argv)  # train.py's own resolution
    cfg = plan.cfg
    ranks = launcher_env.rank_info()
    rank, world = ranks.rank, ranks.world_size
    threads = launcher_env.set_threads(ranks.local_world_size)
    process_group.init()
    deepspeed_logs.quiet_deepspeed()
    tokenizer = data.load_tokenizer(cfg)  # built by train.py's run before this one (A/B/C order)
    prepared = data.prepare(cfg, tokenizer, lambda *a, **k: None)  # a cache hit after train.py's run
    # as train.py: the rows are sharded by data-parallel rank (a TP or SP group's ranks train the same batch)
    dp_rank, dp = plan.mesh.dp_rank(rank), plan.mesh.dp
    order = data.BatchOrder(prepared.train, cfg.per_device_train_batch_size, dp_rank, dp, cfg.seed, prepared.pad_id)
    plan = plan.complete(plan.steps_to_train(order.per_rank))  # as train.py counts the steps
    model_config = plan.model_config
    if cfg.model_name_or_path is None and cfg.model_config is None:
        model_config.vocab_size = len(tokenizer)
    elif cfg.model_name_or_path is None:
        model_config.vocab_size = max(model_config.vocab_size, len(tokenizer))
    return Workload(
        cfg,
        plan.ds,
        plan.raw_ds,
        order,
        prepared,
        model_config,
        tokenizer,
        prepared.pad_id,
        rank,
        world,
        dp,
        threads,
        timing_out,
        int(window),
        plan,
    )


class WindowClock:
    """Wall time per window of optimizer steps, on rank 0; no host sync of its own beyond the step's."""

    def __init__(self, w: Workload):
        self.w, self.marks = w, [time.perf_counter()]

    def step_done(self, step: int) -> None:
        if step % self.w.window == 0:
            self.marks.append(time.perf_counter())

    def write(self, runner: str) -> None:
        if self.w.rank != 0 or not self.w.timing_out:
            return
        cfg = self.w.cfg
        # the global batch's tokens, as train.py's metrics count them: each data-parallel replica's rows once
        tokens = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * cfg.block_size * self.w.dp
        seconds = [b - a for a, b in zip(self.marks, self.marks[1:])]
        Path(self.w.timing_out).write_text(
            json.dumps(
                {
                    "runner": runner,
                    "window_steps": self.w.window,
                    "window_seconds": seconds,
                    "tokens_per_step": tokens,
                    "threads_per_rank": self.w.threads,
                    "world": self.w.world,
                }
            )
            + "\n"
        )
