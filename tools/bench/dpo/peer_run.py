"""TRL's DPOTrainer run the way its users run it, on train.py's DPO flags:

    PYTHONPATH=tools deepspeed --num_gpus 2 --module bench.dpo.peer_run --reference live|precompute \
        <train.py flags> --probe_out P

- `--reference live`: `precompute_ref_log_probs=False` (TRL's default): a second copy of the model, loaded from the
  same directory and wrapped in its own DeepSpeed engine (ZeRO-3: partitioned like the policy), runs a forward on
  every step.
- `--reference precompute`: `precompute_ref_log_probs=True`: before training, one pass over the pairs with the
  policy wrapped in a DeepSpeed inference engine, its log-probs added to the dataset as columns.

Both get the model train.py trains (the benchmark's model directory: train.py's seeded init, saved), the tokenizer
and chat template saved with it, the raw DeepSpeed JSON (the Trainer fills its "auto"s), torch AdamW, the schedule,
pairs per step, max_length, beta and loss type; one epoch. On a CPU the Trainer needs accelerate's PartialState made
with gloo before its arguments (bench/runners/hf_trainer_run.py says why). The probe (probe.py) times the policy's
training forwards, TRL's precompute (`_precompute_ref_logps`, wrapped) and the live reference's forwards.
"""

from __future__ import annotations

import sys
import time

from ..runners.workload import pop_flag
from ..sft.peer_run import common_arguments
from .probe import PairProbe


def main(argv: list[str]) -> int:
    import torch
    from accelerate import PartialState
    from datasets import load_dataset
    from trl import DPOConfig, DPOTrainer

    from zero_recipes import data
    from zero_recipes.data import formats
    from zero_recipes.distributed import deepspeed_logs, launcher_env, process_group
    from zero_recipes.ds import facts as ds_facts
    from zero_recipes.modeling import model as modeling
    from zero_recipes.plan import RunPlan
    from zero_recipes.preference.pairs import PAIRS

    argv, reference = pop_flag(argv, "--reference")
    argv, out = pop_flag(argv, "--probe_out")
    plan = RunPlan.from_args(argv)  # train.py's own resolution of the same flags
    cfg = plan.cfg
    rank = launcher_env.rank_info().rank
    launcher_env.set_threads(launcher_env.rank_info().local_world_size)
    process_group.init()
    deepspeed_logs.quiet_deepspeed()
    tok = data.load_tokenizer(cfg)
    formats.ensure_chat_template(tok, lambda *a: None)  # saved with the model already: a no-op, as for train.py
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    plan = plan.complete(1, tok)
    cuda = torch.cuda.is_available()
    PartialState(backend="nccl" if cuda else "gloo")
    precompute = reference == "precompute"
    targs = DPOConfig(
        **common_arguments(cfg, plan.raw_ds, ds_facts.precision(plan.ds), cuda),
        max_length=cfg.max_length,
        truncation_mode=cfg.truncation_mode,
        beta=cfg.beta,
        loss_type=list(cfg.loss_type),
        precompute_ref_log_probs=precompute,
    )  # before the model: under ZeRO-3 its zero.Init reads them
    model = modeling.build_model(cfg, plan.model_config, torch.float32, rank)  # from the benchmark's directory
    model.config.use_cache = False
    probe = PairProbe(PAIRS)
    probe.attach(model)
    train = load_dataset("json", data_files=cfg.dataset_name, split="train")
    if precompute:  # the precompute pass runs inside the constructor
        original = DPOTrainer._precompute_ref_logps

        def timed(self, *a, **k):
            start = time.perf_counter()
            try:
                return original(self, *a, **k)
            finally:
                probe.reference_seconds += time.perf_counter() - start
                probe.reference_forwards += 1

        DPOTrainer._precompute_ref_logps = timed
    trainer = DPOTrainer(model=model, args=targs, train_dataset=train, processing_class=tok)
    if trainer.ref_model is not None:
        ref = trainer.ref_model
        probe.time_reference_model(getattr(ref, "module", ref))
    trainer.train()
    probe.finish(rank, out, reference_model=trainer.ref_model is not None)
    process_group.finish(0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
