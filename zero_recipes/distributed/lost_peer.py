"""A collective that failed because another rank went away, told in one line."""

from __future__ import annotations

import os
import re

from zero_recipes.distributed.ports import address_in_use

# What gloo and NCCL say when the other end of a collective is gone: a rank or a node died, or the network
# between them failed. torch raises these as DistError subclasses or as plain RuntimeErrors.
_LOST_PEER = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Socket Timeout",
    "NCCL communicator was aborted",
    "remote process exited or there was a network error",
    "ncclRemoteError",
    "Watchdog caught collective operation timeout",  # a peer dead or hung past --ddp_timeout (ProcessGroupNCCL)
)


def lost_peer(error: BaseException) -> str | None:
    """One line for a collective that failed because another rank went away, else None. The launcher's
    own report follows it; this line says what happened and what to do."""
    import torch.distributed as dist

    text = str(error)
    if address_in_use(error) or not (isinstance(error, dist.DistError) or any(m in text for m in _LOST_PEER)):
        return None
    cause = next((m for m in _LOST_PEER if m in text), type(error).__name__)
    # gloo names the peer: "Read error [10.0.0.2]:41234: ..." or "Connection closed by peer [10.0.0.2]:41234"
    peer = re.search(r"\[(\d{1,3}(?:\.\d{1,3}){3})\]", text)
    where = peer.group(1) if peer else ""
    waited = " (or hung past --ddp_timeout)" if "timeout" in cause.lower() else ""
    return (
        f"rank {os.environ.get('RANK', 0)} lost contact with another rank ({cause}{' from ' + where if where else ''}): "
        f"a rank or node died{waited} or the network between them failed. The first error is in that rank's log; "
        "relaunch the same command to resume from the last checkpoint in output_dir"
    )
