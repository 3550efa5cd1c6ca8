"""One way to write a small file so that a reader, or a kill, never sees half of it."""

from __future__ import annotations

import os
from pathlib import Path


def write_text(path: Path, text: str) -> None:
    """Written whole under a hidden per-process name, then renamed over `path`: ranks or processes writing at once
    leave one complete file, the last one's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
