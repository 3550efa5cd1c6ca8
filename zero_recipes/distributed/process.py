"""Process-level setup and teardown shared by every launcher (deepspeed, torchrun, srun, plain python)."""

from __future__ import annotations

import os
import re
import sys
from datetime import timedelta

from zero_recipes.errors import ConfigError


def rank_info() -> tuple[int, int, int, int]:
    """(rank, local_rank, world_size, local_world_size) from the launcher's environment; 1 process if none."""
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or _local_world_from_launcher(world)
    return rank, local_rank, world, local_world


def accelerate_launch_choices(values: dict) -> dict:
    """`accelerate launch` with a DeepSpeed accelerate config hands its choices to the script in the
    environment: the JSON (`deepspeed_config_file`) and `mixed_precision`. Taken when the recipe and the
    command line are silent, so an accelerate config naming one of ds_configs/ works unchanged."""
    env = os.environ
    if env.get("ACCELERATE_USE_DEEPSPEED") != "true":
        return {}
    out: dict = {}
    if "deepspeed" not in values and env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"):
        out["deepspeed"] = [env["ACCELERATE_DEEPSPEED_CONFIG_FILE"]]
    precision = env.get("ACCELERATE_MIXED_PRECISION")
    if precision in ("bf16", "fp16") and "bf16" not in values and "fp16" not in values:
        out[precision] = True
    return out


