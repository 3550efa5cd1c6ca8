"""DeepSpeed's JIT-op build folders, checked in this process (zero_recipes/ds/jit_ops.py): which ops a config loads,
and what a planted stale lock, a lock a live process holds, a half-built folder and a lock on a shared
filesystem each lead to. TORCH_EXTENSIONS_DIR points at a temporary folder, so the real
~/.cache/torch_extensions is never touched; nothing here compiles (that starts ninja: the integration test
tests/integration/launch/test_ops_launch.py rebuilds one for real, in a launch and in tools/build_ops.py)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from brought_configs import TRAINS
from zero_recipes.config.train_config import ConfigError
from zero_recipes.ds import jit_ops

CPU_OFFLOAD = {"device": "cpu"}
NVME = {"device": "nvme", "nvme_path": "/tmp"}


@pytest.mark.parametrize(
    "ds, ops",
    [
        ({"zero_optimization": {"stage": 2}}, []),  # train.py's own torch AdamW
        (TRAINS["axolotl-zero1"], ["FusedAdamBuilder"]),  # its AdamW block: DeepSpeed's FusedAdam, on a CPU too
        ({"optimizer": {"type": "Adam", "params": {"torch_adam": True}}}, []),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": CPU_OFFLOAD}}, ["CPUAdamBuilder"]),
        (TRAINS["axolotl-zero3-offload-all"], ["CPUAdamBuilder"]),
        ({"zero_optimization": {"stage": 3, "offload_param": NVME}}, ["PinMemoryBuilder", "AsyncIOBuilder"]),
        (
            {"zero_optimization": {"stage": 3, "offload_optimizer": NVME, "offload_param": NVME}},
            ["CPUAdamBuilder", "PinMemoryBuilder", "AsyncIOBuilder"],
        ),
        ({"optimizer": {"type": "Lion"}}, ["FusedLionBuilder"]),
        ({"optimizer": {"type": "Lion"}, "zero_optimization": {"offload_optimizer": CPU_OFFLOAD}}, ["CPULionBuilder"]),
    ],
)
def test_the_ops_a_config_loads(ds, ops):
    from deepspeed.accelerator import get_accelerator

    shm = ["ShareMemCommBuilder"] if get_accelerator().device_name() == "cpu" else []  # every init_distributed
    assert jit_ops.needed(ds) == shm + ops


@pytest.fixture
def ext(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    return tmp_path


def shm_op():
    builders = jit_ops.jit_builders(["ShareMemCommBuilder"])
    if not builders:
        pytest.skip("this accelerator JIT-builds no shm comm op")
    return builders[0]


def plant(builder, built=True, locked=False, age_s=0.0):
    """A build folder as torch leaves it: build.ninja and objects, the .so once linked, the lock mid-build."""
    folder = jit_ops.build_folder(builder)
    names = ["build.ninja", "shm.o"] + ([f"{builder.name}.so"] if built else []) + (["lock"] if locked else [])
    then = time.time() - age_s
    for name in names:
        (folder / name).write_bytes(b"")
        os.utime(folder / name, (then, then))
    os.utime(folder, (then, then))
    return folder


def test_a_finished_build_is_left_alone(ext):
    builder = shm_op()
    plant(builder)
    said = []
    jit_ops.settle([builder], say=said.append)
    assert said == []


def test_a_stale_lock_is_removed_saying_so(ext):
    builder = shm_op()
    folder = plant(builder, locked=True)
    said = []
    jit_ops.settle([builder], say=said.append)
    assert said == [
        f"DeepSpeed op {builder.name}: removed {folder}/lock, left by a build that was interrupted (no process on "
        "this machine holds it)"
    ]
    assert not (folder / "lock").exists() and (folder / f"{builder.name}.so").exists()


def test_a_lock_a_live_builder_holds_is_waited_for_not_removed(ext, monkeypatch):
    """This process takes the lock as torch's FileBaton does (O_EXCL, the descriptor kept open): the check names
    it and waits, and carries on once the build ends."""
    monkeypatch.setattr(jit_ops, "POLL_S", 0.05)
    monkeypatch.setattr(jit_ops, "SAY_AFTER_S", 0.2)  # 3 s in a run: a rank's routine load holds it for less
    builder = shm_op()
    folder = plant(builder, built=False)
    fd = os.open(folder / "lock", os.O_CREAT | os.O_EXCL)
    said = []
    waiter = threading.Thread(target=jit_ops.settle, args=([builder],), kwargs={"say": said.append})
    waiter.start()
    time.sleep(0.5)
    me = f"process {os.getpid()} ({open('/proc/self/comm').read().strip()})"
    assert said == [f"waiting for {me} building DeepSpeed op {builder.name} in {folder}"]
    assert waiter.is_alive() and (folder / "lock").exists()
    (folder / f"{builder.name}.so").write_bytes(b"")  # the build links, then releases the baton
    os.close(fd)
    (folder / "lock").unlink()
    waiter.join(timeout=5)
    assert not waiter.is_alive()


def test_a_half_built_folder_is_rebuilt_and_the_other_ranks_wait_for_it(ext, monkeypatch):
    """No lock, no .so: the deciding rank builds it (saying so; the real build is in the integration test); the
    other ranks do not go on to load it until it is there."""
    monkeypatch.setattr(jit_ops, "POLL_S", 0.05)
    builder = shm_op()
    folder = plant(builder, built=False)
    state = jit_ops.observe(folder, builder.name)
    assert jit_ops.action(state) == "build" and state.started
    other_rank = threading.Thread(target=jit_ops.await_settled, args=([builder],))
    other_rank.start()
    time.sleep(0.3)
    assert other_rank.is_alive()
    (folder / f"{builder.name}.so").write_bytes(b"")
    other_rank.join(timeout=5)
    assert not other_rank.is_alive()


def test_a_lock_on_a_shared_filesystem_is_one_line_once_nothing_changes(ext, monkeypatch):
    """On NFS and the like another machine may hold the lock: the check waits while the folder changes and gives
    one line, naming the folder and the fix, after QUIET_S without a change."""
    monkeypatch.setattr(jit_ops, "local_filesystem", lambda path: False)
    builder = shm_op()
    folder = plant(builder, built=False, locked=True, age_s=jit_ops.QUIET_S - 60)
    assert jit_ops.action(jit_ops.observe(folder, builder.name)) == "wait"
    plant(builder, built=False, locked=True, age_s=jit_ops.QUIET_S + 60)
    with pytest.raises(ConfigError) as e:
        jit_ops.settle([builder], say=print)
    assert str(e.value) == (
        f"DeepSpeed op {builder.name}: {folder}/lock is left by a build that stopped (no process on this machine "
        "holds it and nothing in the folder changed for 11 min); every launch would wait on it forever. If no "
        f"other machine is building it, remove that folder (rm -rf {folder}) or run `python tools/build_ops.py`, "
        "then relaunch"
    )
    assert (folder / "lock").exists()


def test_filesystem_kinds(tmp_path):
    assert jit_ops.local_filesystem(tmp_path)
    assert not jit_ops.local_filesystem(jit_ops.Path("/proc/self"))
