"""Is a checkpoint intact? Its manifest (every file's size as the save wrote it), what is wrong with a checkpoint
whose files no longer match it, and the newest intact one a resume may take (saving: checkpoint.py).

Checked before any process group starts, by every rank on its own (they cannot talk yet, and must choose the
same checkpoint; on the shared filesystem they all see the same files). What it costs: one stat per file, plus
reading each .pt file's zip directory (its last few KB), per rank.
"""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path
from typing import Optional

from zero_recipes.checkpointing import atomic
from zero_recipes.errors import ConfigError

LAYOUT = "layout.json"  # per checkpoint: the data-parallel size, TP, SP and PP sizes and ZeRO stage that saved it
MANIFEST = "manifest.json"  # per checkpoint: {"files": {path inside the tag directory: bytes}}


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


def manifest_files(tag_dir: Path) -> Optional[dict[str, int]]:
    """The manifest's {path inside the tag directory: bytes}; None when there is none or it cannot be read."""
    files = (read_json(tag_dir / MANIFEST) or {}).get("files")
    return files if isinstance(files, dict) else None


def damage(tag_dir: Path) -> Optional[str]:
    """What is wrong with a checkpoint, in a few words that name the file; None when it is intact.

    With a manifest: every file it lists is there with the size the save wrote. Without one, a save that
    writes manifests did not finish (layout.json says so); a checkpoint from before manifests is trusted as
    before, less what needs no manifest: every rank's rng_state file and a model-state file are there.
    Either way each .pt file must open as torch.save's zip archive, as torch.load opens it."""
    layout = read_json(tag_dir / LAYOUT) or {}
    if (tag_dir / MANIFEST).is_file():
        expected = manifest_files(tag_dir)
        if expected is None:
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
