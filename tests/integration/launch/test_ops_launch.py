"""An interrupted first run's JIT build, met by the next launch (zero_recipes/ds/jit_ops.py; the cases one by one are
in tests/unit/ds/test_ops_cache.py). The launch gets a TORCH_EXTENSIONS_DIR of its own, a copy of the real cache's
shm comm folder, so the real ~/.cache/torch_extensions is never touched and nothing compiles for minutes."""

import shutil

from helpers import FAST, launch, load_tool, tool_in_process
from zero_recipes.ds import jit_ops


def interrupted_shm_build(tmp_path, monkeypatch):
    """A TORCH_EXTENSIONS_DIR whose shm comm folder is as a killed build leaves it: the objects and the lock,
    no .so (copied from the real cache, which stays as it is)."""
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    builders = jit_ops.jit_builders(["ShareMemCommBuilder"])
    assert builders, "the CPU accelerator JIT-builds its shm comm op"
    ext = tmp_path / "torch_extensions"
    folder = ext / builders[0].name
    shutil.copytree(jit_ops.build_folder(builders[0]), folder, ignore=shutil.ignore_patterns("lock", "*.so"))
    (folder / "lock").touch()  # with no process holding it: the builder was killed
    return builders[0], folder


def test_a_stale_lock_on_a_half_built_op_is_cleared_and_rebuilt_not_waited_on(tmp_path, monkeypatch):
    """What a run killed while linking DeepSpeed's shm comm op leaves: its lock, its objects, no .so. Every CPU
    launch loads that op; before the check each one waited on the lock forever without a word. Now the first
    rank removes it and relinks the op, saying so, while the other rank waits for it; then both train."""
    shm, folder = interrupted_shm_build(tmp_path, monkeypatch)
    run = launch(
        FAST + ["--deepspeed", "ds_configs/zero2.json", "--max_steps", "2"],
        tmp_path / "out",
        launcher="torchrun",
        env={"TORCH_EXTENSIONS_DIR": str(folder.parent)},
        timeout=300,  # the hang this replaces never ends; a rebuild from nothing takes about 30 s here
    ).check()
    removed = f"DeepSpeed op {shm.name}: removed {folder}/lock, left by a build that was interrupted"
    assert run.log.count(removed) == 1, run.log[-3000:]
    building = [line for line in run.log.splitlines() if line.startswith(f"building DeepSpeed op {shm.name}")]
    assert len(building) == 1 and str(folder) in building[0]
    assert "waiting for" not in run.log  # the other rank's own load of the op holds torch's lock only briefly
    assert (folder / f"{shm.name}.so").exists() and not (folder / "lock").exists()
    assert len(run.losses) == 2


def test_build_ops_clears_the_same_lock_and_rebuilds(tmp_path, monkeypatch):
    """tools/build_ops.py settles the ops with the same check, in its own process (here this one; OPS cut to the
    shm op, the one copied), then loads each."""
    shm, folder = interrupted_shm_build(tmp_path, monkeypatch)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(folder.parent))
    monkeypatch.setattr(load_tool("build_ops"), "OPS", ("ShareMemCommBuilder",))
    run = tool_in_process("build_ops")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith(f"DeepSpeed op {shm.name}: removed {folder}/lock, left by a build that was interrupted")
    assert lines[1].startswith(f"building DeepSpeed op {shm.name} in {folder} (an earlier build did not finish")
    assert lines[-1].startswith(f"ShareMemCommBuilder: ready in {folder} (")
    assert (folder / f"{shm.name}.so").exists() and not (folder / "lock").exists()
