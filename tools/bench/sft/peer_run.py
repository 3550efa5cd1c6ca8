"""The SFT benchmark's two peers, run the way their users run them, on train.py's flags:

    PYTHONPATH=tools deepspeed --num_gpus 2 --module bench.sft.peer_run --peer trl <train.py flags> \
        --probe_out P --eval_file E [--prompt_completion_file F]

- `--peer trl`: TRL's SFTTrainer with packing as its docs recommend (`packing=True`: best-fit decreasing
  into rows of max_length, which turns on padding-free batches), completion-only loss on the conversational
  prompt-completion form of the same conversations (F). TRL reads and tokenises them itself.
- `--peer hf`: transformers.Trainer as people do SFT without TRL: the chat template, prompt labels -100
  (sft_data.masked_example, a `datasets.map`), `DataCollatorForSeq2Seq`, `group_by_length` (transformers 5 spells it `train_sampling_strategy="group_by_length"`).

Both get the model train.py would build (same config, seeded init), the same tokenizer and chat template, the
raw DeepSpeed JSON (the Trainer fills its "auto"s), torch AdamW, the schedule and one epoch. On a CPU the
Trainer needs accelerate's PartialState made with gloo before its arguments (runners/hf_trainer_run.py says why).
"""

from __future__ import annotations

import sys
import tempfile

from ..runners.hf_trainer_run import same_training
from ..runners.workload import pop_flag
from .data import masked_example
from .probe import StepProbe


def common_arguments(cfg, raw_ds: dict, precision: str, cuda: bool) -> dict:
    return dict(
        output_dir=tempfile.mkdtemp(prefix="sft-peer-bench-"),
        num_train_epochs=cfg.num_train_epochs,
        max_steps=cfg.max_steps if cfg.max_steps > 0 else -1,
        **same_training(cfg),
        deepspeed=raw_ds,
        bf16=precision == "bf16",
        use_cpu=not cuda,
        logging_steps=cfg.logging_steps,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        disable_tqdm=True,
        gradient_checkpointing=cfg.gradient_checkpointing,
    )


def peer_arguments(peer: str, cfg, args: dict):
    """Made before the model, as the Trainer's users do: under ZeRO-3 its zero.Init reads them."""
    if peer == "trl":
        from trl import SFTConfig

        return SFTConfig(**args, packing=True, max_length=cfg.block_size, completion_only_loss=True)
    from transformers import TrainingArguments

    return TrainingArguments(**args, train_sampling_strategy="group_by_length")  # group_by_length=True before v5


def trl_trainer(model, tok, cfg, targs, pc_file: str):
    from datasets import load_dataset
    from trl import SFTTrainer

    train = load_dataset("json", data_files=pc_file, split="train")
    return SFTTrainer(model=model, args=targs, train_dataset=train, processing_class=tok)


def hf_trainer(model, tok, cfg, targs):
    from datasets import load_dataset
    from transformers import DataCollatorForSeq2Seq, Trainer

    raw = load_dataset("json", data_files=cfg.dataset_name, split="train")
    with targs.main_process_first(desc="tokenise"):
        train = raw.map(
            lambda row: masked_example(row["messages"], tok, cfg.block_size), remove_columns=raw.column_names
        )
    collator = DataCollatorForSeq2Seq(tok, padding=True, label_pad_token_id=-100)
    return Trainer(model=model, args=targs, train_dataset=train, data_collator=collator)


def main(argv: list[str]) -> int:
    import torch
    from accelerate import PartialState

    from zero_recipes import data
    from zero_recipes.data import formats
    from zero_recipes.distributed import deepspeed_logs, launcher_env, process_group
    from zero_recipes.ds import facts as ds_facts
    from zero_recipes.modeling import model as modeling
    from zero_recipes.plan import RunPlan

    argv, peer = pop_flag(argv, "--peer")
    argv, out = pop_flag(argv, "--probe_out")
    argv, eval_file = pop_flag(argv, "--eval_file")
    argv, pc_file = pop_flag(argv, "--prompt_completion_file")
    plan = RunPlan.from_args(argv)  # train.py's own resolution of the same flags
    cfg = plan.cfg
    ranks = launcher_env.rank_info()
    rank = ranks.rank
    launcher_env.set_threads(ranks.local_world_size)
    process_group.init()
    deepspeed_logs.quiet_deepspeed()
    tok = data.load_tokenizer(cfg)
    formats.ensure_chat_template(tok, lambda *a: None)  # the template train.py gives this tokenizer
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token  # what both peers' users do; train.py pads with the same id
    plan = plan.complete(1, tok)  # the model config sized to the tokenizer, as in train.py
    cuda = torch.cuda.is_available()
    PartialState(backend="nccl" if cuda else "gloo")
    targs = peer_arguments(peer, cfg, common_arguments(cfg, plan.raw_ds, ds_facts.precision(plan.ds), cuda))
    modeling.causal_lm_class(plan.model_config)
    model = modeling.build_model(cfg, plan.model_config, torch.float32, rank)
    model.config.use_cache = False
    probe = StepProbe()
    probe.attach(model, tok.pad_token_id)
    trainer = trl_trainer(model, tok, cfg, targs, pc_file) if peer == "trl" else hf_trainer(model, tok, cfg, targs)
    trainer.train()
    probe.finish(model, rank, out, eval_file, tok, cfg.block_size)
    process_group.finish(0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
