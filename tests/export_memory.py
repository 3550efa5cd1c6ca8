"""What each rank allocates while the export gathers the trained weights, in a real run: train.py's ranks forked
as tests/forked_launch.py forks them (the same agent, environment and `__main__`), with the one function every
HF export goes through, zero_recipes.checkpointing.export.full_state_dict, run under torch.profiler's allocator events
(zero_recipes.memory.probe.allocator_events, every thread's frees counted). Nothing else in the run changes,
so the training tests' own runs are measured as they run (`launch`), and `read` gives each rank's:

    peak     the most bytes live above what the rank held when the gather began
    held     what is still live when it returns (on rank 0, the state dict it hands to the writer)
    written  that state dict's tensor bytes (0 on the other ranks)

Test-only, like forked_launch.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import forked_launch

OUT = "EXPORT_MEMORY_OUT"  # the launch's environment: where its ranks write


def launch(args: list[str], output_dir: Path, **kwargs):
    """helpers.launch(args, output_dir, launcher="forked", ...), its export's gather measured on every rank."""
    return forked_launch.launch_watched(rank_main, OUT, _prefix(output_dir), args, output_dir, **kwargs)


def read(output_dir: Path, nproc: int) -> list[dict]:
    """Each rank's record of the run `launch` made in output_dir, by rank."""
    return forked_launch.read_watched(_prefix(output_dir), nproc)


def _prefix(output_dir: Path) -> Path:
    return Path(output_dir).parent / "export-gather"  # beside the run: its output_dir holds only its own files


def rank_main(argv: list[str], env: dict, stdout: str, stderr: str) -> int:
    """forked_launch.rank_main, with the export's gather measured."""
    from zero_recipes.checkpointing import export
    from zero_recipes.memory.probe import count_every_thread

    count_every_thread()  # before the model exists: gloo's worker threads free what they received
    export.full_state_dict = _measured(export.full_state_dict, env[OUT])
    return forked_launch.rank_main(argv, env, stdout, stderr)


def _measured(gather, out: str):
    def run(module, rank: int):
        from torch.profiler import ProfilerActivity, profile

        from zero_recipes.checkpointing.export import state_bytes
        from zero_recipes.memory.probe import allocator_events

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            sd = gather(module, rank)
        live = peak = 0
        for _, nbytes in allocator_events(prof)[1]:
            live += nbytes
            peak = max(peak, live)
        result = {"peak": peak, "held": live, "written": state_bytes(sd) or 0}
        Path(f"{out}.rank{rank}.json").write_text(json.dumps(result) + "\n")
        return sd

    return run
