"""A Muon run whose ranks count DeepSpeed's Newton-Schulz calls and sum their optimizer's state bytes: train.py's
ranks forked as tests/forked_launch.py forks them (the same agent, environment and `__main__`), with two things
watched and nothing changed:

    newton_schulz  calls of deepspeed.runtime.zero.muon.original_muon.muon_update, the function every ZeRO stage
                   runs Newton-Schulz through (one orthogonalization of one matrix per call)
    state          after the last optimizer step, the optimizer's state tensors' bytes and the elements they are kept for,
                   by half: "muon" (the groups DeepSpeed tagged use_muon) and "adam"

Test-only, like forked_launch.py and export_memory.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import forked_launch

OUT = "MUON_CALLS_OUT"  # the launch's environment: where its ranks write


def launch(args: list[str], output_dir: Path, **kwargs):
    """helpers.launch(args, output_dir, launcher="forked", ...), each rank's calls and states written down."""
    return forked_launch.launch_watched(rank_main, OUT, _prefix(output_dir), args, output_dir, **kwargs)


def read(output_dir: Path, nproc: int) -> list[dict]:
    """Each rank's record of the run `launch` made in output_dir, by rank."""
    return forked_launch.read_watched(_prefix(output_dir), nproc)


def _prefix(output_dir: Path) -> Path:
    return Path(output_dir).parent / "muon-calls"


def rank_main(argv: list[str], env: dict, stdout: str, stderr: str) -> int:
    """forked_launch.rank_main, with Newton-Schulz counted and the engine kept to read its states at the end."""
    from deepspeed.runtime.zero.muon import original_muon

    from zero_recipes.training import engine as engines

    calls, states = [0], [None]
    update, make = original_muon.muon_update, engines.make_engine

    def counted(*a, **k):
        calls[0] += 1
        return update(*a, **k)

    def keep(*a, **k):  # the states as each step leaves them (the run frees them as it ends)
        engine = make(*a, **k)
        step = engine.optimizer.step

        def read_after(*sa, **sk):
            out = step(*sa, **sk)
            states[0] = state_bytes(engine.optimizer)
            return out

        engine.optimizer.step = read_after
        return engine

    original_muon.muon_update, engines.make_engine = counted, keep  # train.py imports make_engine after this
    try:
        code = forked_launch.rank_main(argv, env, stdout, stderr)
    finally:
        original_muon.muon_update, engines.make_engine = update, make
    result = {"newton_schulz": calls[0], "state": states[0]}
    Path(f"{env[OUT]}.rank{os.environ['RANK']}.json").write_text(json.dumps(result) + "\n")
    return code


def state_bytes(zero_optimizer) -> dict:
    """{"muon"|"adam": {"bytes", "elements"}}: the state tensors DeepSpeed's MuonWithAuxAdam keeps, by half (a
    momentum_buffer is Muon's, exp_avg and exp_avg_sq AdamW's), and the elements of the parameters they are kept
    for (under ZeRO, the rank's flat fp32 partitions: the state's keys)."""
    halves = {"muon": {"bytes": 0, "elements": 0}, "adam": {"bytes": 0, "elements": 0}}
    for param, state in zero_optimizer.optimizer.state.items():
        tensors = {k: v for k, v in state.items() if hasattr(v, "element_size") and v.dim() > 0}
        half = halves["muon" if "momentum_buffer" in tensors else "adam"]
        half["elements"] += param.numel()
        half["bytes"] += sum(t.numel() * t.element_size() for t in tensors.values())
    return halves
