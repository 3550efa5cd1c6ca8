"""Clean a dataset once into a JSON-lines file many runs can train on (`tools/clean_data.py`).

The steps and their order are train.py's (`cleaning.Cleaner`, `dedupe`): edits (fix_text, strip_html,
normalize_whitespace), then the garbled and quality judges, then exact or near dedupe among what is left.
They run as one batched `datasets.map` over `--preprocessing_num_workers` processes, with its progress bar
in documents/s; the data stays in Arrow files on disk, so memory grows only with the dedupe index (8
bytes a document for exact, 448 for near). Kept documents are written with every field unchanged except
the text the edits repaired; removed ones go to OUT.removed.jsonl with why (and which document a duplicate
repeats), and a report says what each step removed, with examples.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path

import numpy as np

from zero_recipes.checkpointing import atomic, storage
from zero_recipes.data.preparation import map_processes

from ..errors import ConfigError
from . import dedupe, formats, sources
from .cleaning import Cleaner, check_format, fix_strings
from .options import DataOptions

EXAMPLES_PER_REASON = 3
EXAMPLE_CHARS = 400
INTERNAL = ("_drop", "_hash", "_minhash", "_edited")


def report_path(output: Path) -> Path:
    return _beside(output, ".report.json")


def removed_path(output: Path) -> Path:
    return _beside(output, ".removed.jsonl")


def _beside(output: Path, suffix: str) -> Path:
    name = output.name[: -len(".jsonl")] if output.name.endswith(".jsonl") else output.name
    return output.with_name(name + suffix)


def check_paths(cfg, output: Path) -> None:
    storage.check_writable(output.parent, "--output", given=output)
    src = Path(os.path.expanduser(cfg.dataset_name)).resolve()
    for out in (output, report_path(output), removed_path(output)):
        if out.resolve() == src or (src.is_dir() and src in out.resolve().parents):
            raise ConfigError(f"--output {output} would overwrite the input {cfg.dataset_name}; write it elsewhere")
    if not Path(os.path.expanduser(cfg.dataset_name)).exists():
        raise ConfigError(f"input file '{cfg.dataset_name}' does not exist")


class CleanBatch:
    """The batched map: the edited fields, and per document `_drop`, `_hash`/`_minhash` and `_edited` (the
    edit steps that changed it). Picklable, for `num_proc`."""

    def __init__(self, opts, fmt: str):
        self.opts, self.fmt, self.cleaner = opts.tokenize, fmt, Cleaner(opts.tokenize)

    def __call__(self, batch):
        out, n = {}, len(next(iter(batch.values())))
        edited = [[] for _ in range(n)]
        if self.fmt == "text":
            col = self.opts.text_column
            texts, steps = self.cleaner.edit(["" if t is None else str(t) for t in batch[col]])
            for step, _, _, changed in steps:
                for i in changed:
                    edited[i].append(step)
            out[col], contents = texts, texts
        else:
            rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
            if self.opts.fix_text:
                fixed = [fix_strings(r) for r in rows]
                edited = [["fix_text"] if a != b else [] for a, b in zip(rows, fixed)]
                rows = fixed
                out.update({c: [r[c] for r in rows] for c in batch})
            contents, texts = rows, [formats.content_text(self.fmt, r) for r in rows]
        judged = self.cleaner.judge(texts, contents)
        out["_drop"] = judged.get("drop", [""] * n)
        if "hash" in judged:
            out["_hash"] = judged["hash"]
        if "minhash" in judged:
            out["_minhash"] = list(judged["minhash"])
        out["_edited"] = edited
        return out


def clean(cfg, output: Path, log=print) -> dict:
    """Clean `cfg.dataset_name` into `output` (JSON lines) and `report_path(output)`; returns the report."""
    check_paths(cfg, output)
    spec = sources.dataset_specs(cfg)[0]
    source = sources.describe(spec, cfg)
    ds = sources.load(spec, source, spec.split, trust_remote_code=cfg.trust_remote_code)
    opts = DataOptions.from_config(cfg, spec)
    fmt, how = formats.detect_format(opts.tokenize.format, ds.column_names, opts.tokenize.text_column, spec.name)
    log(f"clean: {spec.name}: {how}")
    opts = opts.resolved(fmt)
    check_format(opts.tokenize, spec.name)
    start = time.perf_counter()
    judged = ds.map(
        CleanBatch(opts, fmt), batched=True, batch_size=500, num_proc=map_processes(cfg, len(ds)), desc="cleaning"
    )
    report = decide(judged, opts, fmt, spec.name)
    reasons, duplicate_of = report.pop("_reasons"), report.pop("_duplicate_of")
    rows = judged.remove_columns([c for c in INTERNAL if c in judged.column_names])
    removed = np.flatnonzero(reasons != "")
    audit = rows.select(removed).add_column("removed_because", list(reasons[removed]))
    audit = audit.add_column("duplicate_of", duplicate_of[removed].tolist())
    report.update(input=str(cfg.dataset_name), output=str(output), removed_rows=str(removed_path(output)))
    # Each file is written whole under a temporary name before it replaces its namesake: a full disk leaves
    # the previous output (or none) and no temporaries, never a cut-off clean.jsonl.
    with storage.guarded("writing the cleaned data", output.parent, flag="--output"), ExitStack() as stack:
        kept_tmp, removed_tmp = (stack.enter_context(atomic.staged(p)) for p in (output, removed_path(output)))
        rows.select(np.flatnonzero(reasons == "")).to_json(kept_tmp, lines=True, force_ascii=False)
        audit.to_json(removed_tmp, lines=True, force_ascii=False)
        seconds = time.perf_counter() - start
        docs_per_second = round(report["documents"] / max(seconds, 1e-9), 1)
        report.update(seconds=round(seconds, 2), documents_per_second=docs_per_second)
        atomic.write_text(report_path(output), json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    for line in summary_lines(report):
        log(line)
    return report


def decide(judged, opts, fmt: str, name: str) -> dict:
    """Which documents to keep, in train.py's order of steps, with counts and examples per reason."""
    n, col = len(judged), opts.tokenize.text_column
    drop = np.asarray(judged["_drop"], dtype=object)
    edited = judged["_edited"]
    report = {
        "format": fmt,
        "options": {k: v for k, v in asdict(opts.tokenize).items() if k not in ("format", "train_on_prompt")},
        "documents": n,
        "edited": {s: sum(s in e for e in edited) for s, _ in Cleaner(opts.tokenize).edits},
        "removed": {},
    }
    report["options"]["dedupe_threshold"] = opts.dedupe_threshold
    keep = drop == ""
    reasons, duplicate_of = drop.copy(), np.full(n, -1, dtype=np.int64)
    for why in sorted(set(drop) - {""}):
        idx = np.flatnonzero(drop == why)
        report["removed"][why] = {
            "documents": len(idx),
            "examples": [shown(judged, fmt, col, i) for i in idx[:EXAMPLES_PER_REASON]],
        }
    mode = opts.tokenize.dedupe
    if mode != "none":
        if mode == "exact":
            keys = np.asarray(judged["_hash"], dtype=np.int64)
        else:
            keys = np.asarray(judged["_minhash"], dtype=np.uint32).reshape(n, -1)
        what, matched = dedupe.among(mode, keys, keep, opts.dedupe_threshold)
        removed = np.flatnonzero(matched >= 0)
        of = matched[removed]
        keep[removed] = False
        reasons[removed], duplicate_of[removed] = what, of
        examples = []
        for i, j in list(zip(removed, of))[:EXAMPLES_PER_REASON]:
            ex = shown(judged, fmt, col, i) | {"duplicate_of": shown(judged, fmt, col, j)}
            if mode == "near":
                ex["similarity"] = round(float((keys[i] == keys[j]).mean()), 3)
            examples.append(ex)
        report["removed"][what] = {"documents": len(removed), "examples": examples}
    if not keep.any():
        raise ConfigError(f"nothing of '{name}' is left after cleaning; relax the options")
    report["kept"] = int(keep.sum())
    report["_reasons"], report["_duplicate_of"] = reasons, duplicate_of
    return report


def shown(ds, fmt: str, column: str, i) -> dict:
    """One document of a report: its 0-based index in the input and the start of its text."""
    row = ds[int(i)]
    text = str(row[column] or "") if fmt == "text" else formats.content_text(fmt, row)
    return {"index": int(i), "text": text[:EXAMPLE_CHARS]}


def summary_lines(report: dict) -> list[str]:
    lines = [
        f"clean: {report['documents']} documents -> {report['kept']} kept "
        f"({report['documents_per_second']:.0f} documents/s, {report['seconds']:.1f} s)"
    ]
    for step, count in report["edited"].items():
        lines.append(f"  edited by {step}: {count}")
    for why, r in report["removed"].items():
        lines.append(f"  removed, {why}: {r['documents']}")
    out = Path(report["output"])
    lines.append(f"  wrote {out}, {report_path(out)} and the removed rows with why: {report['removed_rows']}")
    return lines
