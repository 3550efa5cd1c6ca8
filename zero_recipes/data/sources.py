"""Where examples come from: the embedded sets, local files, saved datasets, hub ids, mixtures of them,
and streams. Each dataset is described by a `DatasetSpec`; `describe` turns it into something that
changes whenever the data does (the cache key), `load` into a `datasets` object."""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

from zero_recipes.config.train_config import (
    BUILTIN_DATASET,
    BUILTIN_INSTRUCTIONS,
    DATASET_FORMATS,
    parse_inline_or_file,
)
from zero_recipes.modeling.hub import unreachable

from ..errors import ConfigError
from . import builtin, formats

LOCAL_BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".txt": "text",
    ".text": "text",
}
BUILTINS = {
    BUILTIN_DATASET: builtin.builtin_corpus_file,
    BUILTIN_INSTRUCTIONS: builtin.builtin_instructions_file,
    builtin.BUILTIN_PREFERENCES: builtin.builtin_preferences_file,
}


@dataclass
class DatasetSpec:
    name: str
    config: Optional[str] = None
    split: str = "train"
    eval_split: Optional[str] = None
    format: str = "auto"
    text_column: str = "text"
    weight: float = 1.0


def dataset_specs(cfg) -> list[DatasetSpec]:
    """The datasets of this run: `dataset_name` alone, or the weighted `dataset_mixture`."""
    mixture = parse_inline_or_file("dataset_mixture", cfg.dataset_mixture)
    base = dict(
        config=cfg.dataset_config_name,
        split=cfg.dataset_split,
        eval_split=cfg.eval_split,
        format=cfg.dataset_format,
        text_column=cfg.text_column,
    )
    if mixture is None:
        return [DatasetSpec(name=cfg.dataset_name, **base)]
    if not isinstance(mixture, list) or not mixture:
        raise ConfigError("--dataset_mixture must be a non-empty list of {name, weight, ...} entries")
    known = [f.name for f in fields(DatasetSpec)]
    specs = []
    for i, entry in enumerate(mixture):
        if not isinstance(entry, dict) or "name" not in entry or "weight" not in entry:
            raise ConfigError(
                f"dataset_mixture entry {i + 1} must be a mapping with at least name and weight, got {entry!r}"
            )
        for key in entry:
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                hint = f"; did you mean '{close[0]}'?" if close else f"; known keys: {', '.join(known)}"
                raise ConfigError(f"dataset_mixture entry {i + 1} has unknown key '{key}'{hint}")
        spec = DatasetSpec(**{**base, **entry})
        if spec.format not in DATASET_FORMATS:
            raise ConfigError(
                f"dataset_mixture entry {i + 1}: format '{spec.format}' is not one of {', '.join(DATASET_FORMATS)}"
            )
        try:
            spec.weight = float(spec.weight)
        except (TypeError, ValueError):
            raise ConfigError(
                f"dataset_mixture entry {i + 1}: weight must be a number, got {entry['weight']!r}"
            ) from None
        if spec.weight <= 0:
            raise ConfigError(f"dataset_mixture entry {i + 1} ({spec.name}): weight must be > 0, got {spec.weight}")
        specs.append(spec)
    total = sum(s.weight for s in specs)
    if abs(total - 1.0) > 1e-6:
        raise ConfigError(
            f"dataset_mixture weights add up to {total:g}, not 1 "
            f"({' + '.join(f'{s.weight:g}' for s in specs)}); scale them so they sum to 1"
        )
    return specs


def describe(spec: DatasetSpec, cfg) -> dict:
    """Where the examples come from, in a form that changes when the data changes."""
    if spec.name in BUILTINS:
        p = BUILTINS[spec.name](cfg)
        return {"kind": "local", "builder": "json", "path": str(p), "stat": [p.stat().st_size, p.stat().st_mtime]}
    if spec.name.startswith("builtin:"):
        raise ConfigError(f"unknown embedded dataset '{spec.name}'; embedded sets: {', '.join(BUILTINS)}")
    p = Path(os.path.expanduser(spec.name))
    if p.is_dir():
        # saved by `datasets` (save_to_disk), or laid out like a hub dataset repo (data files, README
        # configs), which load_dataset reads through the same code path as a hub id
        stat = [
            (str(f.relative_to(p)), f.stat().st_size, f.stat().st_mtime) for f in sorted(p.rglob("*")) if f.is_file()
        ]
        saved = (p / "state.json").exists() or (p / "dataset_dict.json").exists()
        return {
            "kind": "saved" if saved else "hub",
            "name": str(p.resolve()),
            "path": str(p.resolve()),
            "config": spec.config,
            "stat": stat,
        }
    if p.is_file():
        builder = LOCAL_BUILDERS.get(p.suffix.lower())
        if builder is None:
            raise ConfigError(
                f"dataset file '{p}' has an unsupported extension; use "
                f"{', '.join(sorted(LOCAL_BUILDERS))} or a directory saved by datasets"
            )
        return {
            "kind": "local",
            "builder": builder,
            "path": str(p.resolve()),
            "stat": [p.stat().st_size, p.stat().st_mtime],
        }
    if spec.name.startswith((".", "/", "~")) or Path(spec.name).suffix.lower() in LOCAL_BUILDERS:
        raise ConfigError(
            f"dataset '{spec.name}' does not exist; give an existing file, a saved dataset "
            "directory or a hub dataset id"
        )
    return {"kind": "hub", "name": spec.name, "config": spec.config}


