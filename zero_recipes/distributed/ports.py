"""The rendezvous port: choosing a free one, and naming the error when another job holds it."""

from __future__ import annotations

import os
import re


def free_port(span: str | None = None) -> int:
    """A TCP port nothing listens on: the kernel's choice, or one from `span` ("LO:HI"). A range below the
    ephemeral ports (32768+) cannot be taken by gloo's own connections between the choice and the bind;
    the test suite gives each parallel worker its own (tests/inject/sitecustomize.py)."""
    import random
    import socket

    candidates = [0]
    if span:
        lo, hi = (int(x) for x in span.split(":"))
        candidates = random.sample(range(lo, hi), min(200, hi - lo))
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no free TCP port in {span}")


def address_in_use(error: BaseException) -> str | None:
    """Rank 0 could not listen on the rendezvous port: another job on this machine holds it (two launches
    both take the deepspeed launcher's default 29500). That is bad input, not a lost peer."""
    text = str(error)
    if "EADDRINUSE" not in text and "address already in use" not in text.lower():
        return None
    found = re.search(r"port: (\d+)", text)
    port = found.group(1) if found else os.environ.get("MASTER_PORT", "?")
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    return (
        f"the rendezvous address {host}:{port} is already in use (another job on this machine?); pick a free "
        "port: deepspeed --master_port N, torchrun --master-port N (or --rdzv-endpoint HOST:N, or --standalone "
        "on one node)"
    )
