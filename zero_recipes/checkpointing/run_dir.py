"""One run per output_dir, and nothing in it touched that this project did not write.

output_dir/run_config.json   what makes this run this run (compared on relaunch)
output_dir/run_files.json    every top-level entry this project wrote there: --overwrite_output_dir
                             removes only those, and a user's file under a name a run writes is refused
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from fnmatch import fnmatch
from pathlib import Path
from typing import Optional

from zero_recipes.checkpointing import atomic, storage
from zero_recipes.checkpointing.checkpoint import latest_tag
from zero_recipes.config.lora_options import changed_settings
from zero_recipes.errors import ConfigError

RUN_CONFIG = "run_config.json"
MANIFEST = "run_files.json"  # the top-level entries this project wrote; only these may ever be removed
DS_CONFIG = "ds_config.json"  # the resolved DeepSpeed config the run trained with

# What a run writes at the top of output_dir besides the export: its config, metrics, trackers, checkpoints
# and tools/plot_metrics.py's default folder. wandb/ is never removed: an offline W&B run may not be synced.
RUN_ENTRIES = (
    MANIFEST,
    RUN_CONFIG,
    DS_CONFIG,
    "metrics.jsonl",
    "checkpoints",
    "tensorboard",
    "plots",
    "eval_samples.html",  # --eval_samples' page (evaluation/in_training.py)
    "eval_samples.jsonl",
    "wandb",
    "wandb_run_id",
)
KEPT_ON_OVERWRITE = ("wandb", MANIFEST)
# Names the export may write (save_pretrained of a model, a PEFT adapter and any tokenizer): a user's file
# under one of them would be replaced, so it is refused up front. Generous on purpose: tokenizers differ.
EXPORT_PATTERNS = (
    "config.json",
    "generation_config.json",
    "model*.safetensors",
    "model.safetensors.index.json",
    "pytorch_model*.bin*",
    "adapter_config.json",
    "adapter_model.*",
    "README.md",  # PEFT's model card
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template*",
    "vocab*",
    "merges.txt",
    "*.model",  # sentencepiece
    "*.tiktoken",
)


def may_write(name: str) -> bool:
    """Whether a run or its export may write a top-level entry of this name."""
    return name in RUN_ENTRIES or any(fnmatch(name, p) for p in EXPORT_PATTERNS)


def recorded(output_dir: Path) -> Optional[set]:
    """The names the manifest lists; None without a manifest, and none at all when it cannot be read (own
    nothing rather than risk a user's file)."""
    manifest = output_dir / MANIFEST
    if not manifest.is_file():
        return None
    try:
        return set(json.loads(manifest.read_text())["written"])
    except (json.JSONDecodeError, KeyError, TypeError):
        return set()


def our_entries(output_dir: Path) -> list[str]:
    """The top-level entries of output_dir this project wrote. A run from before the manifest existed is
    taken to own only the names it may write (its run_config.json and ds_config.json say a run was there)."""
    names = sorted(os.listdir(output_dir)) if output_dir.is_dir() else []
    ours = recorded(output_dir)
    if ours is not None:
        return [n for n in names if n in ours | {MANIFEST}]
    if (output_dir / RUN_CONFIG).is_file() and (output_dir / DS_CONFIG).is_file():
        return [n for n in names if may_write(n)]
    return []


def user_entries(output_dir: Path) -> list[str]:
    """The top-level entries of output_dir this project did not write: never replaced nor removed."""
    ours = set(our_entries(output_dir))
    return [n for n in sorted(os.listdir(output_dir)) if n not in ours] if output_dir.is_dir() else []


def record(output_dir: Path, names) -> None:
    """Add NAMES to the manifest (rank 0)."""
    write_manifest(output_dir, (recorded(output_dir) or set()) | set(names))


def write_manifest(output_dir: Path, names) -> None:
    """Atomic: a kill leaves the old manifest or the new one."""
    atomic.write_text(output_dir / MANIFEST, json.dumps({"written": sorted(set(names) | {MANIFEST})}, indent=1))


def check_output_dir(output_dir: Path, signature: dict, overwrite: bool, resume: Optional[str]) -> Optional[str]:
    """Decide what this launch may do with output_dir. Returns the resume request ('auto', a path or None).

    - Empty or new: train from scratch.
    - Same run (same signature): resume from its newest checkpoint, so repeating a launch continues or
      finishes instead of failing.
    - Another run: refuse unless --overwrite_output_dir, or --resume_from_checkpoint was given (changing
      e.g. max_steps to extend a run is then deliberate).
    - Files that are not a zero-recipes run: refuse unless --overwrite_output_dir, which keeps them.
    - A file of the user's under a name this run writes (config.json, model.safetensors, ...): refused
      whatever the flags, since the export would replace it.
    - A path that is a file, or where this user cannot write: refuse, before anything is created."""
    check_writable(output_dir)
    if not output_dir.exists() or not any(output_dir.iterdir()):
        return resume
    saved = output_dir / RUN_CONFIG
    if not saved.is_file() and not overwrite:
        raise ConfigError(
            f"output_dir {output_dir} is not empty and holds no zero-recipes run; choose another "
            "--output_dir, or pass --overwrite_output_dir (it keeps every file this project did not write)"
        )
    if clashes := [name for name in user_entries(output_dir) if may_write(name)]:
        raise ConfigError(
            f"output_dir {output_dir} holds files this project did not write under names its run and export "
            f"write: {', '.join(clashes[:8])}{' ...' if len(clashes) > 8 else ''}; move them, or choose another "
            "--output_dir"
        )
    if not saved.is_file():
        return resume
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
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"--output_dir {output_dir} is a file, not a directory; choose another --output_dir")
    existing = storage.nearest_existing(output_dir)
    if not existing.is_dir():
        raise ConfigError(
            f"--output_dir {output_dir}: {existing} is a file, not a directory; choose another --output_dir"
        )
    storage.check_writable(output_dir, "--output_dir")


