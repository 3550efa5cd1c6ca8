"""DeepSpeed checkpoints inside output_dir: saving them, their rotation, finding one, and checking that it is
intact before it is trusted (resuming: resume.py; one run per output_dir and what a run may touch there:
run_dir.py).

Layout:  output_dir/checkpoints/latest     the newest complete tag, written after every rank's files
         output_dir/checkpoints/step-N/    DeepSpeed's own files, plus rng_state_<rank>.pt, layout.json, hf/
                                           and manifest.json: every file's size as the save wrote it
"""

from __future__ import annotations

import json
import re
import shutil
import zipfile
from pathlib import Path
from typing import Optional

from zero_recipes.checkpointing import atomic, storage
from zero_recipes.checkpointing.rng import rng_state
from zero_recipes.errors import ConfigError

LAYOUT = "layout.json"  # per checkpoint: the data-parallel size, TP, SP and PP sizes and ZeRO stage that saved it
UNIVERSAL_SUFFIX = "-universal"
HF_FILES = "hf"  # per checkpoint: config, generation config and tokenizer, so tools/export_hf.py needs nothing else
MANIFEST = "manifest.json"  # per checkpoint: {"files": {path inside the tag directory: bytes}}


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
    dir with a manifest or layout is a checkpoint even when its model-state file is gone (damage() says so)."""
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


# ---- is a checkpoint intact? ---------------------------------------------------------------------------
# Checked before any process group starts, by every rank on its own (they cannot talk yet, and must choose
# the same checkpoint; on the shared filesystem they all see the same files). What it costs: one stat per
# file, plus reading each .pt file's zip directory (its last few KB), per rank.


def damage(tag_dir: Path) -> Optional[str]:
    """What is wrong with a checkpoint, in a few words that name the file; None when it is intact.

    With a manifest: every file it lists is there with the size the save wrote. Without one, a save that
    writes manifests did not finish (layout.json says so); a checkpoint from before manifests is trusted as
    before, less what needs no manifest: every rank's rng_state file and a model-state file are there.
    Either way each .pt file must open as torch.save's zip archive, as torch.load opens it."""
    sizes = tag_dir / MANIFEST
    layout = read_json(tag_dir / LAYOUT) or {}
    if sizes.is_file():
        expected = (read_json(sizes) or {}).get("files")
        if not isinstance(expected, dict):
            return f"{MANIFEST} cannot be read"
    elif layout.get("manifest"):
        return f"{MANIFEST} is missing: the save did not finish"
    else:
        ranks = layout.get("world", 1) * layout.get("tensor_parallel", 1) * layout.get("sequence_parallel", 1)
        ranks *= layout.get("pipeline_parallel", 1)
        expected = {f"rng_state_{r}.pt": None for r in range(ranks) if layout}
        if not any(tag_dir.glob("*model_states.pt")):
            return "no model_states.pt file is there"
    for name, size in expected.items():
        if problem := file_damage(tag_dir / name, size):
            return f"{name} {problem}"
    for f in sorted(tag_dir.glob("*.pt")):
        if f.name not in expected and (problem := file_damage(f, None)):
            return f"{f.name} {problem}"
    return None


def file_damage(path: Path, size: Optional[int]) -> Optional[str]:
    """What is wrong with one file whose saved size is `size` (None: not recorded)."""
    try:
        actual = path.stat().st_size
    except FileNotFoundError:
        return "is missing"
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    wrote = "" if size is None else f"; the save wrote {size}"
    if actual == 0 and size != 0:
        return f"is empty (0 bytes{wrote})"
    if size is not None and actual != size:
        return f"is {actual} bytes{wrote}" + (" (truncated)" if actual < size else "")
    return unreadable_zip(path) if path.suffix == ".pt" else None


