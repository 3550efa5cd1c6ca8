"""Text data: the embedded corpus and tokenizer, loading any dataset, tokenising into fixed blocks, and a
seeded, resumable batch order.

Tokenisation runs through `datasets.map` (batched, fast tokenizer, `num_proc`), so the datasets cache
holds the token ids keyed by fingerprint. The blocks themselves are cut with one numpy reshape over the
whole stream (run_clm's `group_texts` drops a remainder per map batch) and cached as one .npy file.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path
from typing import Optional

import numpy as np

from .config import BUILTIN_DATASET, ConfigError, TrainConfig

DATA_FORMAT_VERSION = "2"  # bump when the block layout changes, to invalidate caches


def cache_root(cfg: TrainConfig) -> Path:
    root = cfg.cache_dir or os.environ.get("ZERO_RECIPES_CACHE") or "~/.cache/zero-recipes"
    return Path(os.path.expanduser(root))


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(json.dumps(p, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


# ---- the embedded corpus ---------------------------------------------------------------------------

def stdlib_docstrings() -> list[str]:
    """Every module, class and function docstring of the running Python's standard library: a few MB of
    English about code that exists, unchanged, on any machine with this Python. Tests, the IDLE GUI and
    vendored packages are left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "ensurepip", "turtledemo"}
    docs = []
    for path in sorted(root.rglob("*.py")):
        if skip.intersection(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 64:
                    docs.append(doc)
    return docs


def builtin_corpus_file(cfg: TrainConfig) -> Path:
    """Write the embedded corpus once as jsonl, so it goes through the same `load_dataset` path (and the
    same datasets cache) as a user's own files."""
    out = cache_root(cfg) / f"python{sys.version_info[0]}.{sys.version_info[1]}-docstrings.jsonl"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".tmp{os.getpid()}")
        with tmp.open("w") as f:
            for doc in stdlib_docstrings():
                f.write(json.dumps({"text": doc}) + "\n")
        tmp.replace(out)
    return out


