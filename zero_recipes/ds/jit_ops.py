"""DeepSpeed's JIT-built ops: which ones a run loads, and their build folders settled before any rank waits on one.

DeepSpeed compiles an op on first use through torch.utils.cpp_extension.load, which guards the op's build
folder with torch's FileBaton (torch/utils/file_baton.py): a `lock` file created with O_EXCL, its descriptor
held open by the builder for the whole build and the file removed when the build ends. A builder killed
mid-build leaves the file behind, and every later load waits on it forever: FileBaton.wait polls
os.path.exists with no timeout and no message. A process that was waiting when someone removes the lock then
imports an .so that was never linked (ImportError). So before DeepSpeed loads anything, one process per machine
(`settle`) looks at each op the run will load:

- no lock, the .so there: nothing to do.
- no lock, no .so (never built, or an earlier build stopped): it builds it now, saying so. torch's own baton
  guards that build; ninja keeps the objects an interrupted build finished.
- a lock that a process on this machine holds open, or a folder a process works in (torch runs ninja with the
  folder as its cwd, and its compilers inherit it): a live build. It waits, saying who builds what.
- a lock nobody could hold: the folder is on this machine's own disk (not NFS, Lustre, ...), every process of
  the lock's owner that could be a builder (a Python interpreter or a compiler, by its comm and cmdline, which
  all may read) could be read, and none holds it. It is left from an interrupted build: removed (under an flock
  on the folder, re-checked there, so two launches never both remove a lock one of them just took) and the op
  rebuilt, saying so. Not seen: a builder in another container (another PID namespace) writing into the same
  host folder; TORCH_EXTENSIONS_DIR per container avoids that.
- a lock nobody here holds on a shared filesystem: another machine may be building there (a multi-node first
  run does exactly that). It waits while the folder changes; after QUIET_S without a change it is one line
  naming the folder and the fix, exit 2.

The other processes on the machine (`await_settled`) build nothing and remove nothing: each waits until every op
is built, or built by a live process, and only then lets DeepSpeed load it.
"""

from __future__ import annotations

import fcntl
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from zero_recipes.distributed.launcher_env import rank_info
from zero_recipes.ds.facts import offloads
from zero_recipes.errors import ConfigError

QUIET_S = 600.0  # a folder unchanged this long is not being built: one compile step (nvcc, many archs) is shorter
POLL_S = 0.5
# torch takes the baton at every first load in a process, built or not, to let ninja check the build: another
# rank holds it for a fraction of a second at every launch. A wait is said once it lasts, then every minute.
SAY_AFTER_S = 3.0
SAY_EVERY_S = 60.0

# Measured on a 2-core Xeon shared with other jobs (the ninja logs of a fresh ~/.cache/torch_extensions/py311_cpu);
# CUDA ops vary with the GPU architectures compiled for.
BUILD_S = {"deepspeed_shm_comm": 28, "cpu_adam": 43, "fused_adam": 97, "pin_memory": 23, "async_io": 153}

# Filesystems only this machine writes: a lock on one can only be held by a process here.
LOCAL_FS = {"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs", "f2fs", "ramfs", "bcachefs", "jfs"}

FIX = "python tools/build_ops.py"

# What works in a build folder while torch builds there: torch runs `ninja` with the folder as its cwd, and the
# compilers and linkers it starts inherit it (/proc/PID/comm, at most 15 characters). A shell or editor opened in
# the folder is not a builder.
TOOLCHAIN = {"ninja", "c++", "g++", "gcc", "cc", "cc1", "cc1plus", "as", "ld", "collect2", "nvcc", "cicc", "ptxas"}
TOOLCHAIN |= {"fatbinary", "nvlink", "cudafe++", "clang", "clang++", "hipcc", "icpx", "ld.bfd", "ld.gold", "lld"}


