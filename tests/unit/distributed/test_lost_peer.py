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
        # ProcessGroupNCCL's two texts for a peer that went away: NCCL's own remote error (its socket closed), and
        # the watchdog's timeout when nothing closed (a node powered off, or a hung rank)
        (
            "NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:77, remote process exited or there "
            "was a network error, NCCL version 2.27.3\nncclRemoteError: A call failed possibly due to a network "
            "error or a remote process exiting prematurely.",
            "remote process exited or there was a network error",
        ),
        (
            "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=212, OpType=ALLREDUCE, "
            "NumelIn=1, NumelOut=1, Timeout(ms)=1800000) ran for 1800083 milliseconds before timing out.",
            "Watchdog caught collective operation timeout",
        ),
    ],
)
def test_lost_peer_line_names_what_gloo_and_nccl_said(raw, named):
    """Both shapes of gloo's peer-loss message seen from a killed node (CI met the second), and NCCL's."""
    from zero_recipes.distributed.lost_peer import lost_peer

    line = lost_peer(RuntimeError(raw))
    assert line.startswith("rank ") and f"({named})" in line and "relaunch the same command" in line
    assert lost_peer(RuntimeError("CUDA out of memory")) is None and lost_peer(ValueError("bad")) is None


def test_a_busy_rendezvous_port_is_named_not_reported_as_a_lost_peer(monkeypatch):
    """What torch raises when another job holds the port (DistNetworkError, a DistError like a lost peer)."""
    import torch.distributed as dist

    from zero_recipes.distributed.lost_peer import lost_peer
    from zero_recipes.distributed.ports import address_in_use

    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")
    error = dist.DistNetworkError(
        "The server socket has failed to listen on any local network address. port: 29500, useIpv6: false, "
        "code: -98, name: EADDRINUSE, message: address already in use"
    )
    assert lost_peer(error) is None
    line = address_in_use(error)
    assert "10.0.0.7:29500 is already in use" in line and "--master_port" in line and "--master-port" in line
    assert address_in_use(dist.DistNetworkError("Connection reset by peer")) is None