def unreadable_zip(path: Path) -> Optional[str]:
    """torch.save writes a zip archive with its directory at the end, so a cut or overwritten file fails
    here as torch.load would fail on it ("PytorchStreamReader failed reading zip archive"), without reading
    the tensors. A file in another format (another checkpoint writer) is not judged."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"PK\x03\x04":
                return None
        zipfile.ZipFile(path).close()
    except (OSError, zipfile.BadZipFile) as e:
        return f"cannot be read as torch.save wrote it ({e})"
    return None


def read_json(path: Path) -> Optional[dict]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def older_tags(base: Path, tag: str) -> list[str]:
    """The step-M tags in `base` before `tag`, newest first (none when `tag` is not a step-N)."""
    if not re.fullmatch(r"step-\d+", tag):
        return []
    n = int(tag.split("-")[1])
    steps = [int(p.name.split("-")[1]) for p in base.glob("step-*") if p.is_dir() and re.fullmatch(r"step-\d+", p.name)]
    return [f"step-{m}" for m in sorted((m for m in steps if m < n), reverse=True)]


def newest_intact(base: Path, tag: str) -> tuple[tuple[Path, str], Optional[str]]:
    """`tag`, or the newest intact checkpoint before it, and a line naming each damaged one passed over.
    Newer tags than `latest` are never taken: `latest` moves only once a save is complete."""
    passed = []
    for candidate in [tag, *older_tags(base, tag)]:
        problem = damage(base / candidate)
        if problem is None:
            line = f"resume: {'; '.join(passed)}; using {candidate}, the newest intact checkpoint" if passed else None
            return (base, candidate), line
        passed.append(f"{base / candidate} is damaged ({problem})")
    more = f" and {len(passed) - 2} more" if len(passed) > 2 else ""
    raise ConfigError(
        f"no intact checkpoint to resume from: {'; '.join(passed[:2])}{more}. Start over with "
        "--overwrite_output_dir, or train into another --output_dir"
    )


def check_intact(where: tuple[Path, str], what: str = "") -> None:
    """Refuse a damaged checkpoint in one line (prefixed by `what`), naming the newest intact one before it."""
    base, tag = where
    problem = damage(base / tag)
    if problem is None:
        return
    intact = next((t for t in older_tags(base, tag) if damage(base / t) is None), None)
    hint = (
        f"the newest intact checkpoint before it is {base / intact}" if intact else "no checkpoint before it is intact"
    )
    raise ConfigError(f"{what}{base / tag} is damaged: {problem}; {hint}")


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
    if rank == 0:  # the tag saved again (a resume passed it over as damaged, or a save was killed): its old
        (d / tag / MANIFEST).unlink(missing_ok=True)  # sizes and conversion describe files about to be replaced
        shutil.rmtree(d / (tag + UNIVERSAL_SUFFIX), ignore_errors=True)
        # Room first: the disk never holds more than `keep` checkpoints, and a save that fails leaves keep - 1
        # complete ones. keep 1 rotates only after the save: the one complete checkpoint stays until then.
        if keep > 1:
            rotate(output_dir, keep - 1, but=tag)
    torch.distributed.barrier()  # before any rank replaces a file: a kill now must not leave old sizes over new files
    saving = SaveAttempt(engine, output_dir, tag, mesh_layout)

    def own_files() -> None:
        (d / tag).mkdir(parents=True, exist_ok=True)
        # RNG and data position per rank: DeepSpeed saves none, dropout streams differ per rank, and a
        # streamed dataset is read at a different place on each rank.
        torch.save({**rng_state(), **(rank_state or {})}, d / tag / f"rng_state_{rank}.pt")
        if rank == 0 and hf_writer is not None:
            hf_writer(d / tag / HF_FILES)
        if rank == 0:  # what a later resume compares against its own layout ("world": data-parallel ranks)
            sizes = dict(mesh_layout)
            layout = {"world": sizes.pop("world"), "step": step, "zero_stage": int(engine.zero_optimization_stage())}
            # "manifest": this save writes one, so a checkpoint of it without one is a save that did not finish
            (d / tag / LAYOUT).write_text(json.dumps({**layout, **sizes, "manifest": True}))

    saving.step(own_files)
    # DeepSpeed's own `latest` is written by rank 0 as soon as rank 0's files are done, before the other
    # ranks finish theirs (engine.save_checkpoint, 0.19.8), so a rank killed mid-save could leave `latest`
    # naming a partial checkpoint (the kill-in-save test fails that way). Here it is written only after
    # every rank's files exist, and atomically. A LoRA run's frozen base is the pretrained model: not saved
    # again (its adapter config names it).
    saving.step(
        lambda: engine.save_checkpoint(
            str(d), tag=tag, client_state=client_state, save_latest=False, exclude_frozen_parameters=has_frozen(engine)
        ),
        # DeepSpeed's save ends in a barrier, after its writes (engine.py, 0.19.8), where the ranks whose writes
        # succeeded now wait: a rank whose write raised joins them there before all agree.
        after_failure=torch.distributed.barrier,
    )
    # The manifest: each rank lists the files it sees with their sizes; rank 0 writes their union, each file at
    # the largest size any rank saw. Every rank rather than rank 0 alone, because on a network filesystem rank
    # 0's client may list another node's just-written files late or with a stale size (NFS caches listings and
    # attributes), while the writer sees its own file whole, and a file only grows while it is written. One
    # manifest, by rank 0: output_dir must be on a filesystem every node sees (docs/troubleshooting.md).
    views = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(views, file_sizes(d / tag))

    def manifest_and_latest() -> None:
        if rank == 0:
            write_manifest_of(d / tag, views)
            atomic.write_text(d / "latest", tag)

    saving.step(manifest_and_latest)
    if rank == 0 and keep > 0:
        rotate(output_dir, keep)
    torch.distributed.barrier()
    return d / tag


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
        if newest and (files := (read_json(checkpoints_dir(self.output_dir) / newest / MANIFEST) or {}).get("files")):
            return sum(files.values())
        total = 0
        for p in self.engine.module.parameters():  # a frozen (LoRA base) parameter is not saved (has_frozen)
            if p.requires_grad:
                total += getattr(p, "ds_numel", p.numel()) * (p.element_size() + 12)  # ZeRO-3: its full size
        pieces = self.mesh_layout.get("tensor_parallel", 1) * self.mesh_layout.get("pipeline_parallel", 1)
        return total * pieces


def write_manifest_of(tag_dir: Path, views: list[dict[str, int]]) -> None:
    """The manifest of what the ranks saw (file_sizes each), atomically: a kill leaves none or all of it."""
    files: dict[str, int] = {}
    for view in views:
        for name, size in view.items():
            files[name] = max(size, files.get(name, 0))
    atomic.write_text(tag_dir / MANIFEST, json.dumps({"files": dict(sorted(files.items()))}, indent=1))


def file_sizes(tag_dir: Path) -> dict[str, int]:
    """Every file under a tag directory but the manifest, by its path there."""
    return {
        f.relative_to(tag_dir).as_posix(): f.stat().st_size
        for f in tag_dir.rglob("*")
        if f.is_file() and not f.name.startswith(MANIFEST)
    }


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