def _local_world_from_launcher(world: int) -> int:
    # The deepspeed launcher sets no LOCAL_WORLD_SIZE; it passes the node's ranks in CROSS_* or nothing.
    for var in ("LOCAL_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return world


def set_threads(local_world: int) -> int:
    """Give each rank its share of the cores when the launcher did not. The deepspeed launcher leaves
    OMP_NUM_THREADS unset, and 2 ranks x all cores on 2 cores ran 3-25x slower (measured); torchrun sets 1."""
    import torch

    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    n = max(1, cores // max(1, local_world))
    os.environ["OMP_NUM_THREADS"] = str(n)
    torch.set_num_threads(n)
    return n


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


# Work one rank does for all (reading and tokenizing a corpus, cleaning it, converting a checkpoint to universal
# form, writing an export) can outlast any timeout short enough to catch a dead peer: NCCL's watchdog would abort
# every waiting rank at --ddp_timeout, half an hour into preparing c4. Those waits go through a gloo group of
# their own with this timeout: gloo waits on the host, with no CUDA stream or NCCL watchdog involved.
LONG_WAIT = timedelta(hours=24)
_host_group = None


def init(timeout_seconds: int = 1800, long_waits: bool = True) -> None:
    """Start the process group with DeepSpeed (NCCL on GPUs, gloo/shm on CPUs), every collective bound by
    `timeout_seconds` (--ddp_timeout), and (`long_waits`) the host group for waits on one rank's work. A plain
    `python train.py` becomes a world of one."""
    global _host_group
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cuda":
        get_accelerator().set_device(int(os.environ["LOCAL_RANK"]))
    try:
        deepspeed.init_distributed(timeout=timedelta(seconds=timeout_seconds))
    except RuntimeError as e:
        if line := address_in_use(e):
            raise ConfigError(line) from None
        raise
    _host_group = dist.new_group(backend="gloo", timeout=LONG_WAIT) if long_waits else None


def host_group():
    """The gloo group for waits on one rank's work (LONG_WAIT): collectives on it never meet the NCCL watchdog.
    None (the default group) in a process group that `init` did not start."""
    return _host_group


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


def rank0_first(rank: int, fn):
    """Collective: run fn on rank 0 first (it fills the caches), then on the others, which read them. A
    ConfigError on rank 0 is raised on every rank, so no rank waits forever at the barrier. The others wait on
    the host group, however long rank 0 takes."""
    import torch

    error = [None]
    result = None
    if rank == 0:
        try:
            result = fn()
        except ConfigError as e:
            error[0] = str(e)
    torch.distributed.broadcast_object_list(error, src=0, group=host_group())
    if error[0] is not None:
        raise ConfigError(error[0])
    if rank != 0:
        result = fn()
    torch.distributed.barrier(group=host_group())
    return result


def report_refusal(error: ConfigError) -> int:
    """Bad input: one line that names the problem and the fix, no traceback; the exit code. Every rank meets the
    same error and rank 0 speaks for all. The others linger a moment before exiting, because the launchers kill
    all ranks as soon as one exits non-zero, and that could silence rank 0 mid-print (seen)."""
    import time

    if int(os.environ.get("RANK", 0)) == 0:
        print(f"error: {error}", file=sys.stderr, flush=True)
    else:
        time.sleep(3)
    return 2


def quiet_deepspeed() -> None:
    """DeepSpeed logs every bucket and timer at INFO; keep its warnings, drop the chatter
    (ZERO_RECIPES_DEBUG=1 brings it back)."""
    import logging

    from deepspeed.utils import logger

    if not os.environ.get("ZERO_RECIPES_DEBUG") and not any(
        isinstance(f, _KeepWarningsAndOverflows) for f in logger.filters
    ):
        logger.setLevel(logging.INFO)
        logger.addFilter(_KeepWarningsAndOverflows())


class _KeepWarningsAndOverflows:
    """DeepSpeed reports an fp16 overflow (the skipped step and its loss scale) at INFO, among hundreds of
    INFO lines of chatter; keep those and the warnings."""

    def filter(self, record) -> bool:
        import logging

        return record.levelno >= logging.WARNING or "OVERFLOW" in str(record.msg)


def remove_shm_segment() -> None:
    """DeepSpeed's CPU shm all-reduce creates /dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>
    (69 MB a rank) and never unlinks it (its shared_close is never called, DeepSpeed 0.19.8). Launches on
    fresh ports filled /dev/shm until the OOM killer took a rank (measured here). Every rank has mapped
    its peers' segments at init, so removing our own name at exit is safe."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port:
        name = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{os.environ.get('RANK', 0)}"
        try:
            os.unlink(name)
        except OSError:
            pass


def finish(code: int = 0) -> None:
    """Exit without running C++ static destructors. Leaving with live gloo/shm threads aborts with
    "terminate called without an active exception", even after destroy_process_group (about 1 run in 90,
    measured); os._exit after an orderly shutdown cannot hit it."""
    import torch.distributed as dist

    try:
        if dist.is_initialized():
            if code == 0:
                dist.barrier()
            dist.destroy_process_group()
    except Exception:
        pass
    remove_shm_segment()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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


class StopRequest:
    """A stop asked for: Ctrl-C (SIGINT), SIGTERM or SIGUSR1 (what Slurm and cloud schedulers send before
    taking a node) asks for a checkpoint and a clean exit at the next step boundary. Launchers signal ranks
    one at a time or only some of them, so the ranks agree at each boundary with one tiny all-reduce on a
    gloo group (on GPUs a separate one, so it never waits on the CUDA stream).

    Ctrl-C reaches a rank twice: the terminal sends SIGINT to every process in the foreground group, and
    the deepspeed launcher, on its own SIGINT, sends SIGTERM to every rank (launch.py, 0.19.8). So a rank
    cannot tell Ctrl-C from a scheduler's SIGTERM, and its stop line names both. A second signal more than
    REPEAT_AFTER seconds after the first is the user insisting: it exits at once."""

    SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1")
    REPEAT_AFTER = 2.0  # seconds: the launcher's SIGTERM follows the terminal's SIGINT within milliseconds

    def __init__(self):
        import signal

        import torch.distributed as dist

        self.received: str | None = None
        self.at = 0.0
        self.group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        for name in self.SIGNALS:
            signal.signal(getattr(signal, name), self._handle)

    def _handle(self, signum, frame) -> None:
        import signal
        import time

        if self.received is not None:
            if time.monotonic() - self.at > self.REPEAT_AFTER:
                os._exit(128 + signum)
            return
        self.received, self.at = signal.Signals(signum).name, time.monotonic()

    @staticmethod
    def describe(name: str) -> str:
        """What the user or the scheduler did, as the stop line says it."""
        return "Ctrl-C / SIGTERM" if name in ("SIGINT", "SIGTERM") else name

    def agreed(self) -> str | None:
        """Collective: the signal any rank received, or None. Call at the same point on every rank."""
        import torch
        import torch.distributed as dist

        mine = torch.tensor([self.SIGNALS.index(self.received) + 1 if self.received else 0], dtype=torch.int32)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self.group)
        return self.SIGNALS[int(mine.item()) - 1] if int(mine.item()) else None
