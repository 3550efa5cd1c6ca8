"""launch(..., launcher="forked"): torchrun's own elastic agent (torch.distributed.launcher.elastic_launch, what
the `torchrun` command runs) started in the pytest worker, whose ranks Python's forkserver forks from one
process that has already imported torch, TorchDynamo, transformers, datasets, peft and DeepSpeed.

Why: the suite is launch-bound. A rank of a tiny 8-step run spends most of its CPU importing those packages
(docs/dev/test-suite.md#how-long-it-takes), and every launch paid it again in every rank and in the launcher. Here each
pytest-xdist worker pays it once; a rank starts at `train.py`'s own imports. What stays real: train.py's
`__main__` block, DeepSpeed, the process group (the agent's TCPStore, gloo/shm), the rank environment torchrun
sets, the run's files. What it does not check: a fresh interpreter's import order, nor the launcher's exit
codes and signals. The runs that do (the quick start's baseline under the `deepspeed` launcher, faults, kills,
refusals in the shell, the multi-node recipe, multi-node and Slurm, the torchrun-vs-deepspeed test) keep a
real launcher; docs/dev/test-suite.md#launchers lists which runs use which.

Test-only, like tests/inject/sitecustomize.py: nothing here is production code.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# imported once per pytest worker, in the forkserver; each rank imports zero_recipes and train.py itself
PRELOAD = [
    "torch",
    "torch._dynamo",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "datasets",
    "peft",
    "deepspeed",
]
# Read when a process starts (tests/inject/sitecustomize.py, the HF hub's constants, DeepSpeed's op cache):
# a forked rank would see the forkserver's value, not this launch's, so such launches take a real launcher.
READ_AT_START = ("ZERO_RECIPES_TEST_", "HF_", "TRANSFORMERS_", "TORCH_EXTENSIONS_DIR", "PYTHONPATH")
# what torchrun's agent sets in each rank's environment (LocalElasticAgent._start_workers, start_processes)
AGENT_KEYS = (
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)


class _Exit(BaseException):
    """train.py's last act, process_group.finish's os._exit(code), turned into a return value: a forked rank must
    return to torch's process wrapper, which hands the result to the agent before the process ends."""


def rank_main(argv: list[str], env: dict, stdout: str, stderr: str) -> int:
    """One rank: this launch's environment plus what the agent set, output appended to the launch's files (both
    ranks, interleaved as a launcher's console shows them), then train.py run as `python train.py ARGV` runs it."""
    import runpy

    agent = {k: v for k, v in os.environ.items() if k in AGENT_KEYS or k.startswith("TORCHELASTIC_")}
    os.environ.clear()
    os.environ.update(env, **agent)
    for fd, path in ((1, stdout), (2, stderr)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(REPO)
    sys.argv = ["train.py", *argv]
    exit_process, rank_pid = os._exit, os.getpid()

    def returning_exit(code):
        if os.getpid() != rank_pid:  # a process the rank forked (py-cpuinfo's probe) exits as it would
            exit_process(code)
        raise _Exit(code)

    os._exit = returning_exit
    try:
        runpy.run_path(str(REPO / "train.py"), run_name="__main__")
        code = 0
    except _Exit as e:
        code = e.args[0]
    finally:
        os._exit = exit_process
    if code:
        raise SystemExit(code)  # the agent stops the other ranks, as torchrun does when one fails
    return code


def launch(argv: list[str], nproc: int, port: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """train.py ARGV on `nproc` forked ranks under torchrun's agent, the rendezvous on 127.0.0.1:PORT (torchrun's
    static rendezvous, as `torchrun --master_port PORT` uses). Returns what a launcher subprocess would; past
    `timeout` seconds the ranks are killed and the launch fails with what they printed."""
    if late := sorted(k for k in env if k.startswith(READ_AT_START) and os.environ.get(k) != env[k]):
        raise ValueError(f"{late} are read when a process starts: launch this run with a real launcher")
    multiprocessing.set_forkserver_preload(PRELOAD)  # takes effect when this worker's forkserver first starts
    with tempfile.TemporaryDirectory(prefix="forked-launch-") as logs:
        watchdog = threading.Timer(timeout, _kill_ranks)
        watchdog.start()
        try:
            return _launch(argv, nproc, port, env, Path(logs))
        finally:
            watchdog.cancel()


def launch_watched(watcher_main, out_var: str, out_prefix: Path, args: list[str], output_dir: Path, **kwargs):
    """helpers.launch(args, output_dir, launcher="forked", ...) whose ranks run `watcher_main` (a test module's
    rank_main that watches what train.py does and calls this module's rank_main) instead of rank_main, each
    writing what it saw to OUT_PREFIX.rankR.json (the environment's `out_var` names the prefix): tests/export_memory.py,
    tests/muon_calls.py."""
    import pytest

    import helpers

    env = {**kwargs.pop("env", {}), out_var: str(out_prefix)}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys.modules[__name__], "rank_main", watcher_main)
        return helpers.launch(args, output_dir, launcher="forked", env=env, **kwargs)


def read_watched(out_prefix: Path, nproc: int) -> list[dict]:
    """What each rank of a `launch_watched` run wrote, by rank."""
    import json

    return [json.loads(Path(f"{out_prefix}.rank{r}.json").read_text()) for r in range(nproc)]


def _kill_ranks() -> None:
    """SIGKILL what this worker's forkserver forked: the ranks of the one launch in flight."""
    import psutil

    server = multiprocessing.forkserver._forkserver._forkserver_pid
    for child in psutil.Process(server).children(recursive=True) if server else []:
        child.kill()


def _launch(argv, nproc, port, env, log_dir: Path) -> subprocess.CompletedProcess:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    out, err = log_dir / "stdout.txt", log_dir / "stderr.txt"
    out.touch(), err.touch()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="static",
        rdzv_endpoint=f"127.0.0.1:{port}",
        rdzv_configs={"rank": 0},
        max_restarts=0,
        monitor_interval=0.1,
        start_method="forkserver",
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir / "torchelastic")),
    )
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}
    try:
        elastic_launch(config, rank_main)(list(argv), env, str(out), str(err))
        code = 0
    except ChildFailedError:
        code = 1  # what the torchrun command exits with when a rank fails
    finally:
        for s, h in handlers.items():  # the agent installs its own; the pytest worker keeps its
            signal.signal(s, h)
    args = ["forked", "--nproc_per_node", str(nproc), "--master_port", str(port), "train.py", *argv]
    return subprocess.CompletedProcess(args, code, out.read_text(), err.read_text())
