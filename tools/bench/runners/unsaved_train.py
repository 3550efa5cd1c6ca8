"""train.py's own main() without its checkpoints, for the benchmarks that measure a run and keep none of it.

    PYTHONPATH=tools python -m torch.distributed.run --nproc_per_node 1 --module bench.runners.unsaved_train \
        <train.py flags>

train.py saves a DeepSpeed checkpoint at the end of every run (`--save_steps 0` still saves the last step). For
the GPU benchmark's 1B model that is 14 bytes a parameter (bf16 weights, fp32 master and Adam's two moments),
about 17 GB written in tens of seconds of a 15-minute device lease, and nothing reads it. Here train.py's
`instrument` hook swaps the loop's checkpointer for one that saves nothing; everything else is train.py's,
including the export to output_dir that the GPU benchmark's LoRA part trains from.
"""

from __future__ import annotations

import dataclasses
import runpy
import sys
import traceback

from ..common import REPO

SKIPPED = "none (this benchmark keeps no checkpoints)"


class NoCheckpoints:
    """The loop's checkpointer for a run that keeps none: `save` (the loop's, at its save steps and at the end)
    writes nothing; `latest_tag` (named when a non-finite loss stops the run) is none."""

    def save(self, engine, step: int, rank_state: dict) -> str:
        return SKIPPED

    def latest_tag(self):
        return None


def without_checkpoints(run):
    """train.py's `instrument` hook: the assembled loop with the checkpointer that keeps nothing."""
    return dataclasses.replace(run, checkpointer=NoCheckpoints())


def main(argv: list[str]) -> int:
    train = runpy.run_path(str(REPO / "train.py"), run_name="unsaved_train")  # its imports and main()
    from zero_recipes.distributed import process_group
    from zero_recipes.training import metrics_log

    try:
        code = train["main"](argv, instrument=without_checkpoints)
    except Exception:  # noqa: BLE001 -- said, then the same orderly exit: no process group left to hang on
        traceback.print_exc()
        code = 1
    metrics_log.close_open_logs()
    process_group.finish(code)  # as train.py ends: barrier, then os._exit
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
