"""The process group's life: started with DeepSpeed, the host group for long waits on one rank's work, rank 0
first, and the exit (bad input reported once, the shm segment removed, no C++ destructors run)."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

from zero_recipes.distributed import ports
from zero_recipes.errors import ConfigError

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
        os.environ["MASTER_PORT"] = str(ports.free_port())
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cuda":
        get_accelerator().set_device(int(os.environ["LOCAL_RANK"]))
    try:
        deepspeed.init_distributed(timeout=timedelta(seconds=timeout_seconds))
    except RuntimeError as e:
        if line := ports.address_in_use(e):
            raise ConfigError(line) from None
        raise
    _host_group = dist.new_group(backend="gloo", timeout=LONG_WAIT) if long_waits else None


def host_group():
    """The gloo group for waits on one rank's work (LONG_WAIT): collectives on it never meet the NCCL watchdog.
    None (the default group) in a process group that `init` did not start."""
    return _host_group


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
