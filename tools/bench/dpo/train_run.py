"""train.py's DPO under the DPO benchmark's probe: its own main() with its flags, only its checkpoint left out.

    PYTHONPATH=tools deepspeed --num_gpus 2 --module bench.dpo.train_run <train.py flags> --probe_out P

As bench/sft/train_run.py: train.py's `instrument` hook hands the probe the engine's model before the loop runs
(after the reference pass, which train.py runs when it builds the loop's runner); the checkpoint is not saved
(bench/runners/unsaved_train.py: nothing reads it; TRL saves none either). The reference pass's seconds are in
train.py's own log line, which the benchmark reads.
"""

from __future__ import annotations

import runpy
import sys

from ..common import REPO
from ..runners.unsaved_train import without_checkpoints
from ..runners.workload import pop_flag
from .probe import PairProbe


def main(argv: list[str]) -> int:
    argv, out = pop_flag(argv, "--probe_out")
    train = runpy.run_path(str(REPO / "train.py"), run_name="dpo_train_run")  # its imports and main()
    import torch

    from zero_recipes.distributed import process_group
    from zero_recipes.preference.pairs import PAIRS
    from zero_recipes.training import metrics_log

    probe = PairProbe(PAIRS)

    def attach(run):
        probe.attach(run.engine.module)  # the model train.py built, as DeepSpeed holds it
        return without_checkpoints(run)

    code = train["main"](argv, instrument=attach)
    probe.finish(torch.distributed.get_rank(), out)
    metrics_log.close_open_logs()
    process_group.finish(code)  # as train.py ends: barrier, then os._exit
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
