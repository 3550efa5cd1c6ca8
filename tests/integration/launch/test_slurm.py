"""tools/slurm/train.sbatch under a real Slurm: Debian's slurmctld, slurmd and munged on this machine, one node
of 2 CPUs (tests/slurm_cluster.py). Jobs are submitted with sbatch as a user types it, the script's #SBATCH
lines overridden for a CPU node (2 ranks, no GPUs). Slurm stops the job the three ways it does on a cluster:
the time limit's SIGUSR1 to the script (--signal=B:USR1@300, sent here with `scancel --batch --signal=USR1`,
as slurmctld sends it), a preemption by a job of a higher-priority partition (SIGTERM, then requeued), and
scancel (SIGTERM). Each saves a checkpoint; each requeued run resumes from it with the uninterrupted job's
losses, exactly."""

from __future__ import annotations

import json
import time

import pytest

from helpers import FAST, free_port, step_losses
from slurm_cluster import cluster  # noqa: F401 -- the module-scoped fixture: a real one-node Slurm

# 32 steps of the quick start's model, ZeRO-3: long enough (about 8 s of training) to be stopped three times
ARGS = FAST + ["--deepspeed", "ds_configs/zero3.json", "--max_steps", "32"]
# A CPU node: the command line overrides the script's #SBATCH lines; NPROC_PER_NODE gives the ranks per node
CPU_NODE = ["--nodes=1", "--gpus-per-node=0", "--cpus-per-task=2"]


class Job:
    """train.sbatch submitted as a user types it, its log and output directory under `tmp`."""

    def __init__(self, slurm, tmp, name: str):
        self.cluster, self.out, self.log_path = slurm, tmp / name, tmp / f"{name}.out"
        env = {"NPROC_PER_NODE": "2", "OMP_NUM_THREADS": "1", "RDZV_PORT": str(free_port())}
        self.id = slurm.sbatch(
            *CPU_NODE, f"--output={self.log_path}", "tools/slurm/train.sbatch", *ARGS, "--output_dir", self.out, env=env
        )

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    @property
    def records(self) -> list[dict]:
        path = self.out / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def steps(self) -> list[int]:
        return [r["step"] for r in self.records if "loss" in r]

    def wait_for_step(self, after: int, timeout: float = 180) -> int:
        """Wait until the job has logged a step past `after`; that step."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if (done := max(self.steps(), default=0)) > after:
                return done
            state = self.cluster.state(self.id)
            assert state in ("PENDING", "RUNNING"), f"job {self.id} {state}\n{self.log[-6000:]}\n{self.cluster.log()}"
            time.sleep(0.2)
        raise AssertionError(f"job {self.id} logged no step past {after} in {timeout}s\n{self.log[-6000:]}")

    def line(self, start: str) -> str:
        """The script's one line starting with `start` (the last such line)."""
        lines = [x for x in self.log.splitlines() if x.startswith(start)]
        assert lines, f"no line starting {start!r} in the job's log:\n{self.log[-6000:]}"
        return lines[-1]

    def saved_step(self, line: str) -> int:
        """The step of the checkpoint the line names, which must exist."""
        path = line.split("checkpoint saved at ")[1].split(" (step ")[0]
        assert path.startswith(str(self.out / "checkpoints" / "step-")), line
        step = int(path.rsplit("-", 1)[1])
        assert (self.out / "checkpoints" / f"step-{step}").is_dir() and f"(step {step} of 32)" in line, line
        return step


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory):  # noqa: F811
    job = Job(cluster, tmp_path_factory.mktemp("slurm-train"), "uninterrupted")
    assert cluster.wait(job.id) == "COMPLETED", job.log[-6000:]
    return job


def test_sbatch_trains_to_the_end_and_leaves_a_model_directory(uninterrupted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log = uninterrupted.log
    assert "zero-recipes: job " in log and "1 node(s) x 2 rank(s)" in log, log[-6000:]
    assert "distributed: 2 ranks = 2 data-parallel" in log and "1 thread(s) per rank" in log, log[-6000:]
    assert sorted(step_losses(uninterrupted)) == list(range(1, 33))
    model = AutoModelForCausalLM.from_pretrained(uninterrupted.out)
    assert model.config.model_type == "llama" and AutoTokenizer.from_pretrained(uninterrupted.out)


def test_time_limit_preemption_and_scancel_each_save_and_the_requeued_job_resumes_exactly(
    cluster,  # noqa: F811
    uninterrupted,
    tmp_path,
):
    """One job's life: stopped at its time limit (the script requeues it), preempted (Slurm requeues it), then
    cancelled. Its logged losses are the uninterrupted job's, step for step, exactly."""
    job = Job(cluster, tmp_path, "stopped")

    # 1. the time limit: Slurm sends the script SIGUSR1 (--signal=B:USR1@300); it stops train.py and requeues
    job.wait_for_step(1)
    cluster.run(["scancel", "--batch", "--signal=USR1", job.id])
    cluster.start_now(job.id, restarts=1)
    at_limit = job.saved_step(job.line(f"zero-recipes: job {job.id} is near its time limit: checkpoint saved at"))
    assert "requeueing it to continue from there" in job.line(f"zero-recipes: job {job.id} is near its time limit")

    # 2. preempted by a job of a higher-priority partition that needs one of the node's CPUs: SIGTERM, requeued
    job.wait_for_step(at_limit)
    urgent = cluster.sbatch("-p", cluster.urgent, "-c", "1", f"--output={tmp_path / 'urgent.out'}", "--wrap", "true")
    cluster.start_now(job.id, restarts=2)
    preempted = job.saved_step(job.line(f"zero-recipes: job {job.id} was preempted or requeued (SIGTERM): checkpoint"))
    assert "DUE TO PREEMPTION" in job.log and cluster.wait(urgent) == "COMPLETED"

    # 3. scancel: SIGTERM, the checkpoint saved and said in one line; the job ends CANCELLED
    job.wait_for_step(preempted)
    cluster.run(["scancel", job.id])
    assert cluster.wait(job.id) == "CANCELLED"
    cancelled = job.line(f"zero-recipes: job {job.id} was cancelled")
    assert cancelled == (
        f"zero-recipes: job {job.id} was cancelled (SIGTERM: scancel, the time limit or a preemption): checkpoint "
        f"saved at {job.out / 'checkpoints' / f'step-{job.saved_step(cancelled)}'} (step {job.saved_step(cancelled)}"
        " of 32); submit the same command again to continue from there"
    )
    last = job.saved_step(cancelled)
    assert 1 <= at_limit < preempted < last < 32, (at_limit, preempted, last)

    for step in (at_limit, preempted):
        assert f"resume: loaded {job.out / 'checkpoints' / f'step-{step}'} at step {step}" in job.log
    got, want = step_losses(job), step_losses(uninterrupted)
    assert sorted(got) == list(range(1, last + 1))
    assert [got[s] for s in got] == [want[s] for s in got]  # exact, not close
