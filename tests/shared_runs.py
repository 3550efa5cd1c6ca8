"""Runs that many tests read, trained once per pytest invocation rather than once per pytest-xdist worker.

Each xdist worker is its own pytest session, so a session fixture alone trains its runs once per worker
(pytest-xdist #271): with 2 workers, both trained the ZeRO-0..3 baselines. pytest-xdist's documented recipe
for "session fixtures executed only once" is a file lock under the base temp directory that all workers
share (`tmp_path_factory.getbasetemp().parent`): the first worker to ask for a run trains it while holding
its lock and writes the finished launch down; a worker that asks later, or waits on the lock meanwhile,
reads the same run back. A failed launch is recorded too, so every test that reads it fails the same way
(its `.check()` shows the log), as before.

Tests read these directories and never write into them (a test that changes a run copies it first:
helpers.at_step_4, shutil.copytree).
"""

from __future__ import annotations

import importlib
import json
import subprocess
from pathlib import Path

from filelock import FileLock

from helpers import Run, launch


class SharedRuns:
    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def get(self, key: str, args: list[str], nproc: int = 2, launcher: str = "deepspeed", prepare=None) -> Run:
        """The finished launch of `train.py ARGS --output_dir ROOT/KEY/run`, trained by whichever worker asked
        first. `prepare(dir)` may make what the run needs (an NVMe directory) and return extra arguments.
        launcher "forked+MODULE": forked ranks that test module's launch() watches (tests/export_memory.py measures
        the export's gather, tests/muon_calls.py counts Newton-Schulz and the optimizer's state bytes)."""
        where = self.root / key
        record = where / "launch.json"
        where.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(where) + ".lock"):
            if not record.exists():
                where.mkdir(exist_ok=True)
                extra = prepare(where) if prepare else []
                if launcher.startswith("forked+"):  # forked ranks a test module watches (export_memory.py, ...)
                    watch = importlib.import_module(launcher.removeprefix("forked+"))
                    run = watch.launch(list(args) + extra, where / "run", nproc=nproc)
                else:
                    run = launch(list(args) + extra, where / "run", nproc=nproc, launcher=launcher)
                record.write_text(json.dumps(to_json(run)))
            return from_json(json.loads(record.read_text()))

    def made(self, key: str, make) -> Path:
        """ROOT/KEY, made once by `make(path)` whichever worker asks first (a model directory to train from)."""
        where = self.root / key
        with FileLock(str(where) + ".lock"):
            if not (where / ".made").exists():
                make(where)
                (where / ".made").touch()
        return where


def to_json(run: Run) -> dict:
    p = run.proc
    return {"args": p.args, "returncode": p.returncode, "stdout": p.stdout, "stderr": p.stderr,
            "output_dir": str(run.output_dir), "port": run.port}  # fmt: skip


def from_json(d: dict) -> Run:
    proc = subprocess.CompletedProcess(d["args"], d["returncode"], d["stdout"], d["stderr"])
    return Run(proc, Path(d["output_dir"]), d["port"])
