"""DeepSpeed checkpoints inside output_dir: saving them, their rotation and finding one (whether one is intact
before it is trusted: integrity.py; resuming: resume.py; one run per output_dir and what a run may touch there:
run_dir.py).

Layout:  output_dir/checkpoints/latest     the newest complete tag, written after every rank's files
         output_dir/checkpoints/step-N/    DeepSpeed's own files, plus rng_state_<rank>.pt, layout.json, hf/
                                           and manifest.json: every file's size as the save wrote it
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Optional

from zero_recipes.checkpointing import atomic, storage
from zero_recipes.checkpointing.integrity import (
    LAYOUT,
    MANIFEST,
    check_intact,
    file_sizes,
    manifest_files,
    newest_intact,
    write_manifest_of,
)
from zero_recipes.checkpointing.rng import rng_state
from zero_recipes.errors import ConfigError

UNIVERSAL_SUFFIX = "-universal"
HF_FILES = "hf"  # per checkpoint: config, generation config and tokenizer, so tools/export_hf.py needs nothing else


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
    when there is none. A `latest` that names a missing tag is an error, not a silent fallback. A step-N
    dir with a manifest or layout is a checkpoint even when its model-state file is gone (integrity.damage
    says so)."""
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
    if p.is_dir() and (any((p / f).is_file() for f in (MANIFEST, LAYOUT)) or any(p.glob("*model_states.pt"))):
        return p.parent, p.name
    return None


def resolve_resume(output_dir: Path, request: Optional[str]) -> tuple[Optional[tuple[Path, str]], Optional[str]]:
    """(where to resume from, a line to log). 'auto' -> the newest intact checkpoint (or None when none was
    saved), the line naming each damaged one passed over; a path -> that checkpoint, refused if damaged:
    the user chose it, so another one is not silently taken instead."""
    if request is None:
        return None, None
    if request == "auto":
        tag = latest_tag(output_dir)
        return newest_intact(checkpoints_dir(output_dir), tag) if tag else (None, None)
    found = find_checkpoint(Path(request))
    if found is None:
        raise ConfigError(
            f"--resume_from_checkpoint {request}: no DeepSpeed checkpoint there; give 'auto', an "
            "output_dir, its checkpoints/ directory or a checkpoints/step-N directory"
        )
    check_intact(found, f"--resume_from_checkpoint {request}: ")
    return found, None


def save(
    engine,
    output_dir: Path,
    step: int,
    client_state: dict,
    rank: int,
    keep: int,
    rank_state: dict | None = None,
    hf_writer=None,
    *,
    mesh_layout: dict,
) -> Path:
    """Save a checkpoint; its manifest, then `latest`, are written only after every rank's files are.
    `mesh_layout`: the saving mesh's sizes (mesh.Mesh.layout), recorded for a later resume to compare.

    Storage that fails on any rank (a full disk, a read-only remount) stops every rank with one StorageError,
    after the partial step-N is removed: `latest` and a resume find the newest complete checkpoint, as before."""
    import torch

    d = checkpoints_dir(output_dir)
    tag = f"step-{step}"
    if rank == 0:
        clear_for_save(output_dir, tag, keep)
    torch.distributed.barrier()  # before any rank replaces a file: a kill now must not leave old sizes over new files
    saving = SaveAttempt(engine, output_dir, tag, mesh_layout)

    def own_files() -> None:
        (d / tag).mkdir(parents=True, exist_ok=True)
        # RNG and data position per rank: DeepSpeed saves none, dropout streams differ per rank, and a
        # streamed dataset is read at a different place on each rank.
        torch.save({**rng_state(), **(rank_state or {})}, d / tag / f"rng_state_{rank}.pt")
        if rank == 0 and hf_writer is not None:
            hf_writer(d / tag / HF_FILES)
        if rank == 0:
            write_layout(d / tag, step, int(engine.zero_optimization_stage()), mesh_layout)

    saving.step(own_files)
    saving.step(
        lambda: save_engine_state(engine, d, tag, client_state),
        # DeepSpeed's save ends in a barrier, after its writes (engine.py, 0.19.8), where the ranks whose writes
        # succeeded now wait: a rank whose write raised joins them there before all agree.
        after_failure=torch.distributed.barrier,
    )
    views = every_rank_file_sizes(d / tag)

    def manifest_and_latest() -> None:
        if rank == 0:
            write_manifest_of(d / tag, views)
            atomic.write_text(d / "latest", tag)

    saving.step(manifest_and_latest)
    if rank == 0 and keep > 0:
        rotate(output_dir, keep)
    torch.distributed.barrier()
    return d / tag


def clear_for_save(output_dir: Path, tag: str, keep: int) -> None:
    """Rank 0, before a save. The tag saved again (a resume passed it over as damaged, or a save was killed):
    its old sizes and conversion describe files about to be replaced. Then room: the disk never holds more
    than `keep` checkpoints, and a save that fails leaves keep - 1 complete ones. keep 1 rotates only after
    the save: the one complete checkpoint stays until then."""
    d = checkpoints_dir(output_dir)
    (d / tag / MANIFEST).unlink(missing_ok=True)
    shutil.rmtree(d / (tag + UNIVERSAL_SUFFIX), ignore_errors=True)
    if keep > 1:
        rotate(output_dir, keep - 1, but=tag)


def write_layout(tag_dir: Path, step: int, zero_stage: int, mesh_layout: dict) -> None:
    """What a later resume compares against its own layout ("world": data-parallel ranks). "manifest": this
    save writes one, so a checkpoint of it without one is a save that did not finish (integrity.damage)."""
    sizes = dict(mesh_layout)
    layout = {"world": sizes.pop("world"), "step": step, "zero_stage": zero_stage}
    (tag_dir / LAYOUT).write_text(json.dumps({**layout, **sizes, "manifest": True}))


