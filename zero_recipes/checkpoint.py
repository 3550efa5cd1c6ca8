"""DeepSpeed checkpoints inside output_dir, rotation, and keeping one run per output_dir (resuming: resume.py).

Layout:  output_dir/run_config.json        what makes this run this run (compared on relaunch)
         output_dir/checkpoints/latest     DeepSpeed's pointer to the newest complete tag
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

RUN_CONFIG = "run_config.json"


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


def check_output_dir(output_dir: Path, signature: dict, overwrite: bool, resume: Optional[str]) -> Optional[str]:
    """Decide what this launch may do with output_dir. Returns the resume request ('auto', a path or None).

    - Empty or new: train from scratch.
    - Same run (same signature): resume from its newest checkpoint, so repeating a launch continues or
      finishes instead of failing.
    - Another run: refuse unless --overwrite_output_dir, or --resume_from_checkpoint was given (changing
      e.g. max_steps to extend a run is then deliberate).
    - Files that are not a zero-recipes run: refuse unless --overwrite_output_dir; never delete them.
    - A path that is a file, or where this user cannot write: refuse, before anything is created."""
    check_writable(output_dir)
    if not output_dir.exists() or not any(output_dir.iterdir()):
        return resume
    saved = output_dir / RUN_CONFIG
    if not saved.is_file():
        if overwrite:
            return resume
        raise ConfigError(
            f"output_dir {output_dir} is not empty and holds no zero-recipes run; choose another "
            "--output_dir or pass --overwrite_output_dir"
        )
    try:
        previous = json.loads(saved.read_text())
    except json.JSONDecodeError:
        previous = None
    same = previous == signature
    if overwrite and resume is None:
        return None
    if same:
        return resume or ("auto" if latest_tag(output_dir) else None)
    if resume is not None:
        from .lora import changed_settings

        if lora_changed := changed_settings(previous or {}, signature):
            raise ConfigError(
                f"output_dir {output_dir} holds a LoRA run with other adapter settings ({', '.join(lora_changed)}); "
                "its checkpoints hold that adapter. Resume with the same settings, or use another --output_dir"
            )
        return resume
    changed = sorted(k for k in set(previous or {}) | set(signature) if (previous or {}).get(k) != signature.get(k))
    raise ConfigError(
        f"output_dir {output_dir} holds a different run (changed: {', '.join(changed[:6])}); use "
        "another --output_dir, --overwrite_output_dir to start over, or --resume_from_checkpoint "
        "auto to continue it with the new settings"
    )


def check_writable(output_dir: Path) -> None:
    """output_dir, or the nearest folder above it that exists, must be a directory this user can write in.
    Asked by writing a probe file there and removing it: os.access says yes to root on a read-only mount."""
    import tempfile

    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"--output_dir {output_dir} is a file, not a directory; choose another --output_dir")
    existing = next((p for p in (output_dir, *output_dir.parents) if p.exists()), None)
    if existing is None or not existing.is_dir():
        raise ConfigError(
            f"--output_dir {output_dir}: {existing} is a file, not a directory; choose another --output_dir"
        )
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".zero-recipes-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(
            f"--output_dir {output_dir}: cannot write in {existing} ({e.strerror}); choose a directory you can write to"
        ) from None


def clear_previous_run(output_dir: Path) -> None:
    """--overwrite_output_dir: remove what an earlier zero-recipes run wrote, nothing else."""
    shutil.rmtree(checkpoints_dir(output_dir), ignore_errors=True)
    shutil.rmtree(output_dir / "tensorboard", ignore_errors=True)  # else TensorBoard draws both runs as one
    shutil.rmtree(output_dir / "plots", ignore_errors=True)  # tools/plot_metrics.py's charts of the old run
    # wandb/ stays: an offline W&B run may not be synced yet; the new run gets a new W&B id
    for name in ("metrics.jsonl", RUN_CONFIG, "ds_config.json", "wandb_run_id"):
        (output_dir / name).unlink(missing_ok=True)


def write_run_config(output_dir: Path, signature: dict, ds_config: dict) -> None:
    (output_dir / RUN_CONFIG).write_text(json.dumps(signature, indent=2, sort_keys=True))
    (output_dir / "ds_config.json").write_text(json.dumps(ds_config, indent=2))


def start_run(plan, rank: int) -> None:
    """Collective. Only now, with the data and config known good, is output_dir touched: bad input
    leaves it as it was. Every rank has read output_dir before rank 0 writes to it."""
    import torch

    torch.distributed.barrier()
    if rank == 0:
        if plan.cfg.overwrite_output_dir and plan.cfg.resume_from_checkpoint is None:
            clear_previous_run(plan.output_dir)
        plan.output_dir.mkdir(parents=True, exist_ok=True)
        write_run_config(plan.output_dir, plan.signature, plan.ds)


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