def needed(ds: dict) -> list[str]:
    """The op builders (accelerator class names) a run with this resolved DeepSpeed config JIT-loads, in the
    order it loads them. Read off DeepSpeed 0.19.8:
    - comm/torch.py: TorchBackend.__init__ calls build_shm_op() at every init_distributed, whatever the world
      size; it loads ShareMemCommBuilder where deepspeed.ops.__compatible_ops__ says so (the CPU accelerator).
    - runtime/engine.py _configure_basic_optimizer / get_optimizer_configuration, for an `optimizer` block:
      Adam/AdamW/Muon take DeepSpeedCPUAdam (CPUAdamBuilder) with offload_optimizer on cpu or nvme
      (zero_use_cpu_optimizer), torch's Adam with `torch_adam`, else FusedAdam (FusedAdamBuilder, which the CPU
      accelerator has too: axolotl's zero1.json on a CPU); Adagrad and Lion their CPU op when offloaded,
      Lion FusedLion and Lamb FusedLamb otherwise.
    - no `optimizer` block: engine.make_optimizer builds DeepSpeedCPUAdam when the optimizer is offloaded,
      torch AdamW otherwise.
    - runtime/swap_tensor: NVMe offload of either kind loads AsyncIOBuilder, whose load() loads PinMemoryBuilder
      first (op_builder/async_io.py and op_builder/cpu/async_io.py)."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    ops = []
    shm = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if shm is not None and deepspeed.ops.__compatible_ops__.get(shm.NAME, False):
        ops.append("ShareMemCommBuilder")
    offload_optimizer, offload_param = offloads(ds)
    ops += _optimizer_ops(ds.get("optimizer"), offload_optimizer in ("cpu", "nvme"))
    if "nvme" in (offload_optimizer, offload_param):
        ops += ["PinMemoryBuilder", "AsyncIOBuilder"]
    return ops


def _optimizer_ops(block, offloaded: bool) -> list[str]:
    if not isinstance(block, dict) or "type" not in block:
        return ["CPUAdamBuilder"] if offloaded else []
    name, params = str(block["type"]).lower(), block.get("params") or {}
    if name in ("adam", "adamw", "muon"):
        if params.get("torch_adam"):
            return []
        return ["CPUAdamBuilder"] if offloaded else ["FusedAdamBuilder"]
    if name == "adagrad":
        return ["CPUAdagradBuilder"] if offloaded else []
    if name == "lion":
        return ["CPULionBuilder"] if offloaded else ["FusedLionBuilder"]
    if name == "lamb":
        return ["FusedLambBuilder"]
    return []


def jit_builders(names: list[str]) -> list:
    """The builders among `names` that DeepSpeed would JIT-compile here: not prebuilt into the installed
    DeepSpeed (OpBuilder.load imports those), and compatible with this machine (the others fail in DeepSpeed
    with its own message, or in ds_checks.machine_problems)."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import accelerator_name, installed_ops

    acc, out = get_accelerator(), []
    for name in names:
        builder = acc.create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            continue
        if installed_ops.get(builder.name, False) and accelerator_name == acc._name:
            continue
        out.append(builder)
    return out


