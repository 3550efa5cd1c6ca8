"""DeepSpeed checkpoints inside output_dir and their rotation (resuming: resume.py; one run per output_dir and
what a run may touch there: run_dir.py).

Layout:  output_dir/checkpoints/latest     DeepSpeed's pointer to the newest complete tag
         output_dir/checkpoints/step-N/    DeepSpeed's own files, plus rng_state_<rank>.pt
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Optional

from .config import ConfigError


def checkpoints_dir(output_dir: Path) -> Path:
    return output_dir / "checkpoints"


def list_checkpoints(output_dir: Path) -> list[Path]:
    d = checkpoints_dir(output_dir)
    tags = [p for p in d.glob("step-*") if p.is_dir() and re.fullmatch(r"step-\d+", p.name)] if d.is_dir() else []
    return sorted(tags, key=lambda p: int(p.name.split("-")[1]))


def latest_tag(output_dir: Path) -> Optional[str]:
    latest = checkpoints_dir(output_dir) / "latest"
    if latest.is_file():
        tag = latest.read_text().strip()
        if (checkpoints_dir(output_dir) / tag).is_dir():
            return tag
    return None


def find_checkpoint(p: Path) -> Optional[tuple[Path, str]]:
    """(directory holding the tag dirs, tag) for an output_dir, its checkpoints/ dir or a step-N dir; None
    when there is none. A `latest` that names a missing tag is an error, not a silent fallback."""
    for base in (p / "checkpoints", p):
        latest = base / "latest"
        if latest.is_file():
            tag = latest.read_text().strip()
            if not (base / tag).is_dir():
                have = ", ".join(sorted(x.name for x in base.glob("step-*"))) or "none"
                raise ConfigError(
                    f"{latest} names '{tag}', which is missing from {base}; pass an existing "
                    f"checkpoint directory: {have}"
                )
            return base, tag
    if p.is_dir() and any(p.glob("*model_states.pt")):
        return p.parent, p.name
    return None


def resolve_resume(output_dir: Path, request: Optional[str]) -> Optional[tuple[Path, str]]:
    """'auto' -> the newest complete checkpoint or None; a path -> (checkpoints dir, tag)."""
    if request is None:
        return None
    if request == "auto":
        tag = latest_tag(output_dir)
        return (checkpoints_dir(output_dir), tag) if tag else None
    found = find_checkpoint(Path(request))
    if found:
        return found
    raise ConfigError(
        f"--resume_from_checkpoint {request}: no DeepSpeed checkpoint there; give 'auto', an "
        "output_dir, its checkpoints/ directory or a checkpoints/step-N directory"
    )


def rng_state() -> dict:
    import numpy as np
    import torch

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


LAYOUT = "layout.json"  # per checkpoint: the data-parallel size, TP and SP sizes and ZeRO stage that saved it
UNIVERSAL_SUFFIX = "-universal"
HF_FILES = "hf"  # per checkpoint: config, generation config and tokenizer, so tools/export_hf.py needs nothing else


def save(
    engine,
    output_dir: Path,
    step: int,
    client_state: dict,
    rank: int,
    keep: int,
    rank_state: dict | None = None,
    hf_writer=None,
) -> Path:
    """Save a checkpoint; DeepSpeed writes `latest` only after every rank's files are written."""
    import torch

    d = checkpoints_dir(output_dir)
    tag = f"step-{step}"
    (d / tag).mkdir(parents=True, exist_ok=True)
    # RNG and data position per rank: DeepSpeed saves none, dropout streams differ per rank, and a
    # streamed dataset is read at a different place on each rank.
    torch.save({**rng_state(), **(rank_state or {})}, d / tag / f"rng_state_{rank}.pt")
    if rank == 0 and hf_writer is not None:
        hf_writer(d / tag / HF_FILES)
    # DeepSpeed's own `latest` is written by rank 0 as soon as rank 0's files are done, before the other
    # ranks finish theirs (engine.save_checkpoint, 0.19.8), so a rank killed mid-save could leave `latest`
    # naming a partial checkpoint (the kill-in-save test fails that way). Here it is written only after
    # every rank's files exist, and atomically.
    if rank == 0:  # what a later resume compares against its own layout ("world": data-parallel ranks)
        (d / tag).mkdir(parents=True, exist_ok=True)
        sp = max(1, getattr(engine, "sequence_parallel_size", 1))  # under SP, dp_world_size is None (0.19.8)
        dp = engine.dp_world_size if sp == 1 else engine.seq_dp_world_size // sp
        layout = {"world": dp, "step": step, "zero_stage": int(engine.zero_optimization_stage())}
        parallel = {"tensor_parallel": max(1, engine.autotp_size()), "sequence_parallel": sp}
        (d / tag / LAYOUT).write_text(json.dumps({**layout, **parallel}))
    # A LoRA run's frozen base is the pretrained model: not saved again (its adapter config names it)
    engine.save_checkpoint(
        str(d), tag=tag, client_state=client_state, save_latest=False, exclude_frozen_parameters=has_frozen(engine)
    )
    torch.distributed.barrier()
    if rank == 0:
        tmp = d / f"latest.tmp{os.getpid()}"
        tmp.write_text(tag)
        os.replace(tmp, d / "latest")
    torch.distributed.barrier()
    if rank == 0 and keep > 0:
        for old in list_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
            shutil.rmtree(old.with_name(old.name + UNIVERSAL_SUFFIX), ignore_errors=True)
    torch.distributed.barrier()
    return d / tag


def has_frozen(engine) -> bool:
    """A LoRA run: some parameters train, the rest are the frozen pretrained base."""
    return any(not p.requires_grad for p in engine.module.parameters())


class Checkpointer:
    """Saves this run's checkpoints into output_dir/checkpoints, keeping the newest `keep`; the loop calls
    `save` at its save steps and on preemption."""

    def __init__(self, output_dir: Path, rank: int, keep: int, hf_writer=None):
        self.output_dir, self.rank, self.keep, self.hf_writer = output_dir, rank, keep, hf_writer

    def save(self, engine, step: int, rank_state: dict) -> Path:
        """Collective."""
        return save(
            engine,
            self.output_dir,
            step,
            {"step": step},
            self.rank,
            self.keep,
            rank_state=rank_state,
            hf_writer=self.hf_writer,
        )

    def latest_tag(self) -> Optional[str]:
        return latest_tag(self.output_dir)
