"""What the tests inject into the processes they launch, so production code carries no test hooks.

tests/conftest.py puts this directory first on PYTHONPATH; Python then imports this file at start-up in
every process a test starts (launchers, ranks, benchmarks). It wraps DeepSpeed and zero_recipes functions
as they are imported, and only when asked (tests/helpers.fault_env):

    ZERO_RECIPES_TEST_PORTS=LO:HI            ports come from this range (one per pytest-xdist worker)
    ZERO_RECIPES_TEST_NAN_AT_STEP=N          the training loss of optimizer step N becomes NaN (a real backward
                                             and optimizer step run on it)
    ZERO_RECIPES_TEST_KILL=WHERE:STEP:RANK   SIGKILL that rank during that step's checkpoint save. in_save: its
                                             DeepSpeed files are written and `latest` has not moved, the moment a
                                             kill is most dangerous. after_save: the checkpoint is complete, as
                                             when a job dies between saves.
    ZERO_RECIPES_TEST_SLOW_PREPARE=SECONDS   rank 0 takes that long more to prepare the data, as a large corpus
                                             would, while the others wait for it
    ZERO_RECIPES_TEST_PROCESS_LOG=FILE       each process appends one JSON line at exit: the test that started it
                                             (PYTEST_CURRENT_TEST), its command, CPU and wall seconds. Where the
                                             suite's time goes, process by process (docs/tests.md).
"""

import importlib.abc
import os
import signal
import sys

NAN_AT_STEP = int(os.environ.get("ZERO_RECIPES_TEST_NAN_AT_STEP", 0))
KILL = os.environ.get("ZERO_RECIPES_TEST_KILL", "")
PORTS = os.environ.get("ZERO_RECIPES_TEST_PORTS", "")
PROCESS_LOG = os.environ.get("ZERO_RECIPES_TEST_PROCESS_LOG", "")
SLOW_PREPARE = float(os.environ.get("ZERO_RECIPES_TEST_SLOW_PREPARE", 0))


def _log_process(started: float) -> None:
    import json
    import time

    cpu = os.times()
    line = {
        "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
        "argv": sys.argv[:3],
        "rank": os.environ.get("RANK"),
        "cpu_s": round(cpu.user + cpu.system, 2),
        "wall_s": round(time.time() - started, 2),
    }
    with open(PROCESS_LOG, "a") as f:  # one short write per line: appends from many processes stay whole
        f.write(json.dumps(line) + "\n")


def _kill_if(where: str, step: int) -> None:
    if KILL == f"{where}:{step}:{os.environ.get('RANK', 0)}":
        os.kill(os.getpid(), signal.SIGKILL)


def _patch_engine(module) -> None:
    engine = module.DeepSpeedEngine
    forward, save_checkpoint = engine.forward, engine.save_checkpoint

    def nan_forward(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if self.training and self.global_steps + 1 == NAN_AT_STEP:
            out.loss = out.loss * float("nan")
        return out

    def killing_save_checkpoint(self, save_dir, tag=None, *args, **kwargs):
        result = save_checkpoint(self, save_dir, tag, *args, **kwargs)
        _kill_if("in_save", int(str(tag).split("-")[-1]))
        return result

    if NAN_AT_STEP:
        engine.forward = nan_forward
    if KILL.startswith("in_save:"):
        engine.save_checkpoint = killing_save_checkpoint


def _patch_checkpointer(module) -> None:
    save = module.Checkpointer.save

    def killing_save(self, engine, step, *args, **kwargs):
        path = save(self, engine, step, *args, **kwargs)
        _kill_if("after_save", step)
        return path

    module.Checkpointer.save = killing_save


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs patch(module) right after `name` is first imported, whoever imports it."""

    def __init__(self, name: str, patch):
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                break
        else:
            return None
        exec_module, patch = spec.loader.exec_module, self.patch

        def exec_and_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def _patch_data(module) -> None:
    prepare = module.prepare

    def slow_prepare(*args, **kwargs):
        if os.environ.get("RANK", "0") == "0":
            import time

            time.sleep(SLOW_PREPARE)
        return prepare(*args, **kwargs)

    module.prepare = slow_prepare


def _patch_ports(module) -> None:
    free_port = module.free_port
    module.free_port = lambda span=None: free_port(span or PORTS)


if PROCESS_LOG:
    import atexit
    import time

    _started, _exit = time.time(), os._exit
    atexit.register(lambda: _log_process(_started))

    def _restart_clock():  # a rank forked from the tests' forkserver (tests/forked_launch.py) starts now
        global _started
        _started = time.time()

    os.register_at_fork(after_in_child=_restart_clock)

    def _log_and_exit(code):  # train.py leaves with os._exit (process_group.finish), which skips atexit
        _log_process(_started)
        _exit(code)

    os._exit = _log_and_exit
if PORTS:
    sys.meta_path.insert(0, _PatchOnImport("zero_recipes.distributed.ports", _patch_ports))
if NAN_AT_STEP or KILL.startswith("in_save:"):
    sys.meta_path.insert(0, _PatchOnImport("deepspeed.runtime.engine", _patch_engine))
if SLOW_PREPARE:
    sys.meta_path.insert(0, _PatchOnImport("zero_recipes.data", _patch_data))
if KILL.startswith("after_save:"):
    sys.meta_path.insert(0, _PatchOnImport("zero_recipes.checkpointing.checkpoint", _patch_checkpointer))