def build_folder(builder) -> Path:
    """Where torch builds this op: DeepSpeed's jit_load calls torch's load(name=builder.name) with no
    build_directory, so torch's own _get_build_directory (TORCH_EXTENSIONS_DIR, or
    ~/.cache/torch_extensions/py311_cpu|cuXXX; it creates the folder, as the build would)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(os.path.realpath(_get_build_directory(builder.name, False)))


@dataclass(frozen=True)
class State:
    folder: Path
    name: str
    locked: bool
    built: bool  # the .so torch imports is there
    started: bool  # an earlier build wrote something (build.ninja, objects)
    builders: tuple[str, ...]  # "process 123 (ninja)": holding the lock or working in the folder, on this machine
    provable: bool  # no process elsewhere could hold the lock (see the module's docstring)
    quiet_s: float  # seconds since anything in the folder changed


def observe(folder: Path, name: str) -> State:
    from torch.utils.cpp_extension import LIB_EXT

    lock = folder / "lock"
    try:
        lock_uid = lock.stat().st_uid
    except FileNotFoundError:
        lock_uid = None
    entries = [folder / e.name for e in _entries(folder) if e.name != "lock"]
    builders, hidden = _builders(lock, folder) if lock_uid is not None else ([], set())
    changed = max(_mtime(p) for p in [*entries, lock, folder])
    return State(
        folder=folder,
        name=name,
        locked=lock_uid is not None,
        built=(folder / f"{name}{LIB_EXT}").exists(),
        started=bool(entries),
        builders=tuple(builders),
        provable=local_filesystem(folder) and lock_uid not in hidden,
        quiet_s=time.time() - changed,
    )


def action(state: State, quiet_s: float = QUIET_S) -> str:
    """What the deciding process does: 'ready', 'build', 'wait', 'clear' (a lock nobody can hold) or 'stale'
    (one line, exit 2: a lock nobody here holds and nothing changed for quiet_s)."""
    if not state.locked:
        return "ready" if state.built else "build"
    if state.builders:
        return "wait"
    if state.provable:
        return "clear"
    return "stale" if state.quiet_s >= quiet_s else "wait"


def stale_line(state: State) -> str:
    return (
        f"DeepSpeed op {state.name}: {state.folder}/lock is left by a build that stopped (no process on this "
        f"machine holds it and nothing in the folder changed for {state.quiet_s / 60:.0f} min); every launch "
        f"would wait on it forever. If no other machine is building it, remove that folder "
        f"(rm -rf {state.folder}) or run `{FIX}`, then relaunch"
    )


def settle(builders: list, say=print, quiet_s: float = QUIET_S) -> None:
    """The deciding process: leave every op built, or raise ConfigError for a lock it cannot tell is stale."""
    for builder in builders:
        folder, since, said = build_folder(builder), time.time(), 0.0
        while (what := action(state := observe(folder, builder.name), quiet_s)) != "ready":
            if what == "build":
                _build(builder, state, say)
                break
            if what == "clear":
                if _clear(state):
                    say(
                        f"DeepSpeed op {state.name}: removed {folder}/lock, left by a build that was interrupted "
                        "(no process on this machine holds it)"
                    )
            elif what == "stale":
                raise ConfigError(stale_line(state))
            else:
                if time.time() - since >= SAY_AFTER_S and time.time() - said >= SAY_EVERY_S:
                    said = time.time()
                    say(_waiting_line(state, quiet_s))
                time.sleep(POLL_S)


def await_settled(builders: list) -> None:
    """The other processes on this machine: wait until each op is built, or is being built by a live process
    (torch's baton then makes their load wait for it), so none loads an op while the deciding one settles it."""
    for builder in builders:
        folder = build_folder(builder)
        while True:
            state = observe(folder, builder.name)
            if (state.built and not state.locked) or (state.locked and state.builders):
                break
            time.sleep(POLL_S)


def prepare(ds: dict) -> None:
    """train.py, before any process group: the ops this run loads, settled by local rank 0 of each machine."""
    ranks = rank_info()
    builders = jit_builders(needed(ds))
    if ranks.local_rank != 0:
        return await_settled(builders)
    try:
        settle(builders, say=lambda line: print(line, flush=True))
    except ConfigError as e:
        if ranks.rank != 0:  # train.py's entry point prints rank 0's error only; this machine's log must show its own
            print(f"error: {e}", file=sys.stderr, flush=True)
        raise


def _build(builder, state: State, say) -> None:
    why = "an earlier build did not finish" if state.started else "first run on this machine"
    took = BUILD_S.get(state.name)  # a resumed build keeps the objects it finished: at most this long
    eta = f"{'up to ' if state.started else ''}about {took} s on a quiet 2-core CPU" if took else "a few minutes"
    say(f"building DeepSpeed op {state.name} in {state.folder} ({why}; {eta})...")
    start = time.time()
    builder.load(verbose=False)
    say(f"DeepSpeed op {state.name} built in {time.time() - start:.0f} s")


def _clear(state: State) -> bool:
    """Remove a lock nobody holds, re-checked under an flock on the folder: two launches that both judged it
    stale serialise here, and the second finds the first one's rebuild holding a new lock."""
    fd = os.open(state.folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        again = observe(state.folder, state.name)
        if action(again) != "clear":
            return False
        try:
            (state.folder / "lock").unlink()
        except PermissionError:
            raise ConfigError(
                f"DeepSpeed op {state.name}: {state.folder}/lock is left by an interrupted build and this user "
                "cannot remove it; ask its owner to, or set TORCH_EXTENSIONS_DIR to a folder of your own"
            ) from None
        except FileNotFoundError:
            return False
        return True
    finally:
        os.close(fd)


def _waiting_line(state: State, quiet_s: float) -> str:
    if state.builders:
        who = ", ".join(state.builders[:2]) + (
            f" and {len(state.builders) - 2} more" if len(state.builders) > 2 else ""
        )
        return f"waiting for {who} building DeepSpeed op {state.name} in {state.folder}"
    return (
        f"waiting on {state.folder}/lock: no process on this machine holds it, so another machine may be building "
        f"DeepSpeed op {state.name} there (last change {state.quiet_s:.0f} s ago; giving up after "
        f"{quiet_s / 60:.0f} min without one)"
    )


def _builders(lock: Path, folder: Path) -> tuple[list[str], set[int]]:
    """Processes on this machine holding `lock` open or with `folder` as their cwd, and the uids of the processes
    whose /proc entries this user may not read (a builder among them would be invisible)."""
    found, hidden = [], set()
    lock_s, folder_s = str(lock), str(folder)
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            comm = Path(f"{entry.path}/comm").read_text().strip()
            working = comm in TOOLCHAIN and os.readlink(f"{entry.path}/cwd") == folder_s
            if working or any(os.readlink(fd.path) == lock_s for fd in os.scandir(f"{entry.path}/fd")):
                found.append(f"process {entry.name} ({comm})")
        except PermissionError:
            try:
                if _could_build(entry.path):
                    hidden.add(entry.stat().st_uid)
            except FileNotFoundError:
                continue
        except OSError:  # it exited while we looked
            continue
    return found, hidden


def _could_build(proc: str) -> bool:
    """For a process whose fds and cwd this user may not read (another user's; or one that made itself
    non-dumpable, as some init and sandbox daemons do, which even root cannot read without CAP_SYS_PTRACE):
    whether it could be a builder. torch's baton is held by a Python interpreter and the build run by ninja and
    its compilers; /proc/PID/comm and cmdline stay readable to all."""
    try:
        comm = Path(f"{proc}/comm").read_text().strip()
        cmdline = Path(f"{proc}/cmdline").read_bytes().lower()
    except OSError:
        return True  # hidden entirely (hidepid): assume the worst
    return comm in TOOLCHAIN or b"python" in cmdline or comm.startswith("pt_")


def local_filesystem(path: Path) -> bool:
    """Whether `path` lies on a filesystem only this machine writes (the longest mount point in
    /proc/self/mountinfo that holds it, and its type)."""
    best, fstype = "", ""
    target = str(path)
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])  # a space is written \040
        kind = fields[fields.index("-") + 1]
        if (target == mount or target.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
            best, fstype = mount, kind
    return fstype in LOCAL_FS


def _entries(folder: Path) -> list:
    try:
        return list(os.scandir(folder))
    except FileNotFoundError:
        return []


def _mtime(path: Path) -> float:
    try:
        return path.stat(follow_symlinks=False).st_mtime
    except FileNotFoundError:
        return 0.0
