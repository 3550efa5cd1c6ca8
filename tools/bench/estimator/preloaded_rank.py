"""One rank of `python tools/benchmark.py estimator-preloaded` (run by the deepspeed launcher): ZeRO-3 on a model
built before deepspeed.initialize, so no zero.Init, as the HF Trainer runs one loaded before TrainingArguments.
It measures one forward+backward with DeepSpeed's linear wrapper, then puts torch's own F.linear back, which is
what DeepSpeed before 0.19.4 left such a model (PR #8189 installs its wrapper for it since), and measures again.
Rank 0 writes both peaks of live bytes, read by the allocator probe, to --out as JSON."""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch._dynamo  # noqa: F401 -- imported before DeepSpeed, as train.py does

from zero_recipes.memory.probe import allocator_events, count_every_thread

from .report import MODELS

MODEL, MICRO, SEQ = "B", 2, 512  # the estimator benchmark's model B (--model, --seq: --quick's smaller run)


def ds_config(live: int) -> dict:
    """ZeRO-3, bf16, nothing persistent; the live cap and the reuse distance both `live` elements, so that what
    ZeRO-3 itself keeps gathered into the backward is set by the run (the defaults, 1e9, hold all of a small model)."""
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "overlap_comm": False, "stage3_prefetch_bucket_size": 0,
            "stage3_max_live_parameters": live, "stage3_max_reuse_distance": live}  # fmt: skip
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
            "zero_optimization": zero, "gradient_clipping": 0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}  # fmt: skip


def peak_of(run) -> int:
    """Peak live bytes above the start of `run()`, from the allocator's events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    live = peak = 0
    for _, nbytes in allocator_events(prof)[1]:
        live += nbytes
        peak = max(peak, live)
    return peak


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--live", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=MODEL, choices=sorted(MODELS))
    ap.add_argument("--seq", type=int, default=SEQ)
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args(argv)
    count_every_thread()
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as Patched
    from transformers import AutoConfig, AutoModelForCausalLM

    model_fields = MODELS[args.model]
    config = AutoConfig.for_model("llama", **model_fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # built first, on the host
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(args.live))
    ids = torch.randint(0, model_fields["vocab_size"], (MICRO, args.seq))

    def forward_backward():
        engine.backward(engine(input_ids=ids, labels=ids, use_cache=False).loss)

    forward_backward()
    engine.step()  # the optimizer's states exist from here
    peaks = {"wrapped": peak_of(forward_backward)}
    engine.step()
    torch.nn.functional.linear = Patched.linear_bk
    peaks["torch"] = peak_of(forward_backward)
    if torch.distributed.get_rank() == 0:
        linear = sum(m.weight.ds_numel for m in model.modules() if isinstance(m, torch.nn.Linear))
        with open(args.out, "w") as f:
            json.dump({**peaks, "linear_params": linear, "head_params": model.lm_head.weight.ds_numel,
                       "params": sum(p.ds_numel for p in model.parameters())}, f)  # fmt: skip
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
