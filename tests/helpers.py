"""What the tests share: train.py run for real (the real launchers, real DeepSpeed, 2 CPU ranks) and the
small settings the training tests use. Fixtures live in conftest.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import forked_launch
from zero_recipes.config import shipped
from zero_recipes.distributed import ports
from zero_recipes.memory.probe import fwd_bwd_peak_bytes  # noqa: F401 -- the estimate tests' real measurement

REPO = Path(__file__).resolve().parent.parent
INJECT = REPO / "tests" / "inject"  # sitecustomize.py for the processes tests launch (conftest puts it on PYTHONPATH)


def free_port() -> int:
    """A port from this pytest worker's own range (conftest.py), as train.py and the benchmarks pick them here."""
    return ports.free_port(os.environ.get("ZERO_RECIPES_TEST_PORTS"))


# Small, fast settings shared by the training tests: the embedded model and corpus, 64-token blocks.
FAST = [
    "--max_steps",
    "8",
    "--block_size",
    "64",
    "--per_device_train_batch_size",
    "4",
    "--logging_steps",
    "1",
    "--eval_steps",
    "0",
    "--save_steps",
    "0",
    "--learning_rate",
    "3e-3",
    "--warmup_steps",
    "1",
    "--max_eval_batches",
    "4",
]


# The SFT workload of the parallelism files' SFT parity tests: chat rows, 128-token blocks, gradient
# checkpointing, one eval at step 8 over the whole held-out split. Their one ZeRO-0 baseline (conftest's
# sft_zero0) trains 8 sequences a step as 2 ranks x micro 2 x 2 accumulation steps.
SFT = ["--dataset_name", "builtin:tiny-instructions", "--dataset_format", "messages", "--block_size", "128"]
SFT += ["--gradient_checkpointing", "true", "--eval_steps", "8", "--max_eval_batches", "0"]
SFT_ZERO0_BATCH = ["--gradient_accumulation_steps", "2", "--per_device_train_batch_size", "2"]


@dataclass
class Run:
    proc: subprocess.CompletedProcess
    output_dir: Path
    port: str = ""

    @property
    def records(self) -> list[dict]:
        path = self.output_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.records if "loss" in r]

    @property
    def log(self) -> str:
        return self.proc.stdout + self.proc.stderr

    def check(self) -> "Run":
        assert self.proc.returncode == 0, f"train.py failed ({self.proc.returncode}):\n{self.log[-6000:]}"
        # DeepSpeed's CPU shm all-reduce leaves a 69 MB /dev/shm segment per rank unless train.py removes it
        leaked = list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{self.port}_*")) if self.port else []
        assert not leaked, f"shared-memory segments left behind: {leaked}"
        return self


def remove_shm(port) -> None:
    """A SIGKILLed rank cannot remove its DeepSpeed shm segment (69 MB); tests that kill one clean up."""
    for f in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
        f.unlink(missing_ok=True)


def launch(
    args: list[str],
    output_dir: Path,
    nproc: int = 2,
    launcher: str = "deepspeed",
    timeout: int = 600,
    env: dict | None = None,
) -> Run:
    """train.py ARGS --output_dir OUTPUT_DIR launched as docs/dev/test-suite.md#launchers says. "deepspeed" (the
    default, the README's launcher) runs the quick start's baseline, test_faults.py's faults, the multi-node recipe,
    the benchmarks and the refusals that must reach the shell. "forked" runs those whose subject is a config
    or a mode: torchrun's agent in this process, ranks forked from a forkserver that has imported torch,
    transformers and DeepSpeed once per worker (tests/forked_launch.py), the same bits as the torchrun command.
    "torchrun" is the command itself, for runs whose faults or environment are read at interpreter start.
    "python" is one process."""
    port = str(free_port())
    if launcher == "deepspeed":
        cmd = ["deepspeed", "--num_gpus", str(nproc), "--master_port", port, "train.py"]
    elif launcher == "torchrun":
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(nproc),
            "--master_port",
            port,
            "train.py",
        ]
    elif launcher == "python":
        cmd = [sys.executable, "train.py"]
    elif launcher != "forked":
        raise ValueError(launcher)
    full_env = dict(os.environ)
    full_env.pop("OMP_NUM_THREADS", None)  # as under the deepspeed launcher: train.py must set it
    full_env.update(env or {})
    if launcher == "forked":
        proc = forked_launch.launch([*args, "--output_dir", str(output_dir)], nproc, port, full_env, timeout)
        return Run(proc, Path(output_dir), port)
    proc = subprocess.run(
        cmd + list(args) + ["--output_dir", str(output_dir)],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return Run(proc, Path(output_dir), port if launcher != "python" else "")


# the shipped combinations the training tests run (all but zero3+offload_optimizer), and both precisions
CONFIGS = shipped.select(
    "zero0", "zero1", "zero2", "zero3", "zero2+offload_optimizer", "zero3+offload_all", "zero3+nvme"
)
PRECISIONS = shipped.PRECISIONS

# max |logits(reloaded HF model) - logits(engine)|: fp32 is exact up to kernel order; bf16 exports the
# bf16 weights the engine computes with.
EXPORT_TOL = {"fp32": 1e-5, "bf16": 1e-2}


def aio_available() -> bool:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().create_op_builder("AsyncIOBuilder").is_compatible(verbose=False)


def fault_env(**faults) -> dict:
    """The environment that makes tests/inject/sitecustomize.py inject faults into train.py's processes:
    fault_env(kill="in_save:10:1") or fault_env(nan_at_step=7); see that file."""
    return {f"ZERO_RECIPES_TEST_{name.upper()}": str(value) for name, value in faults.items()}


# A small Llama for the memory-estimate tests, and how far an estimate may miss a real measurement:
# over by up to 10 %, under by up to 5 % (the estimator issue's target).
SMALL_LLAMA = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 688,
    "vocab_size": 8000,
}
ESTIMATE_OVER, ESTIMATE_UNDER = 0.10, 0.05


