"""train.py under the SFT benchmark's probe: its own main() with its flags, nothing changed.

    PYTHONPATH=tools deepspeed --num_gpus 2 --module bench.sft_train_run <train.py flags> --probe_out P --eval_file E

Two of train.py's calls are wrapped to see what the probe needs (the real functions run unchanged):
`data.prepare`, for the tokenizer (with its chat template) and the pad id, and `model.build_model`, to hook
the model (tools/bench/sft_probe.py).
"""

from __future__ import annotations

import runpy
import sys

from .common import REPO
from .sft_probe import StepProbe
from .workload import pop_flag


def main(argv: list[str]) -> int:
    argv, out = pop_flag(argv, "--probe_out")
    argv, eval_file = pop_flag(argv, "--eval_file")
    train = runpy.run_path(str(REPO / "train.py"), run_name="sft_train_run")  # its imports and main()
    import torch

    from zero_recipes import data, distributed, metrics, model as modeling

    probe, seen = StepProbe(), {}
    prepare, build = data.prepare, modeling.build_model

    def seen_prepare(cfg, tok, log):
        prepared = prepare(cfg, tok, log)
        seen.update(tok=tok, pad_id=prepared.pad_id, block=cfg.block_size)
        return prepared

    def hooked_build(cfg, config, dtype, rank):
        model = build(cfg, config, dtype, rank)
        probe.attach(model, seen["pad_id"])
        seen["model"] = model
        return model

    data.prepare, modeling.build_model = seen_prepare, hooked_build  # train.py looks both up at each call
    code = train["main"](argv)
    rank = torch.distributed.get_rank()
    probe.finish(seen["model"], rank, out, eval_file, seen["tok"], seen["block"])
    metrics.close_open_logs()
    distributed.finish(code)  # as train.py ends: barrier, then os._exit
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
