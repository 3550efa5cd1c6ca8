"""Where prepared data lives on disk, and how a cache key is made."""

from __future__ import annotations

import hashlib
import json
import os
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
