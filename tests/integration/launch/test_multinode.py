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
import time
from contextlib import contextmanager

import pytest

from helpers import FAST, REPO, free_port


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@contextmanager
def two_nodes():
    """Yield [(namespace, interface, address)] x 2; everything is removed afterwards."""
    if os.geteuid() != 0:  # a contributor's machine; CI runs as root, so there it runs
        pytest.skip("the two-node test needs root for `ip netns` (not a pass: not run here)")
    if not shutil.which("ip"):
        pytest.fail("the two-node test needs iproute2 (`ip netns`); .ci/run installs it")
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


def test_two_nodes_train_like_one_node_of_two_ranks(trained, tmp_path):
    ref = trained("zero2", "fp32").check()
    with two_nodes() as nodes:
        results = finish(
            torchrun_on_nodes(nodes, FAST + ["--deepspeed", "ds_configs/zero2.json"], tmp_path / "run"), timeout=300
        )
    for code, log in results:
        assert code == 0, log[-4000:]
    assert "distributed: 2 ranks = 2 data-parallel" in "".join(log for _, log in results)
    got = losses(tmp_path / "run")
    assert len(got) == 8 and max(abs(a - b) for a, b in zip(got, ref.losses)) <= 1e-5


def test_a_dead_node_ends_the_other_within_60s_with_one_clear_line(tmp_path):
    out = tmp_path / "run"
    args = FAST + ["--max_steps", "5000", "--deepspeed", "ds_configs/zero2.json"]
    with two_nodes() as nodes:
        procs = torchrun_on_nodes(nodes, args, out)
        deadline = time.time() + 180
        while len(losses(out)) < 3 and time.time() < deadline and all(p.poll() is None for p in procs):
            time.sleep(0.5)
        assert len(losses(out)) >= 3, finish(procs, 5)[0][1][-3000:]
        kill_namespace(nodes[1][0])  # node b is gone: its agent and its rank, at once
        killed = time.time()
        [(code, log)] = finish(procs[:1], timeout=120)
        exit_seconds = time.time() - killed
    assert code != 0 and exit_seconds < 60, f"node a exited {code} after {exit_seconds:.1f}s:\n{log[-3000:]}"
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "lost contact with another rank" in errors[0], log[-3000:]
    assert nodes[1][2] in errors[0]  # it names the node that went away
    print(f"dead node: node a exited {exit_seconds:.1f}s after node b was killed")


def test_deepspeed_launcher_hostfile_no_ssh_with_include(trained, tmp_path):
    """Two hosts in a hostfile, each launcher started on its "node" with --no_ssh --node_rank (here both on
    this machine, so --master_addr is loopback); --include takes one slot of each."""
    ref = trained("zero2", "fp32").check()
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=2\nnode-b slots=2\n")
    port = str(free_port())
    procs = []
    for node_rank in (0, 1):
        cmd = [
            "deepspeed",
            "--hostfile",
            str(hostfile),
            "--include",
            "node-a:0@node-b:1",
            "--no_ssh",
            "--node_rank",
            str(node_rank),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            port,
            "train.py",
            *FAST,
            "--deepspeed",
            "ds_configs/zero2.json",
            "--output_dir",
            str(tmp_path / "run"),
        ]
        env = dict(os.environ)
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
    results = finish(procs, timeout=300)
    for code, log in results:
        assert code == 0, log[-4000:]
    got = losses(tmp_path / "run")
    assert len(got) == 8 and max(abs(a - b) for a, b in zip(got, ref.losses)) <= 1e-5


def test_accelerate_launch_with_our_deepspeed_json(trained, tmp_path):
    """tools/accelerate/deepspeed_zero3.yaml names ds_configs/zero3.json; train.py takes it from accelerate."""
    import json

    ref = trained("zero3", "fp32").check()
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        "tools/accelerate/deepspeed_zero3.yaml",
        "--main_process_port",
        str(free_port()),
        "train.py",
        *FAST,
        "--verify_export",
        "--save_steps",
        "4",
        "--output_dir",
        str(tmp_path / "run"),
    ]
    [(code, log)] = finish(
        [
            subprocess.Popen(
                cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
            )
        ],
        timeout=300,
    )
    assert code == 0, log[-4000:]
    ds = json.loads((tmp_path / "run" / "ds_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == 3 and "distributed: 2 ranks = 2 data-parallel" in log
    got = losses(tmp_path / "run")
    assert len(got) == 8 and max(abs(a - b) for a, b in zip(got, ref.losses)) <= 1e-6
