"""Where a rank's time to first step goes: imports by package, then each start-up phase, up to the first
optimizer step done; the SFT benchmark runs it for train.py and TRL, cold and cached.

    PYTHONPATH=tools deepspeed --num_gpus 2 --module bench.sft.startup_probe --startup_out S \
        bench.sft.train_run <its flags>

This module imports only the standard library before it installs its finder, then runs the given module as
__main__ unchanged. Nothing is imported early or in another order, so the run starts as it always does:

- imports: a finder first on sys.meta_path wraps every module's execution and times it, exclusive of the
  modules it imports in turn; a module's time goes to its own heavy package (torch._dynamo, torch,
  transformers, deepspeed, ...) or, for helpers such as sympy, to the heavy package that asked for it. The
  finder costs a few microseconds per module (about 5,000 modules here), so a traced run is slightly slower.
- phases: the calls every runner makes, timed from entry to return with the imports inside them taken out:
  process group (torch.distributed.init_process_group), tokenizer (zero_recipes.data.load_tokenizer, which
  both runners call), data (train.py's data.prepare; TRL's SFTTrainer._prepare_dataset), model build
  (zero_recipes.modeling.model.build_model), deepspeed.initialize, and the first step (the first training forward to
  the second). The rest up to the first step (argument parsing, the trainer's own set-up) is "other".

Each rank writes <startup_out>.rank<N>.json when its second training forward starts, then exits at once: the
breakdown needs no more of the run. With --startup_keep_going (before --startup_out) the rank writes the same record
and the run goes on to its end: `benchmark.py sft --quick` traces its timed round's train.py and TRL launches so,
instead of launching each runner once more to its first step.
"""

from __future__ import annotations

import functools
import importlib.abc
import json
import os
import runpy
import sys
import time

HEAVY = ("torch._dynamo", "torch", "transformers", "deepspeed", "datasets", "accelerate", "trl", "peft", "tokenizers")
HEAVY += ("bitsandbytes", "lm_eval", "numpy", "pyarrow", "pandas", "zero_recipes")
HEAVY += ("datatrove", "matplotlib", "ray", "scipy")  # named, so the test can say a text or SFT run imports none
PHASES = (  # module, attribute path, phase: patched as soon as the module has run
    ("torch.distributed", "init_process_group", "process group"),
    ("zero_recipes.data", "load_tokenizer", "tokenizer"),  # the package's names are the ones train.py calls
    ("zero_recipes.data", "prepare", "data"),
    ("trl.trainer.sft_trainer", "SFTTrainer._prepare_dataset", "data"),
    ("zero_recipes.modeling.model", "build_model", "model build"),
    ("deepspeed", "initialize", "deepspeed.initialize"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine.forward", "forward"),
)


def package_of(name: str) -> str | None:
    return next((h for h in HEAVY if name == h or name.startswith(h + ".")), None)


class Trace:
    def __init__(self, out: str, keep_going: bool = False):
        self.out, self.t0, self.keep_going = out, process_start(), keep_going
        self.imports: dict[str, float] = {}
        self.stack: list[list] = []  # [package, start, seconds of nested imports]
        self.import_total = 0.0  # outermost imports' seconds, for taking imports out of the phases
        self.phases: dict[str, float] = {"python start": time.time() - self.t0}  # interpreter, site, this module
        self.forwards = 0
        self.first_forward = None

    def executed(self, name: str, run):
        """Run one module's code, timed; its exclusive seconds go to its package or the nearest heavy one."""
        own = package_of(name) or next((f[0] for f in reversed(self.stack) if f[0] != "other"), "other")
        frame = [own, time.perf_counter(), 0.0]
        self.stack.append(frame)
        try:
            return run()
        finally:
            self.stack.pop()
            seconds = time.perf_counter() - frame[1]
            self.imports[own] = self.imports.get(own, 0.0) + seconds - frame[2]
            if self.stack:
                self.stack[-1][2] += seconds
            else:
                self.import_total += seconds
            for module, path, phase in PHASES:
                if module == name:
                    self.patch(sys.modules[name], path, phase)

    def patch(self, module, path: str, phase: str) -> None:
        *owners, attr = path.split(".")
        owner = functools.reduce(getattr, owners, module)
        original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        wrapper = self.forward if phase == "forward" else self.timed
        if isinstance(original, (classmethod, staticmethod)):
            setattr(owner, attr, type(original)(wrapper(original.__func__, phase)))
        else:
            setattr(owner, attr, wrapper(original, phase))

    def timed(self, fn, phase: str):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            start, imports = time.perf_counter(), self.import_total
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start - (self.import_total - imports)
                self.phases[phase] = self.phases.get(phase, 0.0) + spent

        return call

    def forward(self, fn, _phase: str):
        import torch

        @functools.wraps(fn)
        def call(engine, *args, **kwargs):
            if engine.training and torch.is_grad_enabled():
                self.forwards += 1
                if self.forwards == 1:
                    self.first_forward = time.perf_counter()
                elif self.forwards == 2:
                    self.phases["first step"] = time.perf_counter() - self.first_forward
                    self.write(engine)
            return fn(engine, *args, **kwargs)

        return call

    def write(self, engine) -> None:
        """The breakdown, then the end of this rank (unless keep_going): the first step is done."""
        import torch.distributed as dist

        total = time.time() - self.t0
        known = sum(self.imports.values()) + sum(self.phases.values())
        rank = dist.get_rank() if dist.is_initialized() else 0
        record = {
            "rank": rank,
            "time_to_first_step": total,
            "imports": dict(sorted(self.imports.items(), key=lambda kv: -kv[1])),
            "phases": self.phases,
            "other": total - known,
        }
        with open(f"{self.out}.rank{rank}.json", "w") as f:
            f.write(json.dumps(record) + "\n")
        if self.keep_going:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


class TimedFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: asks the finders after it, then times the module's execution."""

    def __init__(self, trace: Trace):
        self.trace = trace

    def find_spec(self, name, path, target=None):
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = TimedLoader(spec.loader, self.trace)
                return spec
        return None


class TimedLoader(importlib.abc.Loader):
    def __init__(self, loader, trace: Trace):
        self.loader, self.trace = loader, trace

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        return self.trace.executed(module.__name__, lambda: self.loader.exec_module(module))


def process_start() -> float:
    """This process's start, in time.time() seconds (from /proc: psutil would be an import to time)."""
    ticks = int(open(f"/proc/{os.getpid()}/stat").read().rsplit(")", 1)[1].split()[19])
    boot = next(float(x.split()[1]) for x in open("/proc/stat") if x.startswith("btime"))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def main(argv: list[str]) -> None:
    keep_going = "--startup_keep_going" in argv
    argv = [a for a in argv if a != "--startup_keep_going"]
    i = argv.index("--startup_out")
    out, target, rest = argv[i + 1], argv[i + 2], argv[:i] + argv[i + 3 :]
    trace = Trace(out, keep_going)
    sys.meta_path.insert(0, TimedFinder(trace))
    sys.argv = [target, *rest]
    runpy.run_module(target, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
