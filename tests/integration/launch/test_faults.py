"""Faults through the real launcher: preemption signals save and exit cleanly; a dead rank ends the job
quickly; the next launch resumes from the last complete checkpoint, the steps after it logged once."""

import os
import signal
import subprocess
import time

import psutil
import pytest

from helpers import FAST, REPO, fault_env, free_port, launch, remove_shm

# Long enough that a signal sent after step 12 (at ~8 steps/s here) lands before the run ends, with 6 saves
STEPS = 30
ARGS = [a for a in FAST] + ["--deepspeed", "ds_configs/zero2.json"]
ARGS[ARGS.index("--max_steps") + 1] = str(STEPS)
ARGS[ARGS.index("--save_steps") + 1] = "5"


def start(output_dir):
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    port = free_port()
    cmd = [
        "deepspeed",
        "--num_gpus",
        "2",
        "--master_port",
        str(port),
        "train.py",
        *ARGS,
        "--output_dir",
        str(output_dir),
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    proc.port = port
    return proc


def wait_for_steps(output_dir, proc, n, timeout=300):
    path = output_dir / "metrics.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and sum(1 for line in path.read_text().splitlines() if '"loss"' in line) >= n:
            return
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        time.sleep(0.2)
    raise AssertionError(f"no {n} steps within {timeout}s")


def ranks(proc) -> dict[int, psutil.Process]:
    out = {}
    for p in psutil.Process(proc.pid).children(recursive=True):
        for arg in p.cmdline():
            if arg.startswith("--local_rank="):
                out[int(arg.split("=")[1])] = p
    return out


def latest(output_dir) -> str:
    return (output_dir / "checkpoints" / "latest").read_text().strip()


@pytest.mark.parametrize("how", ["SIGUSR1 to one rank", "SIGTERM to every rank", "Ctrl-C"])
def test_preemption_saves_at_the_step_boundary_and_exits_cleanly(how, tmp_path):
    out = tmp_path / "run"
    proc = start(out)
    wait_for_steps(out, proc, 3)
    if how == "Ctrl-C":  # what a terminal does: SIGINT to the whole foreground group (the launcher adds SIGTERM)
        os.killpg(proc.pid, signal.SIGINT)
    else:
        sig = signal.SIGUSR1 if "SIGUSR1" in how else signal.SIGTERM
        for p in [ranks(proc)[1]] if "one rank" in how else list(ranks(proc).values()):
            p.send_signal(sig)
    log = proc.communicate(timeout=120)[0]
    line = next(x for x in log.splitlines() if x.startswith("stop requested"))
    said = "SIGUSR1" if "SIGUSR1" in how else "Ctrl-C / SIGTERM"
    assert line.startswith(f"stop requested ({said}): checkpoint saved at"), line
    assert "Resume by launching the same command" in line
    step = int(latest(out).split("-")[1])
    assert 3 <= step < STEPS and f"step-{step}" in line
    assert not (out / "model.safetensors").exists()  # not finished, so not exported
    if how == "Ctrl-C":  # the launcher exits 1 on its own SIGINT, whatever the ranks did; resuming is as below
        # DeepSpeed's own runner prints a KeyboardInterrupt traceback of its wait() (runner.py, 0.19.8);
        # no rank may print one
        frames = [x for x in log.splitlines() if x.lstrip().startswith('File "')]
        assert not any("zero_recipes" in x or "train.py" in x for x in frames), frames
        return
    assert proc.returncode == 0, log[-4000:]
    if "SIGTERM" in how:  # the same stop path saved the same checkpoint: resuming from it is SIGUSR1's row
        return
    # launching the same command again continues from that checkpoint and finishes
    again = launch(ARGS, out).check()
    assert f"resume: loaded {out / 'checkpoints' / f'step-{step}'} at step {step}" in again.log
    assert [r["step"] for r in again.records if "loss" in r][-1] == STEPS


def test_a_dead_rank_ends_the_job_quickly(tmp_path):
    """The deepspeed launcher ends the job when a rank dies. That the next launch resumes, each step logged once,
    is test_a_kill_during_save_leaves_the_previous_checkpoint_as_latest's check (its relaunch replaces steps
    6-10 the killed launch logged after step-5), and bit for bit after a SIGKILL the contract's resume column."""
    out = tmp_path / "run"
    proc = start(out)
    wait_for_steps(out, proc, 12)
    ranks(proc)[1].send_signal(signal.SIGKILL)
    killed = time.time()
    log = proc.communicate(timeout=120)[0]
    exit_seconds = time.time() - killed
    remove_shm(proc.port)
    assert proc.returncode != 0, log[-3000:]
    assert exit_seconds < 60, f"job took {exit_seconds:.1f}s to exit after a rank died:\n{log[-3000:]}"
    print(f"dead rank: job exited {exit_seconds:.1f}s after SIGKILL of rank 1 (code {proc.returncode})")
    assert int(latest(out).split("-")[1]) >= 10


def test_a_kill_during_save_leaves_the_previous_checkpoint_as_latest(tmp_path):
    out = tmp_path / "run"
    killed = launch(ARGS, out, env=fault_env(kill="in_save:10:1"))
    remove_shm(killed.port)
    assert killed.proc.returncode != 0
    assert (out / "checkpoints" / "step-10").is_dir()  # rank 0 finished its files; rank 1 died in the save
    assert latest(out) == "step-5"  # never the partial one
    again = launch(ARGS, out).check()
    assert f"resume: loaded {out / 'checkpoints' / 'step-5'} at step 5" in again.log
    assert [r["step"] for r in again.records if "loss" in r] == list(range(1, STEPS + 1))


def test_a_nan_loss_stops_with_the_step_and_saves_no_nan_checkpoint(tmp_path):
    out = tmp_path / "run"
    run = launch(ARGS + ["--logging_steps", "10"], out, env=fault_env(nan_at_step=7))
    assert run.proc.returncode == 1
    errors = [line for line in run.log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "non-finite (NaN or inf) at step 7" in errors[0], run.log[-3000:]
    assert "the last good checkpoint is step-5" in errors[0]
    assert latest(out) == "step-5" and not (out / "checkpoints" / "step-10").exists()
    assert [r["step"] for r in run.records if "loss" in r] == []  # nothing non-finite was logged either


def test_fp16_overflow_lines_survive_the_quiet_deepspeed_logger():
    """fp16 does not run on this CPU, so the overflow path is checked at the logger: DeepSpeed's own
    overflow line (its exact wording, at INFO) still reaches the user while its INFO chatter does not."""
    import logging

    from deepspeed.utils import logger

    from zero_recipes.distributed import deepspeed_logs

    deepspeed_logs.quiet_deepspeed()
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    overflow = "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, reducing to 32768"
    try:
        logger.info(overflow)
        logger.info("Reduce bucket size 500000000")
        logger.warning("a warning")
    finally:
        logger.removeHandler(handler)
    assert seen == [overflow, "a warning"]


def test_the_others_wait_for_rank0s_data_past_the_collective_timeout(tmp_path):
    """Rank 0 prepares the data (or converts a checkpoint) for all while the others wait: a large corpus takes
    longer than --ddp_timeout, which on GPUs is NCCL's watchdog. The wait is on the host group (LONG_WAIT)."""
    args = FAST + ["--deepspeed", "ds_configs/zero2.json", "--max_steps", "2", "--ddp_timeout", "8"]
    run = launch(args, tmp_path / "run", launcher="torchrun", env=fault_env(slow_prepare=16)).check()
    assert [r["step"] for r in run.records if "loss" in r] == [1, 2]
