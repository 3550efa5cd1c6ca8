"""The baseline people would otherwise run: transformers.Trainer (what axolotl and LLaMA-Factory wrap) with the
same DeepSpeed JSON fragments, model config and seeded init, rows and per-rank order, micro-batch,
accumulation, steps, optimizer (torch's fused AdamW, the Trainer's default and ours) and schedule as train.py.

    PYTHONPATH=tools deepspeed --num_gpus 2 --module bench.runners.hf_trainer_run <train.py flags> --timing_out t.json \
        [--window 5] [--phases_out p.json]      # p.json: where the step's time goes (bench/runners/phases.py)

Two things the Trainer needs on a CPU (both seen here): accelerate's PartialState must be created with the
gloo backend before TrainingArguments, or every rank believes it is rank 0; and its bf16 check assumes a
GPU, so on a CPU this baseline runs in the precision train.py resolved only when that is fp32.
"""

from __future__ import annotations

import sys
import tempfile

from .phases import PhaseProfile, mark_engine_calls
from .workload import WindowClock, pop_flag, setup


def global_order(w) -> list[int]:
    """Row indices in the order accelerate's batch sharding hands them out: micro-batch i goes to rank
    i % world, so interleaving each rank's own train.py order gives every rank the same rows as train.py."""
    from zero_recipes import data

    orders = [
        data.BatchOrder(w.prepared.train, w.cfg.per_device_train_batch_size, r, w.world, w.cfg.seed, w.pad_id)
        for r in range(w.world)
    ]
    need = w.cfg.max_steps * w.cfg.gradient_accumulation_steps
    out = []
    for _ in range(need):
        for o in orders:
            out.extend(int(i) for i in o.next_indices())
    return out


def same_training(cfg) -> dict:
    """TrainingArguments fields that make a Trainer train as train.py does with `cfg`: batch, accumulation,
    AdamW, clipping, schedule and seed (the SFT benchmark's peers take them too)."""
    return dict(
        per_device_train_batch_size=cfg.per_device_train_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        learning_rate=cfg.learning_rate,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_epsilon=cfg.adam_epsilon,
        max_grad_norm=cfg.max_grad_norm,
        lr_scheduler_type=cfg.lr_scheduler_type,
        warmup_steps=cfg.warmup_steps,
        seed=cfg.seed,
        optim=cfg.optim,
    )


# the HF Trainer set up the way its users write it, in one place, so the baseline reads as their script does
def main(argv: list[str]) -> int:
    import torch
    from accelerate import PartialState
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from zero_recipes import data
    from zero_recipes.distributed import process_group
    from zero_recipes.ds import facts as ds_facts
    from zero_recipes.modeling import model as modeling

    argv, phases_out = pop_flag(argv, "--phases_out")
    w = setup(argv)
    cfg = w.cfg
    cuda = torch.cuda.is_available()
    PartialState(backend="nccl" if cuda else "gloo")
    precision = ds_facts.precision(w.ds)
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="hf-trainer-bench-"),
        max_steps=cfg.max_steps,
        **same_training(cfg),
        deepspeed=w.raw_ds,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        use_cpu=not cuda,
        logging_steps=w.window,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        remove_unused_columns=False,
        disable_tqdm=True,
        gradient_checkpointing=cfg.gradient_checkpointing,
    )
    modeling.causal_lm_class(w.model_config)
    model = modeling.build_model(cfg, w.model_config, torch.float32, w.rank)  # after args: zero.Init sees them
    model.config.use_cache = False
    rows = global_order(w)
    train = w.prepared.train

    def collate(indices):
        return data.collate([train.row(i) for i in indices], w.pad_id)

    clock = WindowClock(w)
    profile = None
    if phases_out:
        mark_engine_calls()
        profile = PhaseProfile(w.window, cfg.max_steps, phases_out, w.rank)

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.step_done(state.global_step)
            if profile is not None:
                profile.step_done(state.global_step)

    class InOrder(Trainer):
        def _get_train_sampler(self, train_dataset=None):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    trainer = InOrder(model=model, args=args, train_dataset=rows, data_collator=collate, callbacks=[Clock()])
    trainer.train()
    clock.write("HF Trainer")
    process_group.finish(0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
