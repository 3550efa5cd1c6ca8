"""Writes that a reader, a kill or a full disk never leaves half done: the old file stays until the new one is
whole. A file or a directory (a cache entry) is written under a hidden name beside it and renamed (`staged`,
`write_text`); a set of files in a directory that holds others too (a model or adapter export) is written into a
hidden staging directory there and renamed in, file by file (`replaced_files`). What a failure means for
the run is storage.py's."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from fnmatch import fnmatch
from pathlib import Path

# The weights save_pretrained writes: renamed in first, and any of the previous export's that the new one does
# not write (a shard count that changed) removed, so the directory never mixes two exports' shards.
WEIGHT_PATTERNS = ("model*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin*", "adapter_model.*")
STAGING_PREFIX = ".staging-"


def write_text(path: Path, text: str) -> None:
    """Written whole under a hidden per-process name, then renamed over `path`: ranks or processes writing at once
    leave one complete file, the last one's; a failed write leaves the previous file and no temporary."""
    with staged(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


@contextmanager
def staged(out: Path):
    """A hidden per-process name beside `out` (a file or a directory) for the body to write; renamed to `out`
    when the body succeeds, removed when it fails (a full disk, a read-only directory, a kill's exception):
    `out` is the previous one whole, or the new one whole."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        yield tmp
        if out.is_dir():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)


@contextmanager
def replaced_files(out_dir: Path):
    """Yield a staging directory inside `out_dir` (the same filesystem, so a rename moves a file without copying
    it); once the body has written everything there, each file replaces its namesake in `out_dir`. If the body
    fails, `out_dir` keeps its previous files untouched and the staging directory is removed: a half-written
    model.safetensors never replaces a good one."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stage = out_dir / f"{STAGING_PREFIX}{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    try:
        stage.mkdir()
        yield stage
        publish(stage, out_dir)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def is_weights(name: str) -> bool:
    return any(fnmatch(name, p) for p in WEIGHT_PATTERNS)


def publish(stage: Path, out_dir: Path) -> None:
    """Rename the staged files over their namesakes, weights first (a config is never newer than its weights),
    then drop the previous export's weight files that this one did not write."""
    names = sorted(os.listdir(stage), key=lambda n: (not is_weights(n), n))
    for name in names:
        target = out_dir / name
        if (stage / name).is_dir() and target.is_dir():
            shutil.rmtree(target)
        os.replace(stage / name, target)
    if any(is_weights(n) for n in names):
        for old in os.listdir(out_dir):
            if is_weights(old) and old not in names and (out_dir / old).is_file():
                (out_dir / old).unlink()
