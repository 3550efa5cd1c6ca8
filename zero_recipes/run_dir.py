"""One run per output_dir, and nothing in it touched that this project did not write.

output_dir/run_config.json        what makes this run this run (compared on relaunch)
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

from .checkpoint import checkpoints_dir, latest_tag
from .config import ConfigError

RUN_CONFIG = "run_config.json"


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