def load(spec: DatasetSpec, source: dict, split: str, streaming: bool = False, trust_remote_code: bool = False):
    """Load one split as a `datasets.Dataset` (or `IterableDataset` when streaming). Local files have a
    single split: asking for another one is an error, not a silent fallback."""
    import datasets

    try:
        if source["kind"] == "saved":
            ds = datasets.load_from_disk(source["path"])
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise ConfigError(f"dataset '{spec.name}' has no split '{split}' (splits: {', '.join(ds)})")
                ds = ds[split]
            elif split != "train":
                raise ConfigError(f"dataset '{spec.name}' is a single split; it has no split '{split}'")
            return ds.to_iterable_dataset() if streaming else ds
        if source["kind"] == "local":
            if Path(source["path"]).stat().st_size == 0:
                raise ConfigError(f"dataset file '{spec.name}' is empty")
            check_utf8(Path(source["path"]), source["builder"])
            if split != "train":
                raise ConfigError(
                    f"dataset file '{spec.name}' is a single split; it has no split '{split}'. "
                    "Give the eval data as its own file in a mixture, or use the held-out fraction"
                )
            return datasets.load_dataset(
                source["builder"], data_files=source["path"], split="train", streaming=streaming
            )
        kwargs = {"trust_remote_code": True} if trust_remote_code else {}
        return datasets.load_dataset(source["name"], source["config"], split=split, streaming=streaming, **kwargs)
    except ConfigError:
        raise
    except Exception as e:  # datasets and the hub raise many classes; each means bad input to the user
        raise as_config_error(e, spec, source) from None


def as_config_error(e: Exception, spec: DatasetSpec, source: dict) -> Exception:
    """What loading or reading a dataset raised, as the one line that names it (the exception itself when it is
    not about the data)."""
    if source["kind"] == "local":
        diagnose_file(Path(source["path"]), source["builder"])
        return ConfigError(f"cannot load dataset file '{spec.name}': {first_line(e)}")
    if isinstance(e, (FileNotFoundError, ValueError, ConnectionError, KeyError, UnicodeDecodeError)) or type(
        e
    ).__module__.startswith(("huggingface_hub", "datasets", "requests", "httpx", "pyarrow")):
        return ConfigError(f"cannot load dataset '{spec.name}': {first_line(e)}")
    return e


def check(cfg, sample: bool = False) -> list[str]:
    """Every dataset of the run, before any process group starts: a missing file, an unknown embedded set or a
    bad mixture fails here. With `sample` (--dry_run) the first rows of each split are read too and checked
    against the format as preparing the data would check them; a hub dataset only when the hub can be reached.
    Returns what a dry run reports, a line per dataset."""
    lines = []
    for spec in dataset_specs(cfg):
        if spec.name in BUILTINS:
            continue  # embedded: known good, and written on first use
        source = describe(spec, cfg)
        if sample:
            lines.append(read_sample(spec, source, cfg))
    return lines


SAMPLE_ROWS = 16


def read_sample(spec: DatasetSpec, source: dict, cfg) -> str:
    """The first SAMPLE_ROWS rows of each split, streamed (no Arrow cache is written), checked for the
    format's columns and rows."""
    from itertools import islice

    if source["kind"] == "hub" and not Path(source["name"]).is_dir() and (why := unreachable()):
        return f"{spec.name}: a hub dataset, not read (hub offline: {why})"
    splits = [spec.split] + ([spec.eval_split] if spec.eval_split else [])
    for split in splits:
        ds = load(spec, source, split, streaming=True, trust_remote_code=cfg.trust_remote_code)
        try:
            rows = list(islice(ds, SAMPLE_ROWS))
        except ConfigError:
            raise
        except Exception as e:  # as in load: the stream reads the file only now
            raise as_config_error(e, spec, source) from None
        if not rows:
            raise ConfigError(f"dataset '{spec.name}' (split {split}) is empty")
        name = spec.name if split == spec.split else f"{spec.name}:{split}"  # as preparing the data names it
        fmt, how = formats.detect_format(spec.format, list(rows[0]), spec.text_column, name)
        try:
            for i, row in enumerate(rows, 1):
                formats.check_example(fmt, row, i)
        except ConfigError as e:
            raise ConfigError(f"dataset '{name}', {e}") from None
    return f"{spec.name}: the first {len(rows)} rows of {' and '.join(splits)} read; {how}"


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def check_utf8(path: Path, builder: str) -> None:
    """pyarrow reads invalid UTF-8 in JSON without complaint and tokenising then fails deep inside a
    worker; a C-speed incremental decode of the file (about 1 s/GB) catches it first."""
    import codecs

    if builder not in ("json", "csv", "text"):
        return
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with path.open("rb") as f:
            while chunk := f.read(1 << 26):
                decoder.decode(chunk)
            decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        diagnose_file(path, builder)


def diagnose_file(path: Path, builder: str) -> None:
    """Name the first line that is not UTF-8 or (for jsonl) not valid JSON. `datasets` reports only
    "An error occurred while generating the dataset", which leaves the user searching."""
    if builder not in ("json", "csv", "text"):
        return
    with path.open("rb") as f:
        if b"\0" in f.read(8192):  # no text encoding but UTF-16/32 has NUL bytes, and those need a BOM to read
            raise ConfigError(
                f"{path} is a binary file (NUL bytes in its first 8 KB), not {builder} text; give the dataset "
                "as UTF-8 .jsonl, .json, .csv or .txt, or as .parquet"
            )
        f.seek(0)
        head = f.read(1)
        f.seek(0)
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(
                    f"{path}:{lineno}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                    "re-encode the file as UTF-8, e.g. iconv -f latin1 -t utf-8"
                ) from None
            if builder == "json" and head != b"[" and line.strip():
                try:
                    json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(
                        f"{path}:{lineno}:{e.colno}: not valid JSON lines: {e.msg}; each line must be one JSON object"
                    ) from None
    if builder == "json" and head == b"[":
        try:
            json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{e.lineno}:{e.colno}: not valid JSON: {e.msg}") from None
