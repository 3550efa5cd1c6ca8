"""Many nodes, for real, on one machine.

Two network namespaces joined by a veth pair are two "nodes", each with its own address and nothing else
in common but the filesystem (like nodes on a shared FS). torchrun's c10d rendezvous joins them; a node
killed mid-run must end the other within 60 s with one clear line, not a 30-minute collective timeout.
The deepspeed launcher's multi-node path (hostfile, --include, --no_ssh with --node_rank) and
`accelerate launch` with one of our DeepSpeed JSONs run here too.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from contextlib import contextmanager

import pytest

from helpers import REPO, free_port


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@contextmanager
def two_nodes():
    """Yield [(namespace, interface, address)] x 2; everything is removed afterwards."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.fail("the two-node test needs root and iproute2 (`ip netns`), as CI has")
    tag = f"zr{os.getpid() % 100000}"
    subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    nodes = [(f"{tag}a", f"{tag}a", f"{subnet}.1"), (f"{tag}b", f"{tag}b", f"{subnet}.2")]
    try:
        for ns, _, _ in nodes:
            sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", nodes[0][1], "type", "veth", "peer", "name", nodes[1][1])
        for ns, dev, addr in nodes:
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield nodes
    finally:
        for ns, _, _ in nodes:
            kill_namespace(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # takes the veth pair with it


def kill_namespace(ns: str) -> None:
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def torchrun_on_nodes(nodes, args: list[str], output_dir) -> list[subprocess.Popen]:
    """One torchrun per node, as a user would type it on each machine. --local_addr and GLOO_SOCKET_IFNAME
    pick the node's own address: without them torchrun advertises the hostname (here 127.0.0.1 in every
    namespace) and gloo binds the interface the hostname resolves to (seen: both hang)."""
    port = free_port()
    procs = []
    for i, (ns, dev, addr) in enumerate(nodes):
        cmd = [
            "ip",
            "netns",
            "exec",
            ns,
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc_per_node",
            "1",
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            f"{nodes[0][2]}:{port}",
            "--rdzv_id",
            f"zr-{port}",
            "--local_addr",
            addr,
            "--rdzv_conf",
            f"is_host={str(i == 0).lower()}",
            "train.py",
            *args,
            "--output_dir",
            str(output_dir),
        ]
        env = {**os.environ, "GLOO_SOCKET_IFNAME": dev}
        env.pop("OMP_NUM_THREADS", None)
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    return procs


def finish(procs, timeout: float) -> list[tuple[int, str]]:
    out = []
    for p in procs:
        try:
            log, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            log, _ = p.communicate()
            log += "\n<killed by the test: timeout>"
        out.append((p.returncode, log))
    return out


def losses(output_dir) -> list[float]:
    import json

    path = output_dir / "metrics.jsonl"
    records = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return [r["loss"] for r in records if "loss" in r]


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