def save_engine_state(engine, checkpoints: Path, tag: str, client_state: dict) -> None:
    """DeepSpeed's files of the tag, without its `latest`: DeepSpeed writes that on rank 0 as soon as rank 0's
    files are done, before the other ranks finish theirs (engine.save_checkpoint, 0.19.8), so a rank killed
    mid-save could leave `latest` naming a partial checkpoint (the kill-in-save test fails that way); save()
    writes it only after every rank's files exist, and atomically. A LoRA run's frozen base is the pretrained
    model: not saved again (its adapter config names it)."""
    engine.save_checkpoint(
        str(checkpoints),
        tag=tag,
        client_state=client_state,
        save_latest=False,
        exclude_frozen_parameters=has_frozen(engine),
    )


def every_rank_file_sizes(tag_dir: Path) -> list[dict[str, int]]:
    """Collective: each rank's file_sizes of the tag directory, for the manifest (write_manifest_of keeps each
    file at the largest size any rank saw). Every rank rather than rank 0 alone, because on a network
    filesystem rank 0's client may list another node's just-written files late or with a stale size (NFS
    caches listings and attributes), while the writer sees its own file whole, and a file only grows while it
    is written. One manifest, by rank 0: output_dir must be on a filesystem every node sees
    (docs/troubleshooting.md)."""
    import torch

    views = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(views, file_sizes(tag_dir))
    return views


def rotate(output_dir: Path, keep: int, but: str = "") -> None:
    """Leave `keep` checkpoints (and their universal conversions): `latest`'s, which a resume takes even when
    newer damaged ones were passed over, and the newest others. `but`, the tag being saved, is left alone."""
    newest = latest_tag(output_dir)
    tags = [p for p in list_checkpoints(output_dir) if p.name != but]
    others = [p for p in tags if p.name != newest]
    room = max(keep - (len(others) < len(tags)), 0)
    for old in others[: len(others) - room]:
        shutil.rmtree(old, ignore_errors=True)
        shutil.rmtree(old.with_name(old.name + UNIVERSAL_SUFFIX), ignore_errors=True)


class SaveAttempt:
    """One checkpoint save as steps that every rank takes together: after each, the ranks agree whether any
    failed for want of storage (storage.agree); if one did, the partial tag is removed and every rank raises
    the same StorageError. The collectives stay matched, so no rank waits for one that gave up."""

    def __init__(self, engine, output_dir: Path, tag: str, mesh_layout: dict):
        self.engine, self.output_dir, self.tag, self.mesh_layout = engine, output_dir, tag, mesh_layout

    def step(self, writes, after_failure=None) -> None:
        import torch

        d = checkpoints_dir(self.output_dir)
        failure = storage.attempt(writes, f"saving checkpoint {self.tag}", d)
        if failure and after_failure is not None:
            after_failure()
        failure = storage.agree(failure)
        if failure is None:
            return
        if torch.distributed.get_rank() == 0:
            shutil.rmtree(d / self.tag, ignore_errors=True)
        torch.distributed.barrier()  # removed before any rank reports, so a relaunch never finds half of it
        raise storage.StorageError(f"{storage.describe(failure, self.needed_bytes)}. {self.what_remains(d)}")

    def what_remains(self, d: Path) -> str:
        partial = (
            f"No partial {self.tag} is left"
            if not (d / self.tag).exists()
            else f"The partial {self.tag} could not be removed; it has no manifest, so a resume passes it over"
        )
        newest = latest_tag(self.output_dir)
        resume = (
            f"the newest complete checkpoint, {newest}, is what relaunching the same command resumes from"
            if newest
            else "no checkpoint was complete before it"
        )
        kept = list_checkpoints(self.output_dir)
        room = (
            f" ({len(kept)} checkpoints are kept there: a lower --save_total_limit keeps fewer)"
            if len(kept) > 1
            else ""
        )
        return f"{partial}; {resume}{room}"

    def needed_bytes(self) -> int:
        """Roughly what one checkpoint takes, all ranks together: the newest complete one's size by its
        manifest, else each trained parameter in its dtype plus its fp32 master copy and Adam's two moments
        (12 bytes), times the model-parallel ranks holding other pieces."""
        newest = latest_tag(self.output_dir)
        if newest and (files := manifest_files(checkpoints_dir(self.output_dir) / newest)):
            return sum(files.values())
        total = 0
        for p in self.engine.module.parameters():  # a frozen (LoRA base) parameter is not saved (has_frozen)
            if p.requires_grad:
                total += getattr(p, "ds_numel", p.numel()) * (p.element_size() + 12)  # ZeRO-3: its full size
        pieces = self.mesh_layout.get("tensor_parallel", 1) * self.mesh_layout.get("pipeline_parallel", 1)
        return total * pieces


def has_frozen(engine) -> bool:
    """A LoRA run: some parameters train, the rest are the frozen pretrained base."""
    return any(not p.requires_grad for p in engine.module.parameters())


class Checkpointer:
    """Saves this run's checkpoints into output_dir/checkpoints, keeping the newest `keep`; the loop calls
    `save` at its save steps and on preemption."""

    def __init__(self, output_dir: Path, rank: int, keep: int, hf_writer, mesh_layout: dict):
        self.output_dir, self.rank, self.keep, self.hf_writer = output_dir, rank, keep, hf_writer
        self.mesh_layout = mesh_layout

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
            mesh_layout=self.mesh_layout,
        )

    def latest_tag(self) -> Optional[str]:
        return latest_tag(self.output_dir)