def clear_previous_run(output_dir: Path) -> None:
    """--overwrite_output_dir: remove what an earlier zero-recipes run wrote (its manifest), nothing else.
    The old run's derived files go too: TensorBoard would draw both runs as one line, and plots/ would
    show the old run. The manifest then names only what stayed, so a name freed here is the user's again."""
    kept = []
    for name in our_entries(output_dir):
        path = output_dir / name
        if name in KEPT_ON_OVERWRITE:
            kept.append(name)
        elif path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    if (output_dir / MANIFEST).exists():
        write_manifest(output_dir, kept)


def write_run_config(output_dir: Path, signature: dict, ds_config: dict) -> None:
    atomic.write_text(output_dir / RUN_CONFIG, json.dumps(signature, indent=2, sort_keys=True))
    atomic.write_text(output_dir / DS_CONFIG, json.dumps(ds_config, indent=2))


def start_run(plan, rank: int) -> None:
    """Collective. Only now, with the data and config known good, is output_dir touched: bad input
    leaves it as it was. Every rank has read output_dir before rank 0 writes to it."""
    import torch

    torch.distributed.barrier()
    out = plan.output_dir

    def rank0_writes() -> None:
        if rank != 0:
            return
        if plan.cfg.overwrite_output_dir and plan.cfg.resume_from_checkpoint is None:
            clear_previous_run(out)
        out.mkdir(parents=True, exist_ok=True)
        if kept := user_entries(out):
            print(
                f"output_dir: {len(kept)} entries this project did not write stay untouched: "
                f"{', '.join(kept[:6])}{' ...' if len(kept) > 6 else ''}",
                flush=True,
            )
        record(out, RUN_ENTRIES)
        write_run_config(out, plan.signature, plan.ds)

    # a full or read-only output_dir at the start: one line on every rank, before any of them builds a model
    if failure := storage.agree(storage.attempt(rank0_writes, "starting the run", out)):
        raise storage.StorageError(storage.describe(failure))


@contextmanager
def recording(output_dir: Path, rank: int):
    """Around the export: what appears in output_dir while it runs is this run's (rank 0 records it)."""
    before = set(os.listdir(output_dir)) if rank == 0 else set()
    yield
    if rank == 0:
        record(output_dir, sorted(set(os.listdir(output_dir)) - before))
