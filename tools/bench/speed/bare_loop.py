"""The floor: train.py's own training step (runner.EagerRunner) over the same rows, model, optimizer and config,
with nothing of fit() around it (no logging, eval, NaN check, preemption check or checkpoint).

    PYTHONPATH=tools deepspeed --num_gpus 2 --module bench.speed.bare_loop <train.py flags> --timing_out t.json \
        [--window 5] [--profile_out ops.txt]  # rank 0's op table over the steps after the first window (torch.profiler)
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..runners.workload import WindowClock, pop_flag, setup


def main(argv: list[str]) -> int:
    from transformers.integrations import HfDeepSpeedConfig

    from zero_recipes.distributed import process_group
    from zero_recipes.modeling import model as modeling
    from zero_recipes.training.engine import make_engine
    from zero_recipes.training.runner import EagerRunner

    argv, profile_out = pop_flag(argv, "--profile_out")
    w = setup(argv)
    cfg, parallelism = w.cfg, w.plan.parallelism
    parallelism.before_build(cfg, w.model_config, lambda *a, **k: None)  # as train.py: the axes' set-up
    hf_ds = HfDeepSpeedConfig(parallelism.zero_init_config(w.ds))  # noqa: F841 -- alive while the model is built
    modeling.causal_lm_class(w.model_config)
    model = modeling.build_model(cfg, w.model_config, __import__("torch").float32, w.rank)
    engine = make_engine(cfg, model, w.ds, cfg.max_steps, parallelism.mpu())
    runner = EagerRunner(engine, w.plan, w.rank, w.prepared.sft)
    engine.train()
    clock = WindowClock(w)
    profiler = None
    for step in range(1, cfg.max_steps + 1):
        if profile_out and step == w.window + 1:  # after warm-up
            from torch.profiler import ProfilerActivity, profile

            profiler = profile(activities=[ProfilerActivity.CPU])
            profiler.__enter__()
        steps = cfg.gradient_accumulation_steps
        runner.train_step([runner.micro_batch(w.order.next_batch()) for _ in range(steps)], logging_step=False)
        clock.step_done(step)
    if profiler is not None:
        profiler.__exit__(None, None, None)
        if w.rank == 0:
            Path(profile_out).write_text(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    clock.write("bare DeepSpeed loop")
    process_group.finish(0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
