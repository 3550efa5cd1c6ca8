"""Where prepared data lives on disk, and how a cache key is made."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path


def cache_root(cfg) -> Path:
    root = cfg.cache_dir or os.environ.get("ZERO_RECIPES_CACHE") or "~/.cache/zero-recipes"
    return Path(os.path.expanduser(root))


def digest(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(json.dumps(p, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def tokenizer_fingerprint(tok) -> str:
    backend = (
        tok.backend_tokenizer.to_str() if getattr(tok, "is_fast", False) else repr(sorted(tok.get_vocab().items()))
    )
    return digest(backend, tok.eos_token_id, tok.bos_token_id, getattr(tok, "chat_template", None))


def publish(tmp: Path, out: Path) -> None:
    """Move a finished temp file or dir into place, so a reader never sees a half-written cache entry."""
    if out.is_dir():
        shutil.rmtree(out)
    tmp.replace(out)


@contextmanager
def staged(out: Path):
    """A per-process temporary name beside `out` for the body to write; published as `out` when the body
    succeeds, removed when it fails (a full disk, a read-only cache_dir): a cache entry is whole or absent."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    try:
        yield tmp
        publish(tmp, out)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
