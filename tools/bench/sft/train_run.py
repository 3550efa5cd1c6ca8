"""train.py under the SFT benchmark's probe: its own main() with its flags, only its checkpoint left out.

    PYTHONPATH=tools deepspeed --num_gpus 2 --module bench.sft.train_run <train.py flags> --probe_out P --eval_file E

train.py's `instrument` hook hands the probe the assembled loop before it runs: the model (hooked by
tools/bench/sft/probe.py), the pad id and the block size; nothing of the run changes but its checkpoint, which
is not saved (bench/runners/unsaved_train.py: nothing reads it, and the GPU benchmark's lease has no time for it; TRL
saves none either). The tokenizer (with its chat template) for the held-out loss is loaded afterwards, from the
cache train.py built.
"""

from __future__ import annotations

import runpy
import sys

from ..common import REPO
from ..runners.unsaved_train import without_checkpoints
from ..runners.workload import pop_flag
from .probe import StepProbe


def main(argv: list[str]) -> int:
    argv, out = pop_flag(argv, "--probe_out")
    argv, eval_file = pop_flag(argv, "--eval_file")
    train = runpy.run_path(str(REPO / "train.py"), run_name="sft_train_run")  # its imports and main()
    import torch

    from zero_recipes import data
    from zero_recipes.data import formats
    from zero_recipes.distributed import process_group
    from zero_recipes.training import metrics_log

    probe, seen = StepProbe(), {}

    def attach(run):
        model = run.engine.module  # the model train.py built, as DeepSpeed holds it
        probe.attach(model, run.prepared.pad_id)
        seen.update(model=model, cfg=run.plan.cfg)
        return without_checkpoints(run)

    code = train["main"](argv, instrument=attach)
    rank = torch.distributed.get_rank()
    cfg = seen["cfg"]
    tok = None
    if rank == 0 and eval_file:  # the tokenizer as data.prepare left it for chat rows: with its chat template
        tok = data.load_tokenizer(cfg)
        formats.ensure_chat_template(tok, lambda *a, **k: None)
    probe.finish(seen["model"], rank, out, eval_file, tok, cfg.block_size)
    metrics_log.close_open_logs()
    process_group.finish(code)  # as train.py ends: barrier, then os._exit
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
