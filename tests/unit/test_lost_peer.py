"""The one line a rank prints when a collective fails because another rank or node went away."""

import pytest


@pytest.mark.parametrize(
    "raw,named",
    [
        (
            "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [10.1.2.3]:32465: Connection reset by "
            "peer. This is typically caused by a remote worker hanging",
            "Connection reset by peer from 10.1.2.3",
        ),
        (
            "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:599] Connection closed by peer [10.1.2.3]:22813",
            "Connection closed by peer from 10.1.2.3",
        ),
        ("NCCL communicator was aborted on rank 3.", "NCCL communicator was aborted"),
    ],
)
def test_lost_peer_line_names_what_gloo_and_nccl_said(raw, named):
    """Both shapes of gloo's peer-loss message seen from a killed node (CI met the second), and NCCL's."""
    from zero_recipes.distributed import lost_peer

    line = lost_peer(RuntimeError(raw))
    assert line.startswith("rank ") and f"({named})" in line and "relaunch the same command" in line
    assert lost_peer(RuntimeError("CUDA out of memory")) is None and lost_peer(ValueError("bad")) is None