def builtin_tokenizer_dir(cfg: TrainConfig, vocab_size: int = 4096) -> Path:
    """A byte-level BPE trained offline on the embedded corpus and saved in HF format."""
    corpus = builtin_corpus_file(cfg)
    out = cache_root(cfg) / f"tokenizer-bpe{vocab_size}-{_digest(corpus.name, corpus.stat().st_size)}"
    if (out / "tokenizer.json").exists():
        return out
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)

    def lines():
        with corpus.open() as f:
            for line in f:
                yield json.loads(line)["text"]

    tok.train_from_iterator(lines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>", model_max_length=2048)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    fast.save_pretrained(tmp)
    tmp.replace(out)
    return out


def load_tokenizer(cfg: TrainConfig):
    from transformers import AutoTokenizer

    name = cfg.tokenizer_name_or_path or cfg.model_name_or_path
    if name is None:
        name = str(builtin_tokenizer_dir(cfg))
    try:
        tok = AutoTokenizer.from_pretrained(name, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot load tokenizer '{name}': {str(e).splitlines()[0]}") from None
    if tok.eos_token_id is None:
        raise ConfigError(f"tokenizer '{name}' has no EOS token; documents cannot be separated")
    return tok


# ---- loading and tokenising ------------------------------------------------------------------------

LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text",
                  ".text": "text"}


def dataset_source(cfg: TrainConfig) -> dict:
    """Describe where the documents come from, in a form that changes when the data changes."""
    if cfg.dataset_name == BUILTIN_DATASET:
        p = builtin_corpus_file(cfg)
        return {"kind": "local", "builder": "json", "path": str(p), "stat": [p.stat().st_size, p.stat().st_mtime]}
    p = Path(os.path.expanduser(cfg.dataset_name))
    if p.is_dir():
        stat = [(str(f.relative_to(p)), f.stat().st_size, f.stat().st_mtime) for f in sorted(p.rglob("*")) if f.is_file()]
        return {"kind": "saved", "path": str(p.resolve()), "stat": stat}
    if p.is_file():
        builder = LOCAL_BUILDERS.get(p.suffix.lower())
        if builder is None:
            raise ConfigError(f"dataset file '{p}' has an unsupported extension; use "
                              f"{', '.join(sorted(LOCAL_BUILDERS))} or a directory saved by datasets")
        return {"kind": "local", "builder": builder, "path": str(p.resolve()), "stat": [p.stat().st_size, p.stat().st_mtime]}
    if cfg.dataset_name.startswith((".", "/", "~")) or Path(cfg.dataset_name).suffix.lower() in LOCAL_BUILDERS:
        raise ConfigError(f"dataset '{cfg.dataset_name}' does not exist; give an existing file, a saved dataset "
                          "directory or a hub dataset id")
    return {"kind": "hub", "name": cfg.dataset_name, "config": cfg.dataset_config_name}


def load_documents(cfg: TrainConfig, source: dict):
    import datasets

    try:
        if source["kind"] == "saved":
            ds = datasets.load_from_disk(source["path"])
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[cfg.dataset_split]
        elif source["kind"] == "local":
            ds = datasets.load_dataset(source["builder"], data_files=source["path"], split="train")
        else:
            ds = datasets.load_dataset(source["name"], source["config"], split=cfg.dataset_split,
                                       trust_remote_code=cfg.trust_remote_code) if cfg.trust_remote_code else \
                datasets.load_dataset(source["name"], source["config"], split=cfg.dataset_split)
    except (FileNotFoundError, ValueError, ConnectionError, KeyError) as e:
        raise ConfigError(f"cannot load dataset '{cfg.dataset_name}': {str(e).splitlines()[0]}") from None
    except Exception as e:  # hub errors come in many classes; all mean the same to the user
        if type(e).__module__.startswith(("huggingface_hub", "datasets", "requests", "httpx")):
            raise ConfigError(f"cannot load dataset '{cfg.dataset_name}': {str(e).splitlines()[0]}") from None
        raise
    if cfg.text_column not in ds.column_names:
        raise ConfigError(f"dataset '{cfg.dataset_name}' has no column '{cfg.text_column}' (columns: "
                          f"{', '.join(ds.column_names)}); pass --text_column NAME")
    return ds


def num_workers(cfg: TrainConfig) -> int:
    if cfg.preprocessing_num_workers:
        return cfg.preprocessing_num_workers
    return max(1, min(8, len(os.sched_getaffinity(0))))


def tokenizer_fingerprint(tok) -> str:
    backend = tok.backend_tokenizer.to_str() if getattr(tok, "is_fast", False) else repr(tok.get_vocab())
    return _digest(backend, tok.eos_token_id)


class TokenizeDocuments:
    """A picklable map function (for num_proc): text -> ids + EOS, so documents stay separated."""

    def __init__(self, tok, column: str):
        self.tok, self.column = tok, column

    def __call__(self, batch):
        ids = self.tok(batch[self.column], add_special_tokens=False)["input_ids"]
        eos = self.tok.eos_token_id
        return {"input_ids": [x + [eos] for x in ids]}


def to_blocks(tokenized, block_size: int) -> np.ndarray:
    """Concatenate the whole token stream and cut it into (n, block_size) blocks; only the final tail
    shorter than a block is dropped."""
    if len(tokenized) == 0:
        return np.zeros((0, block_size), dtype=np.int32)
    # with_format("arrow") honours the indices mapping a split or shuffle leaves behind; .data would not
    col = tokenized.with_format("arrow")[:]["input_ids"]
    flat = col.combine_chunks().flatten().to_numpy(zero_copy_only=False)
    n = len(flat) // block_size
    dtype = np.int32 if (flat.max(initial=0) < 2**31) else np.int64
    return np.ascontiguousarray(flat[: n * block_size].astype(dtype).reshape(n, block_size))


def prepare_blocks(cfg: TrainConfig, tok, log) -> tuple[np.ndarray, np.ndarray]:
    """Return (train_blocks, eval_blocks), memory-mapped from the cache. Call on one rank at a time:
    train.py lets rank 0 build the cache while the others wait at a barrier."""
    source = dataset_source(cfg)
    key = _digest(DATA_FORMAT_VERSION, source, cfg.dataset_split, cfg.text_column, tokenizer_fingerprint(tok),
                  cfg.block_size, cfg.validation_split_percentage, cfg.seed)
    out = cache_root(cfg) / "blocks" / key
    if (out / "done").exists():
        log(f"data: cached blocks found at {out}; tokenisation skipped")
        return np.load(out / "train.npy", mmap_mode="r"), np.load(out / "eval.npy", mmap_mode="r")

    docs = load_documents(cfg, source)
    n_docs = len(docs)
    fp = _digest(docs._fingerprint, tokenizer_fingerprint(tok), cfg.text_column, DATA_FORMAT_VERSION)
    procs = min(num_workers(cfg), max(1, n_docs // 1000))
    tokenized = docs.map(TokenizeDocuments(tok, cfg.text_column), batched=True, batch_size=1000, num_proc=procs,
                         remove_columns=docs.column_names, new_fingerprint=f"tok-{fp}", desc="tokenising")
    test_size = cfg.validation_split_percentage / 100
    if test_size > 0 and n_docs >= 2:
        n_eval = max(1, int(round(test_size * n_docs)))
        split = tokenized.train_test_split(test_size=n_eval, seed=cfg.seed, train_new_fingerprint=f"tr-{fp}-{n_eval}-{cfg.seed}",
                                           test_new_fingerprint=f"te-{fp}-{n_eval}-{cfg.seed}")
        train_docs, eval_docs = split["train"], split["test"]
    else:
        train_docs, eval_docs = tokenized, tokenized.select([])
    train, evald = to_blocks(train_docs, cfg.block_size), to_blocks(eval_docs, cfg.block_size)
    if len(train) == 0:
        raise ConfigError(f"dataset '{cfg.dataset_name}' yields no full block of {cfg.block_size} tokens; "
                          "lower --block_size or use more data")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    np.save(tmp / "train.npy", train)
    np.save(tmp / "eval.npy", evald)
    (tmp / "done").write_text(json.dumps({"documents": n_docs, "train_blocks": len(train), "eval_blocks": len(evald),
                                          "source": source}, default=str))
    if out.exists():
        import shutil
        shutil.rmtree(out)
    tmp.replace(out)
    log(f"data: {n_docs} documents -> {len(train)} train / {len(evald)} eval blocks of {cfg.block_size} tokens, "
        f"cached at {out}")
    return np.load(out / "train.npy", mmap_mode="r"), np.load(out / "eval.npy", mmap_mode="r")


# ---- batch order ---------------------------------------------------------------------------------

class BatchOrder:
    """Seeded per-epoch shuffle, sharded by rank, that resumes by seeking to (epoch, index): a resume
    never replays the batches it skips (HF's `ignore_data_skip` exists because it does)."""

    def __init__(self, blocks: np.ndarray, micro_batch: int, rank: int, world: int, seed: int):
        self.blocks, self.micro, self.rank, self.world, self.seed = blocks, micro_batch, rank, world, seed
        self.per_rank = len(blocks) // world // micro_batch  # micro-batches per rank per epoch
        if self.per_rank == 0:
            raise ConfigError(f"{len(blocks)} training blocks cannot fill one micro-batch of "
                              f"{micro_batch} on each of {world} ranks; lower --per_device_train_batch_size "
                              "or --block_size, or use more data")
        self.epoch, self.index = 0, 0
        self._order = None

    def _epoch_order(self) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.epoch])
        perm = rng.permutation(len(self.blocks))[: self.per_rank * self.micro * self.world]
        return perm[self.rank:: self.world]

    def next_batch(self):
        import torch

        if self.index >= self.per_rank:
            self.epoch, self.index, self._order = self.epoch + 1, 0, None
        if self._order is None:
            self._order = self._epoch_order()
        idx = np.sort(self._order[self.index * self.micro: (self.index + 1) * self.micro])
        self.index += 1
        return torch.from_numpy(np.asarray(self.blocks[idx], dtype=np.int64))

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "world": self.world, "micro": self.micro}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index, self._order = state["epoch"], state["index"], None


def eval_batches(blocks: np.ndarray, micro_batch: int, rank: int, world: int, max_batches: int):
    """Every rank gets the same number of batches (ZeRO-3 forwards are collective); padding rows repeat
    real blocks with weight 0 so each block counts once."""
    import torch

    n = len(blocks)
    if n == 0:
        return
    per_rank = -(-n // (world * micro_batch))
    if max_batches:
        per_rank = min(per_rank, max_batches)
    for b in range(per_rank):
        idx = np.arange(micro_batch) + (b * world + rank) * micro_batch
        weight = torch.from_numpy((idx < n).astype(np.float32))
        yield torch.from_numpy(np.asarray(blocks[idx % n], dtype=np.int64)), weight