def small_llama(**fields):
    from transformers import AutoConfig

    return AutoConfig.for_model("llama", **{**SMALL_LLAMA, **fields})


# Bad input: train.py run as one process, and the one `error:` line it must end with (no traceback)
def run_train(*args, cwd=REPO):
    return subprocess.run(
        [sys.executable, str(REPO / "train.py"), *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def one_error_line(proc) -> str:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


# ---- shared by the parallelism tests (tensor and sequence parallel) ------------------------------------
def step_losses(run) -> dict:
    """{step: loss} of a finished launch's metrics records."""
    return {r["step"]: r["loss"] for r in run.records if "loss" in r}


def export_diff(run) -> float:
    """The export check's max |logits(reloaded) - logits(engine)| a `--verify_export` run recorded."""
    return next(r["export_max_abs_logit_diff"] for r in run.records if "export_max_abs_logit_diff" in r)


def train_args(run) -> list[str]:
    """The command line a run was launched with: what relaunching "the same command" repeats."""
    args = list(run.proc.args)
    return args[args.index("train.py") + 1 : args.index("--output_dir")]


def file_tree(root) -> dict:
    """Every file and folder under root, each file with its checksum: what "nothing of the user's changed"
    compares before and after."""
    import hashlib

    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(Path(root).rglob("*"))
    }


def at_step_4(run_dir, dest):
    """A copy of a finished 8-step run as it was right after its step-4 checkpoint."""
    import shutil

    shutil.copytree(run_dir, dest)
    shutil.rmtree(dest / "checkpoints" / "step-8")
    (dest / "checkpoints" / "latest").write_text("step-4")
    return dest


def train_as_world(world: int, *args):
    """train.py --dry_run as rank 0 of `world` ranks: refusals happen before any process group starts."""
    env = {**os.environ, "WORLD_SIZE": str(world), "RANK": "0", "LOCAL_WORLD_SIZE": str(world)}
    return subprocess.run(
        [sys.executable, "train.py", *args, "--dry_run"], cwd=REPO, env=env, capture_output=True, text=True
    )


# ---- refusals checked in this process ----------------------------------------------------------------
# A refusal that happens before any process group needs no launcher and no fresh interpreter: train.main
# raises the ConfigError that train.py's entry point prints as its one `error:` line with exit 2. Each family
# of refusals keeps one test through a real process or launcher that proves that last step in the shell
# (docs/dev/test-suite.md lists them); the rest call train.main here, a few ms instead of a 5-15 s launch each.
@contextmanager
def as_rank0_of(world: int, local_world: int | None = None):
    """The environment a launcher gives rank 0 of `world` ranks (none for a world of one), restored after."""
    keys = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    saved = {k: os.environ.get(k) for k in keys}
    if world > 1:
        os.environ.update(WORLD_SIZE=str(world), RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(local_world or world))
    else:
        for k in keys:
            os.environ.pop(k, None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def away_from_outputs(args) -> list[str]:
    """ARGS with an --output_dir that does not exist, unless they name one: train.py checks output_dir before
    any process group (and under --dry_run), and the default outputs/tiny-llama may hold a quick start's run."""
    args = [str(a) for a in args]
    if "--output_dir" in args:
        return args
    return args + ["--output_dir", os.path.join(tempfile.gettempdir(), f"zero-recipes-no-output-{os.getpid()}")]


def refusal(*args: str, world: int = 1) -> str:
    """The one line train.py prints for ARGS as rank 0 of `world` ranks, found in this process. It must come
    before any process group: reaching process_group.init fails the test rather than waiting for absent ranks."""
    import train
    from zero_recipes.config.train_config import ConfigError
    from zero_recipes.distributed import process_group

    args = tuple(away_from_outputs(args))

    def no_process_group(*_a, **_k):
        raise AssertionError(f"train.py {' '.join(args)} got as far as starting a process group")

    init, process_group.init = process_group.init, no_process_group
    try:
        with as_rank0_of(world):
            train.main(list(args))
    except ConfigError as e:
        line = f"error: {e}"
    else:
        raise AssertionError(f"train.py {' '.join(args)} was not refused")
    finally:
        process_group.init = init
    assert "\n" not in line, line  # one line, as the entry point prints it
    return line


def dry_run_in_process(*args: str, world: int = 1, local_world: int | None = None) -> str:
    """What `train.py ARGS --dry_run` prints on rank 0 of `world` ranks (exit 0 asserted), in this process."""
    import io
    from contextlib import redirect_stdout

    import train

    out = io.StringIO()
    with as_rank0_of(world, local_world), redirect_stdout(out):
        assert train.main([*away_from_outputs(args), "--dry_run"]) == 0
    return out.getvalue()


def load_tool(tool: str):
    """tools/TOOL.py as a module (loaded once), under its own name (tools_TOOL), so it cannot shadow a package."""
    import importlib.util

    name = f"tools_{tool}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{tool}.py")
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


def tool_in_process(tool: str, *args) -> subprocess.CompletedProcess:
    """`python tools/TOOL.py ARGS` run in this process: its main's return code and what it printed (a real
    process per tool proves the same exit codes reach the shell; the rest need no fresh interpreter)."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    main = load_tool(tool).main
    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    os.chdir(REPO)  # as the tools are run: from the repository root, ds_configs/ relative to it
    try:
        with redirect_stdout(out), redirect_stderr(err):
            code = main(argv)
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    finally:
        os.chdir(cwd)
    return subprocess.CompletedProcess([tool, *argv], code, out.getvalue(), err.getvalue())


# ---- the benchmarks' smoke runs (tests/integration/test_benchmark_*.py) -------------------------------
def benchmark(*args, timeout: int):
    """`python tools/benchmark.py ARGS`, as a user runs it."""
    return subprocess.run(
        [sys.executable, "tools/benchmark.py", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def run_quick(name: str, tmp_path, timeout: int):
    """`tools/benchmark.py NAME --quick` into tmp_path; it must succeed and leave one dated JSON report."""
    proc = benchmark(name, "--quick", "--out-dir", str(tmp_path), timeout=timeout)
    assert proc.returncode == 0, f"benchmark failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}"
    [report] = list(tmp_path.glob(f"{name}-*.json"))
    return report


# ---- storage faults: real filesystems, not a patched `open` --------------------------------------------
# mount(2) called directly (no `mount` process: the unit tier starts none), as root; CI runs as root.
MS_RDONLY, MS_REMOUNT, MS_BIND, MNT_DETACH = 1, 32, 4096, 2


def _mount(source, target: Path, fstype, flags: int, data) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    enc = lambda s: None if s is None else str(s).encode()  # noqa: E731
    if libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), str(target))


@contextmanager
def tmpfs(path: Path, size: str):
    """A real tmpfs of `size` (mount's units: 48M) mounted at `path` for the block, unmounted after. The test
    skips, saying why, where mounting is impossible (not root, no mount(2)): it never passes without one."""
    import ctypes

    import pytest

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    path.mkdir(parents=True, exist_ok=True)
    try:
        _mount("tmpfs", path, "tmpfs", 0, f"size={size}")
    except OSError as e:
        pytest.skip(f"cannot mount a tmpfs here: {e}")
    try:
        yield path
    finally:
        ctypes.CDLL(None).umount2(str(path).encode(), MNT_DETACH)


def resize(path: Path, size: str) -> None:
    """Grow or shrink the tmpfs at `path`, as a user frees space or moves to a larger disk."""
    _mount(None, path, None, MS_REMOUNT, f"size={size}")


def read_only(path: Path) -> None:
    """A read-only remount of the tmpfs at `path`: needs no file there open for writing."""
    _mount(None, path, None, MS_REMOUNT | MS_RDONLY, None)


def read_only_bind(path: Path) -> None:
    """`path` becomes read-only under a running process: a bind mount of it over itself, remounted read-only.
    Files the process holds open stay writable (they belong to the mount beneath), as after a remount that
    the kernel forces; every file opened from now on is refused with EROFS."""
    _mount(path, path, None, MS_BIND, None)
    _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY, None)


def fill(path: Path, leave: int = 0) -> Path:
    """Fill the filesystem at `path` until at most `leave` bytes are free; returns the filler file."""
    import shutil

    filler = path / "filler.bin"
    with open(filler, "wb") as f:
        try:
            while (free := shutil.disk_usage(path).free) > leave:
                f.write(b"\0" * max(4096, min(1 << 20, free - leave)))
                f.flush()
        except OSError:
            pass
    return filler
