"""A real Slurm cluster of one node on this machine, private to the test module that starts it.

Debian's slurm-wlm and munge (.ci/run installs them): one munged, one slurmctld and one slurmd, each with
its own socket, ports, state and spool directories and log files under a temporary directory, so that two
test modules (pytest-xdist workers) can run a cluster each at the same time. Nothing is mocked: jobs are
submitted with the real sbatch and run by the real slurmd.

    from slurm_cluster import cluster  # noqa: F401 -- the module-scoped fixture

    def test_something(cluster):
        jobid = cluster.sbatch("--wrap", "hostname")
        assert cluster.wait(jobid) == "COMPLETED"

API (a SlurmCluster):
    cluster.env          the environment for Slurm's commands and the jobs: os.environ + SLURM_CONF
    cluster.partition    the default partition; cluster.node: its one node (named as this host is)
    cluster.urgent       a partition on the same node whose jobs preempt the default partition's (requeued:
                         SIGTERM, KillWait, then back to PENDING), as a higher-priority partition does on a cluster
    cluster.cpus         CPUs the node offers (2)
    cluster.run(cmd)     run a Slurm command (sbatch, squeue, scontrol, scancel ...) in cluster.env, checked
    cluster.sbatch(*a)   `sbatch --parsable *a` from the repository root; returns the job id
    cluster.state(id)    the job's state (PENDING, RUNNING, COMPLETED, CANCELLED, FAILED ...)
    cluster.job(id)      every field of `scontrol show job` as a dict (StdOut, Restarts, ExitCode ...)
    cluster.wait(id)     wait until the job has ended (states: ENDED); returns its state
    cluster.start_now(id, restarts)  once the job is requeued for the `restarts`th time, start it without the
                         ~2 minutes Slurm holds a requeued job (Reason BeginTime), as `scontrol update` lets a user
    cluster.log()        the daemons' logs, for an assertion message

Settings a test may rely on: KillWait=30 (seconds between SIGTERM and SIGKILL when a job is cancelled,
requeued or preempted), MinJobAge=600 (a finished job stays visible to scontrol that long), JobRequeue=1.

Where Slurm cannot start (not root, a package missing, a daemon that dies), the fixture FAILS with the reason:
CI runs as root with the packages installed, so a skip would hide a broken set-up.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helpers import REPO, free_port

ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
DAEMONS = ("munged", "slurmctld", "slurmd")
KILL_WAIT = 30


@dataclass
class SlurmCluster:
    root: Path
    env: dict
    node: str
    partition: str = "debug"
    urgent: str = "urgent"
    cpus: int = 2
    pids: dict = field(default_factory=dict)

    def run(self, cmd: list[str], check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        """A Slurm command in this cluster's environment; check=True fails with its output."""
        proc = subprocess.run(
            [str(c) for c in cmd], env=self.env, capture_output=True, text=True, timeout=timeout, **kw
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(map(str, cmd))} failed ({proc.returncode}): {proc.stdout}{proc.stderr}")
        return proc

    def sbatch(self, *args, env: dict | None = None, cwd=REPO) -> str:
        """Submit `sbatch --parsable ARGS` from `cwd` (the repository root), with `env` added; the job id."""
        full = {**self.env, **(env or {})}
        proc = subprocess.run(
            ["sbatch", "--parsable", *map(str, args)], env=full, cwd=cwd, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, f"sbatch failed ({proc.returncode}): {proc.stdout}{proc.stderr}"
        return proc.stdout.strip().split(";")[0]

    def job(self, jobid: str) -> dict:
        """`scontrol show job -o JOBID` as a dict ({} once Slurm has forgotten the job)."""
        out = self.run(["scontrol", "show", "job", "-o", jobid], check=False).stdout.strip()
        fields = {}
        for item in out.split(" "):
            key, _, value = item.partition("=")
            if value or key not in fields:
                fields[key] = value
        return fields if "JobState" in fields else {}

    def state(self, jobid: str) -> str:
        return self.job(jobid).get("JobState", "")

    def wait(self, jobid: str, timeout: float = 300, states=ENDED) -> str:
        """Wait until the job is in one of `states` (by default: ended) and not completing; its state."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            fields = self.job(jobid)
            if fields.get("JobState") in states and "COMPLETING" not in fields.get("JobState", ""):
                return fields["JobState"]
            self.check_alive()
            time.sleep(0.5)
        raise AssertionError(f"job {jobid} still {self.job(jobid).get('JobState')} after {timeout}s\n{self.log()}")

    def start_now(self, jobid: str, restarts: int, timeout: float = 120) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            fields = self.job(jobid)
            if fields.get("JobState") == "PENDING" and int(fields.get("Restarts", 0)) >= restarts:
                # slurmd refuses the job's new credential if it dates from the second its old one was revoked
                # ("Job credential revoked": the job fails), which the hold normally keeps from happening
                time.sleep(1.5)
                self.run(["scontrol", "update", f"JobId={jobid}", "StartTime=now"])
                return
            self.check_alive()
            time.sleep(0.2)
        raise AssertionError(f"job {jobid} not requeued {restarts} time(s) after {timeout}s: {self.job(jobid)}")

    def check_alive(self) -> None:
        for name, proc in self.pids.items():
            if isinstance(proc, subprocess.Popen) and proc.poll() is not None:
                raise AssertionError(f"{name} exited ({proc.returncode})\n{self.log()}")

    def log(self, tail: int = 3000) -> str:
        return "\n".join(
            f"--- {name}.log\n{(self.root / f'{name}.log').read_text(errors='replace')[-tail:]}"
            for name in DAEMONS
            if (self.root / f"{name}.log").exists()
        )


def fail(reason: str):
    pytest.fail(f"cannot start a Slurm cluster: {reason} (.ci/run installs slurm-wlm and munge; CI runs as root)")


@contextmanager
def slurm_cluster(root: Path):
    """Start munged, slurmctld and slurmd with their files under `root`; yield a SlurmCluster; stop them after."""
    if os.geteuid() != 0:
        fail("slurmd must run as root to start jobs as their user")
    missing = [b for b in ("munged", "slurmctld", "slurmd", "sbatch") if not shutil.which(b)]
    if missing:
        fail(f"{', '.join(missing)} not found")
    root = Path(root)
    for d in ("state", "spool", "munge"):
        (root / d).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "munge", 0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))  # a key made for this cluster alone
    os.chmod(key, 0o600)
    sock = root / "munge" / "munge.sock"
    node = socket.gethostname().split(".")[0]
    ctld_port, slurmd_port = free_port(), free_port()
    while slurmd_port == ctld_port:
        slurmd_port = free_port()
    conf = root / "slurm.conf"
    conf.write_text(
        config(root, node, sock, ctld_port, slurmd_port, first_job=1000 * (ctld_port % 1000 + 1), tag=ctld_port)
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    for var in [v for v in env if v.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and v != "SLURM_CONF"]:
        del env[var]  # a test run inside a Slurm job must not hand that job's settings to these commands
    cluster = SlurmCluster(root, env, node)
    try:
        munged = [
            "munged", "--foreground", "--force", f"--socket={sock}", f"--key-file={key}",
            f"--pid-file={root / 'munge' / 'munged.pid'}", f"--log-file={root / 'munged.log'}",
            f"--seed-file={root / 'munge' / 'munged.seed'}",
        ]  # fmt: skip
        cluster.pids["munged"] = start(munged, root, "munged", env)
        wait_for(lambda: sock.exists(), 20, "munged's socket", cluster)
        cluster.pids["slurmctld"] = start(["slurmctld", "-D", "-i", "-f", conf], root, "slurmctld", env)
        cluster.pids["slurmd"] = start(["slurmd", "-D", "-N", node, "-f", conf], root, "slurmd", env)
        wait_for(lambda: node_idle(cluster), 60, "the node to be idle", cluster)
        yield cluster
    finally:
        stop(cluster)


def config(root: Path, node: str, sock: Path, ctld_port: int, slurmd_port: int, first_job: int, tag: int) -> str:
    mem_mb = int(next(line for line in open("/proc/meminfo") if line.startswith("MemTotal")).split()[1]) // 1024
    return f"""\
# written by tests/slurm_cluster.py for one test module
ClusterName=zr{tag}
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
FirstJobId={first_job}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SlurmdParameters=config_overrides
ReturnToService=2
KillWait={KILL_WAIT}
MinJobAge=600
JobRequeue=1
NodeName={node} NodeAddr=127.0.0.1 CPUs=2 RealMemory={mem_mb * 9 // 10} State=UNKNOWN
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP PriorityTier=1
PartitionName=urgent Nodes={node} MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
"""


def start(cmd, root: Path, name: str, env: dict) -> subprocess.Popen:
    out = open(root / f"{name}.stdout", "w")
    return subprocess.Popen(
        [str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def wait_for(ready, timeout: float, what: str, cluster: SlurmCluster) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        for name, proc in cluster.pids.items():
            if proc.poll() is not None:
                out = (cluster.root / f"{name}.stdout").read_text(errors="replace")
                fail(f"{name} exited ({proc.returncode}) while waiting for {what}: {out[-2000:]}\n{cluster.log()}")
        if ready():
            return
        time.sleep(0.2)
    fail(f"no {what} after {timeout}s\n{cluster.log()}")


def node_idle(cluster: SlurmCluster) -> bool:
    proc = cluster.run(["sinfo", "-h", "-n", cluster.node, "-o", "%T"], check=False)
    return proc.returncode == 0 and proc.stdout.strip() == "idle"


def stop(cluster: SlurmCluster) -> None:
    """Kill the jobs left, stop slurmd, slurmctld and munged (in that order), then SIGKILL every process still
    carrying this cluster's SLURM_CONF (a job step slurmd had not reaped): nothing outlives the test module."""
    if "slurmctld" in cluster.pids and cluster.pids["slurmctld"].poll() is None:
        jobs = cluster.run(["squeue", "-h", "-o", "%i"], check=False, timeout=20).stdout.split()
        if jobs:
            cluster.run(["scancel", "--full", "--signal=KILL", *jobs], check=False, timeout=20)
            cluster.run(["scancel", *jobs], check=False, timeout=20)
            deadline = time.time() + 15
            while cluster.run(["squeue", "-h"], check=False, timeout=20).stdout.strip() and time.time() < deadline:
                time.sleep(0.5)
    for name in reversed(DAEMONS):
        proc = cluster.pids.get(name)
        if proc is None or proc.poll() is not None:
            continue
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    mark = f"SLURM_CONF={cluster.env['SLURM_CONF']}".encode() + b"\0"
    for pid in [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and int(p.name) != os.getpid()]:
        try:
            if mark in (Path("/proc") / str(pid) / "environ").read_bytes():
                os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A Slurm cluster for the test module that imports this fixture, stopped after its last test."""
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as c:
        yield c
