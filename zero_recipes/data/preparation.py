"""Prepare the data of a run once, cache it, and hand train.py row sources.

For each dataset: load -> detect the format -> clean and tokenise (batched `datasets.map`, fast
tokenizer, `num_proc`) -> drop short, duplicate, answerless and over-long examples -> split off eval ->
lay out rows (stream windows for text, packed or single examples for SFT) -> save flat .npy arrays.
The cache key covers the data's identity, the tokenizer and every option that changes the rows (all of
them in `DataOptions`), so a second launch memory-maps the arrays and tokenises nothing.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np

from zero_recipes.checkpointing.atomic import staged
from zero_recipes.data import cleaning, dedupe, formats, packing, sources
from zero_recipes.data.cache import cache_root, digest, tokenizer_fingerprint
from zero_recipes.data.options import DataOptions
from zero_recipes.data.order import Mixture
from zero_recipes.errors import ConfigError

DATA_FORMAT_VERSION = "5"  # bump when the cached layout or the rendering changes


@dataclass
class Prepared:
    train: object  # packing.Samples or order.Mixture
    eval: Optional[object]
    formats: list[str]
    pad_id: int

    @property
    def sft(self) -> bool:
        """Any SFT data: labels are masked, and eval reports exact-match accuracy."""
        return any(f != "text" for f in self.formats)

    @property
    def exact_match(self) -> bool:
        """Eval rows are single SFT examples, so exact-match accuracy is defined."""
        return bool(self.formats) and all(f != "text" for f in self.formats)

    @property
    def held_out_rows(self):
        """The eval rows as segments of (tokens, label mask): what the live samples take their prompts from."""
        return self.eval

    @property
    def probe_rows(self):
        """Rows to take an export-check probe from: eval, else train (None for a stream without eval)."""
        for rows in (self.eval, self.train):
            if rows is not None and hasattr(rows, "row") and len(rows):
                return rows
        return None


def num_workers(cfg) -> int:
    if cfg.preprocessing_num_workers:
        return cfg.preprocessing_num_workers
    return max(1, min(8, len(os.sched_getaffinity(0))))


def map_processes(cfg, examples: int) -> int:
    """Processes for a `datasets.map` over `examples`: one per 2000 examples at most, since a process costs
    more than it saves on fewer."""
    return min(num_workers(cfg), max(1, examples // 2000))


def prepare(cfg, tok, log) -> Prepared:
    """Call on one rank at a time: train.py lets rank 0 build the caches while the others wait."""
    specs = sources.dataset_specs(cfg)
    parts = [prepare_one(cfg, spec, tok, log) for spec in specs]
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    fmts = [p[2] for p in parts]
    if len(parts) == 1:
        train, evald = parts[0][0], parts[0][1]
    else:
        train = Mixture([p[0] for p in parts], [s.weight for s in specs], cfg.seed)
        evals = [p[1] for p in parts if p[1] is not None and len(p[1])]
        n = sum(len(e) for e in evals)
        evald = Mixture(evals, [len(e) / n for e in evals], cfg.seed) if evals else None
        shares = ", ".join(f"{s.name} {int((train.refs[:, 0] == k).sum())}" for k, s in enumerate(specs))
        log(f"data: mixture of {len(specs)} datasets, {len(train)} rows per epoch ({shares})")
    return Prepared(train, evald, fmts, pad_id)


def cache_key(spec, source, opts: DataOptions, tok) -> str:
    """What the prepared rows of one dataset depend on: the data (where it comes from, its config and
    splits), the tokenizer and the options. Not the mixture weight: it decides how often rows are drawn,
    not what they are."""
    return digest(
        DATA_FORMAT_VERSION, source, asdict(spec) | {"weight": None}, tokenizer_fingerprint(tok), asdict(opts)
    )


def prepare_one(cfg, spec, tok, log):
    source = sources.describe(spec, cfg)
    opts = DataOptions.from_config(cfg, spec)
    out = cache_root(cfg) / "prepared" / cache_key(spec, source, opts, tok)
    if not (out / "meta.json").exists():
        build(cfg, spec, source, opts, tok, out, log)
    else:
        log(f"data: {spec.name}: cached arrays found at {out}; tokenisation skipped")
    meta = json.loads((out / "meta.json").read_text())
    if meta["format"] == "messages":
        formats.ensure_chat_template(tok, log)
    return load_rows(out, "train"), (load_rows(out, "eval") if meta["eval_rows"] else None), meta["format"]


def load_rows(out, name) -> packing.Samples:
    arr = lambda k: np.load(out / f"{name}_{k}.npy", mmap_mode="r")  # noqa: E731
    mask = arr("mask") if (out / f"{name}_mask.npy").exists() else None
    return packing.Samples(arr("tokens"), mask, np.asarray(arr("seg")), np.asarray(arr("ptr")))


def load_split(cfg, spec, source, split):
    return sources.load(spec, source, split, trust_remote_code=cfg.trust_remote_code)


def tokenize(cfg, ds, opts: DataOptions, tok, desc) -> Tokenized:
    """`formats.Tokenize` over `ds` with `datasets.map`, whose own cache is keyed by the tokenisation
    options only, so a change of layout (block_size, packing, ...) reuses the tokenised examples."""
    procs = map_processes(cfg, len(ds))
    fp = digest(ds._fingerprint, tokenizer_fingerprint(tok), asdict(opts.tokenize), DATA_FORMAT_VERSION)
    out = ds.map(
        formats.Tokenize(tok, opts.tokenize),
        batched=True,
        batch_size=1000,
        with_indices=True,
        num_proc=procs,
        remove_columns=ds.column_names,
        new_fingerprint=f"tok-{fp}",
        desc=desc,
    )
    return Tokenized(out, opts.tokenize.format != "text")


def column(ds, name) -> "pa.ChunkedArray":  # noqa: F821
    # with_format("arrow") honours any indices mapping a select/split leaves; .data would not
    return ds.with_format("arrow")[:][name]


def flat(ds, name, dtype) -> np.ndarray:
    """Concatenate one list column of the Tokenize output rows into one numpy array."""
    if len(ds) == 0:
        return np.zeros(0, dtype=dtype)
    return column(ds, name).combine_chunks().flatten().to_numpy(zero_copy_only=False).astype(dtype, copy=False)


class Tokenized:
    """The flat arrays of one tokenised split: ids, per-example lengths and starts, mask (SFT)."""

    def __init__(self, ds, sft: bool):
        self.ids = flat(ds, "ids", np.int32)
        self.lengths = flat(ds, "lengths", np.int64)
        self.starts = (
            np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)
            if len(self.lengths)
            else np.zeros(0, dtype=np.int64)
        )
        self.mask = flat(ds, "mask", np.uint8) if sft else None
        self.extra = {
            name: flat(ds, name, np.int64)
            for name in (*(f"removed_{step}" for step in cleaning.EDIT_STEPS), "hash")
            if name in ds.column_names
        }
        self.drop = np.asarray(flat_strings(ds, "drop"), dtype=object) if "drop" in ds.column_names else None
        self.minhash = (
            flat(ds, "minhash", np.uint32).reshape(len(self.lengths), -1) if "minhash" in ds.column_names else None
        )


def flat_strings(ds, name) -> list[str]:
    return column(ds, name).combine_chunks().flatten().to_pylist() if len(ds) else []


def build(cfg, spec, source, opts: DataOptions, tok, out, log) -> None:
    """Prepare one dataset into `out`. Everything that shapes the rows comes from `opts` (which the cache
    key hashes); of `cfg` only the worker count and trust_remote_code are read."""
    ds, fmt, opts, tk, report, kept = tokenize_and_select(cfg, spec, source, opts, tok, log)
    eval_tk, eval_kept, kept = hold_out(cfg, spec, source, opts, tok, tk, kept)

    block = opts.block_size
    with staged(out) as tmp:  # meta.json, which marks an entry complete, is written last
        tmp.mkdir(parents=True, exist_ok=True)
        n_train = write_rows(tmp, "train", tk, kept, fmt, block, opts.packing)
        n_eval = write_rows(tmp, "eval", eval_tk, eval_kept, fmt, block, False) if eval_tk is not None else 0
        if n_train == 0:
            raise ConfigError(
                f"dataset '{spec.name}' yields no full block of {block} tokens; lower --block_size or use more data"
            )
        report.update(
            format=fmt,
            train_rows=n_train,
            eval_rows=n_eval,
            train_examples=int(len(kept)),
            eval_examples=int(len(eval_kept)),
        )
        meta = {"format": fmt, "train_rows": n_train, "eval_rows": n_eval, "report": report, "source": source}
        (tmp / "meta.json").write_text(json.dumps(meta, default=str))
    rows = load_rows(out, "train")
    util = rows.num_tokens / (len(rows) * block)
    log(
        f"data: {spec.name}: {summary(report)}; {len(kept)} train examples -> {n_train} rows of <= {block} "
        f"tokens ({util:.1%} real tokens per block), {n_eval} eval rows; cached at {out}"
    )


def select(tk: Tokenized, opts: DataOptions, name: str, report: dict) -> np.ndarray:
    """Which examples to keep (a bool mask): what cleaning removed goes into `report`, then answerless,
    short, duplicate and (SFT) over-long examples are dropped and counted there."""
    fmt, block, lengths = opts.tokenize.format, opts.block_size, tk.lengths
    keep = np.ones(len(lengths), dtype=bool)
    for step in cleaning.EDIT_STEPS:
        if f"removed_{step}" in tk.extra:
            removed = tk.extra[f"removed_{step}"]
            report[f"cleaning {step}"] = {
                "documents": 0,
                "tokens": int(removed.sum()),
                "changed": int((removed != 0).sum()),
            }

    def drop(what, bad):
        bad = bad & keep
        report[what] = {"documents": int(bad.sum()), "tokens": int(lengths[bad].sum())}
        keep[bad] = False

    if tk.drop is not None:  # garbled and quality verdicts, made per document while tokenising
        for why in sorted(set(tk.drop) - {""}):
            drop(why, tk.drop == why)
    if fmt != "text":  # every example has >= 1 token (its EOS), so reduceat sees no empty segment
        drop("no answer tokens", np.add.reduceat(tk.mask.astype(np.int64), tk.starts) == 0)
    if opts.min_document_tokens:
        drop(f"shorter than {opts.min_document_tokens} tokens", lengths - 1 < opts.min_document_tokens)  # EOS aside
    if opts.tokenize.dedupe != "none":
        keys = tk.extra["hash"] if opts.tokenize.dedupe == "exact" else tk.minhash
        what, matched = dedupe.among(opts.tokenize.dedupe, keys, keep, opts.dedupe_threshold)
        drop(what, matched >= 0)
    if fmt != "text":
        too_long = (lengths > block) & keep
        if keep.any() and too_long.sum() == keep.sum():
            raise ConfigError(
                f"dataset '{name}': all {int(keep.sum())} examples are longer than block_size "
                f"{block} tokens (longest {int(lengths.max())}); raise --block_size"
            )
        drop(f"longer than block_size {block}", too_long)
    if not keep.any():
        raise ConfigError(f"dataset '{name}' is empty after filtering: {summary(report)}; relax the cleaning options")
    return keep


def tokenize_and_select(cfg, spec, source, opts: DataOptions, tok, log):
    """Load one dataset's split, detect its format, tokenise it and choose what is kept. Returns (the source
    rows, the format, the options resolved for it, the Tokenized rows, the removal report, the kept indices)."""
    ds = load_split(cfg, spec, source, spec.split)
    if len(ds) == 0:
        raise ConfigError(f"dataset '{spec.name}' (split {spec.split}) is empty")
    fmt, how = formats.detect_format(opts.tokenize.format, ds.column_names, opts.tokenize.text_column, spec.name)
    log(f"data: {spec.name}: {how}")
    if fmt == "messages":
        formats.ensure_chat_template(tok, log)
    opts = opts.resolved(fmt)
    cleaning.check_format(opts.tokenize, spec.name)
    tk = tokenize(cfg, ds, opts, tok, "tokenising")
    report = {"documents": len(tk.lengths)}
    kept = np.flatnonzero(select(tk, opts, spec.name, report))
    return ds, fmt, opts, tk, report, kept


def held_out_examples(cfg, tok, log=lambda *a, **k: None) -> list:
    """The source rows a run with `cfg` holds out for eval, as `datasets.Dataset`s (one per dataset in the
    mixture, in order): its eval split, else the seeded share `hold_out` picks. The shipped lm-eval tasks are
    built from these (zero_recipes/evaluation/shipped_tasks.py), so they hold the same examples as the run's
    own eval loss and exact match."""
    out = []
    for spec in sources.dataset_specs(cfg):
        source = sources.describe(spec, cfg)
        opts = DataOptions.from_config(cfg, spec)
        ds, _, opts, tk, _, kept = tokenize_and_select(cfg, spec, source, opts, tok, log)
        eval_tk, eval_kept, _ = hold_out(cfg, spec, source, opts, tok, tk, kept)
        if eval_tk is tk:
            out.append(ds.select(eval_kept))
        elif eval_tk is not None:
            out.append(load_split(cfg, spec, source, spec.eval_split).select(eval_kept))
    return out


def hold_out(cfg, spec, source, opts: DataOptions, tok, tk: Tokenized, kept: np.ndarray):
    """The eval examples: (their Tokenized or None, their indices in it, the train indices left). From the
    eval split when there is one, else a seeded `validation_split_percentage` of the kept examples."""
    fmt, none = opts.tokenize.format, np.zeros(0, dtype=np.int64)
    if spec.eval_split:
        eval_ds = load_split(cfg, spec, source, spec.eval_split)
        if not len(eval_ds):
            return None, none, kept
        formats.detect_format(fmt, eval_ds.column_names, opts.tokenize.text_column, f"{spec.name}:{spec.eval_split}")
        eval_tk = tokenize(cfg, eval_ds, opts, tok, "tokenising eval")
        eval_kept = (
            np.flatnonzero(eval_tk.lengths <= opts.block_size) if fmt != "text" else np.arange(len(eval_tk.lengths))
        )
        return eval_tk, eval_kept, kept
    if opts.validation_split_percentage > 0 and len(kept) >= 2:
        n_eval = max(1, int(round(opts.validation_split_percentage / 100 * len(kept))))
        perm = np.random.default_rng(opts.seed).permutation(len(kept))
        return tk, np.sort(kept[perm[:n_eval]]), np.sort(kept[perm[n_eval:]])
    return None, none, kept


def summary(report: dict) -> str:
    parts = [f"{report['documents']} documents"]
    for name, r in report.items():
        if isinstance(r, dict) and (r["documents"] or r["tokens"]):
            what = (
                f"{r['tokens']} tokens" if not r["documents"] else f"{r['documents']} documents / {r['tokens']} tokens"
            )
            parts.append(f"{name}: -{what}")
    return ", ".join(parts)


def write_rows(tmp, name, tk: Tokenized, indices, fmt, block, pack) -> int:
    """Keep the chosen examples (in order) as one flat token array (and mask) and lay out rows over it."""
    if len(indices) == len(tk.lengths):
        ids, mask, lengths = tk.ids, tk.mask, tk.lengths
    else:
        chosen = np.zeros(len(tk.lengths), dtype=bool)
        chosen[indices] = True
        tokens = np.repeat(chosen, tk.lengths)
        ids, lengths = tk.ids[tokens], tk.lengths[indices]
        mask = tk.mask[tokens] if tk.mask is not None else None
    np.save(tmp / f"{name}_tokens.npy", ids)
    if fmt == "text":
        seg, ptr = packing.windows(len(ids), block)
    else:
        np.save(tmp / f"{name}_mask.npy", mask)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if len(lengths) else lengths
        seg, ptr = packing.pack(starts, lengths, block) if pack else packing.one_per_row(starts, lengths)
    np.save(tmp / f"{name}_seg.npy", seg)
    np.save(tmp / f"{name}_ptr.npy", ptr)
    return len(ptr) - 1
