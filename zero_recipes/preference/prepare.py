"""Prepare a preference set once, cache it, and hand train.py its pairs.

load -> detect the format (preference/data.py) -> tokenise as TRL's DPOTrainer does -> drop what cannot train
(counted) -> split off eval -> save flat .npy arrays beside the SFT caches (data.cache_root()/prepared). The cache
key covers the data, the tokenizer and every option that changes the pairs, so a second launch memory-maps the
arrays; the reference log-probs are stored in the same entry (reference.py), keyed by the reference model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from zero_recipes.checkpointing.atomic import staged
from zero_recipes.data import formats, sources
from zero_recipes.data.cache import cache_root, digest, tokenizer_fingerprint
from zero_recipes.data.preparation import column, map_processes
from zero_recipes.errors import ConfigError
from zero_recipes.preference import data as pref_data
from zero_recipes.preference.pairs import PairSamples

PAIRS_FORMAT_VERSION = "1"  # bump when the cached layout or the tokenisation changes


@dataclass
class PreparedPairs:
    """What train.py reads of the data (as data.Prepared): the training pairs, the eval pairs, the pad id; and
    where the entry lives, for the reference log-probs."""

    train: PairSamples
    eval: Optional[PairSamples]
    pad_id: int
    entry: Path
    key: str
    formats: tuple = ("preference",)
    sft = True  # answer tokens only are trained
    exact_match = False

    @property
    def held_out_rows(self):
        """The eval pairs as SFT rows (prompt, then the chosen answer trained): the live samples' prompts, with the
        chosen answer as their reference."""
        return None if self.eval is None else ChosenRows(self.eval)

    @property
    def probe_rows(self):
        return None  # the export check takes its probe from the order (train.py check_export)


class ChosenRows:
    """Pairs read as SFT rows: prompt + chosen, the chosen tokens masked in."""

    def __init__(self, pairs: PairSamples):
        self.pairs = pairs

    def __len__(self) -> int:
        return len(self.pairs)

    def row(self, i: int):
        pair = self.pairs.row(i)
        tokens = pair.tokens[: pair.prompt + pair.chosen]
        return [(tokens, (np.arange(len(tokens)) >= pair.prompt).astype(np.uint8))]


def options(cfg) -> dict:
    """What shapes the pairs (hashed into the cache key): nothing else may change them."""
    return {
        "max_length": cfg.max_length,
        "truncation_mode": cfg.truncation_mode,
        "block_size": cfg.block_size,
        "validation_split_percentage": cfg.validation_split_percentage,
        "seed": cfg.seed,
    }


def check(cfg) -> None:
    """What a preference run refuses in one line before anything loads."""
    if cfg.dataset_mixture is not None:
        raise ConfigError(
            "--objective dpo reads one preference set; a dataset_mixture is not supported: merge the files"
        )
    if cfg.streaming:
        raise ConfigError(
            "--objective dpo with --streaming: the reference log-probs are computed once over the whole set before "
            "the first step, which a stream never holds; prepare the set (drop --streaming)"
        )
    cleaning = [f"--{k}" for k in ("fix_text", "strip_html", "normalize_whitespace", "drop_garbled") if getattr(cfg, k)]
    cleaning += [f"--{k} {getattr(cfg, k)}" for k in ("quality_filter", "dedupe") if getattr(cfg, k) != "none"]
    if cleaning or cfg.min_document_tokens:
        raise ConfigError(
            f"{' '.join(cleaning) or '--min_document_tokens'} with --objective dpo: cleaning applies to documents and "
            "SFT examples, not pairs; clean the pairs' file first (tools/clean_data.py) and train on its output"
        )


def prepare(cfg, tok, log) -> PreparedPairs:
    """Call on one rank at a time (train.py lets rank 0 build the cache while the others wait)."""
    (spec,) = sources.dataset_specs(cfg)
    source = sources.describe(spec, cfg)
    key = digest(PAIRS_FORMAT_VERSION, source, spec.name, spec.split, spec.eval_split, tokenizer_fingerprint(tok),
                 options(cfg))  # fmt: skip
    out = cache_root(cfg) / "prepared" / f"pairs-{key}"
    if not (out / "meta.json").exists():
        build(cfg, spec, source, tok, out, log)
    else:
        log(f"data: {spec.name}: cached pairs found at {out}; tokenisation skipped")
    if json.loads((out / "meta.json").read_text())["chat"]:  # the template the pairs were rendered with, exported
        formats.ensure_chat_template(tok, log)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    evald = load_pairs(out, "eval")
    return PreparedPairs(load_pairs(out, "train"), evald if len(evald) else None, pad_id, out, key)


def load_pairs(out: Path, name: str) -> PairSamples:
    arr = lambda k: np.load(out / f"{name}_{k}.npy", mmap_mode="r")  # noqa: E731
    return PairSamples(arr("tokens"), np.asarray(arr("starts")), np.asarray(arr("lengths")))


def tokenized(cfg, spec, source, split: str, tok, log):
    """One split tokenised: (prompt, chosen, rejected id lists, drop reasons)."""
    ds = sources.load(spec, source, split, trust_remote_code=cfg.trust_remote_code)
    name = spec.name if split == spec.split else f"{spec.name}:{split}"
    if len(ds) == 0:
        raise ConfigError(f"dataset '{name}' (split {split}) is empty")
    fmt, how = pref_data.detect(ds.column_names, name)
    log(f"data: {name}: {how}")
    chat = pref_data.is_chat(pref_data.as_trl(fmt, ds[0], 1)["chosen"])
    if chat:  # conversations: the model's template, or the embedded one (as SFT's messages)
        formats.ensure_chat_template(tok, log)
    out = ds.map(
        pref_data.TokenizePairs(tok, fmt, cfg.max_length, cfg.truncation_mode, name),
        batched=True,
        batch_size=1000,
        with_indices=True,
        num_proc=map_processes(cfg, len(ds)),
        remove_columns=ds.column_names,
        desc="tokenising pairs",
    )
    cols = {k: column(out, k).to_pylist() for k in ("prompt_ids", "chosen_ids", "rejected_ids", "drop")}
    cols["chat"] = chat
    return cols


def select(cols: dict, block: int, report: dict) -> np.ndarray:
    """The pairs kept: not dropped while tokenising (reasons counted), and fitting one row (prompt + both
    answers <= block_size, counted)."""
    drop = np.asarray(cols["drop"], dtype=object)
    keep = drop == ""
    for why in sorted(set(drop) - {""}):
        report[why] = int((drop == why).sum())
    total = np.array(
        [len(p) + len(c) + len(r) for p, c, r in zip(cols["prompt_ids"], cols["chosen_ids"], cols["rejected_ids"])]
    )
    too_long = keep & (total > block)
    if too_long.any():
        report[f"prompt + both answers longer than block_size {block}"] = int(too_long.sum())
    keep &= ~too_long
    return np.flatnonzero(keep)


def build(cfg, spec, source, tok, out: Path, log) -> None:
    report: dict = {}
    cols = tokenized(cfg, spec, source, spec.split, tok, log)
    kept = select(cols, cfg.block_size, report)
    if not len(kept):
        raise ConfigError(
            f"dataset '{spec.name}' keeps no pair: {summary(len(cols['drop']), report)}; "
            + ("raise --block_size or --max_length" if any("longer" in why for why in report) else "fix those pairs")
        )
    eval_cols, eval_kept = None, np.zeros(0, dtype=np.int64)
    if spec.eval_split:
        eval_cols = tokenized(cfg, spec, source, spec.eval_split, tok, log)
        eval_kept = select(eval_cols, cfg.block_size, {})
    elif cfg.validation_split_percentage > 0 and len(kept) >= 2:
        n_eval = max(1, int(round(cfg.validation_split_percentage / 100 * len(kept))))
        perm = np.random.default_rng(cfg.seed).permutation(len(kept))
        eval_cols, eval_kept, kept = cols, np.sort(kept[perm[:n_eval]]), np.sort(kept[perm[n_eval:]])
    with staged(out) as tmp:  # meta.json, which marks the entry complete, is written last
        tmp.mkdir(parents=True, exist_ok=True)
        write_pairs(tmp, "train", cols, kept)
        write_pairs(tmp, "eval", eval_cols, eval_kept)
        meta = {"train_pairs": len(kept), "eval_pairs": len(eval_kept), "report": report, "source": source,
                "chat": cols["chat"]}  # fmt: skip
        (tmp / "meta.json").write_text(json.dumps(meta, default=str))
    tokens = load_pairs(out, "train").num_tokens
    log(
        f"data: {spec.name}: {summary(len(cols['drop']), report)}; {len(kept)} train pairs ({tokens} tokens, each "
        f"prompt once), {len(eval_kept)} eval pairs; cached at {out}"
    )


def write_pairs(tmp: Path, name: str, cols: Optional[dict], kept: np.ndarray) -> None:
    parts, lengths = [], []
    for i in kept:
        p, c, r = (cols[k][i] for k in ("prompt_ids", "chosen_ids", "rejected_ids"))
        parts += [p, c, r]
        lengths.append((len(p), len(c), len(r)))
    tokens = np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, dtype=np.int32)
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1, 3)
    starts = (
        np.concatenate([[0], np.cumsum(lengths.sum(axis=1))[:-1]]).astype(np.int64)
        if len(lengths)
        else np.zeros(0, dtype=np.int64)
    )
    np.save(tmp / f"{name}_tokens.npy", tokens)
    np.save(tmp / f"{name}_starts.npy", starts)
    np.save(tmp / f"{name}_lengths.npy", lengths)


def summary(n: int, report: dict) -> str:
    return ", ".join([f"{n} pairs"] + [f"{why}: -{k}" for why, k in report.items()])
