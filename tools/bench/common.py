"""What every benchmark shares: the machine and versions for the report, ports, checked child processes."""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
from pathlib import Path

from zero_recipes.distributed.ports import free_port  # noqa: F401 -- one port policy for train.py, tests, benchmarks
from zero_recipes.training.device_peak import cpu_name

from . import host_load

REPO = Path(__file__).resolve().parent.parent.parent  # train.py, ds_configs/ and benchmarks/ are found here
TOOLS = REPO / "tools"  # where the `bench` package is imported from (the folder of tools/benchmark.py)


def quiet(*_a, **_k):
    pass


def environment() -> dict:
    """The versions and the machine for a report's footer. Versions are read from the installed packages'
    metadata, not by importing them: the GPU benchmark's parent process imports no DeepSpeed, datasets or TRL
    (its children do), and a package that is not installed is left out instead of failing the report."""
    import torch

    cpu = cpu_name()
    mem = next(
        int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal")
    )
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            **optional_versions("deepspeed", "transformers", "datasets", "tokenizers", "peft", "trl"),
        },
        "machine": {
            "cpu": cpu,
            "cores": os.cpu_count(),
            "cores_usable": len(os.sched_getaffinity(0)),
            "ram_gib": round(mem / 2**20, 1),
            "gpus": gpus,
        },
    }


def optional_versions(*names: str) -> dict:
    """Versions of the installed packages among `names`, from their metadata (nothing imported)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def yes(met: bool) -> str:
    return "yes" if met else "**no**"


def child_env(env: dict | None = None) -> dict:
    """env (default: this process's) with tools/ on PYTHONPATH, so that a child started as `-m bench.NAME`
    (`deepspeed --module bench.NAME`: the launcher passes PYTHONPATH to every rank) imports this package."""
    env = dict(os.environ if env is None else env)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths if str(TOOLS) in paths else [str(TOOLS), *paths])
    return env


def run_checked(cmd: list[str], env: dict | None, timeout: int, what: str) -> str:
    """Run from the repo root in its own process group (so a timeout also ends the deepspeed launcher's
    ranks), with env (default: this process's) and tools/ on PYTHONPATH (child_env); return stdout+stderr,
    or print the tail of the output and exit non-zero."""
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=child_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        fail(f"{what} timed out after {timeout}s", output)
    if proc.returncode != 0:
        fail(f"{what} failed (exit {proc.returncode})", output)
    return output


def fail(message: str, output: str) -> None:
    print(f"error: {message}\n---- last output ----\n{output[-4000:]}", file=sys.stderr)
    sys.exit(1)


def new_report(**fields) -> dict:
    """A report's header: today's date, the command that made it, the versions and the machine."""
    import datetime

    return {
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python", "tools/benchmark.py"] + sys.argv[1:]),
        **environment(),
        "host": host_load.summary(),  # what the rest of the machine did while this ran (None: not recorded)
        **fields,
    }


def write_report(out_dir: str, name: str, result: dict, markdown: str, say: bool = True) -> Path:
    """out_dir/name.json and out_dir/name.md, each written whole under a temporary name and renamed in (a report
    rewritten as a run goes is never seen half-written, even by a kill); returns the .md path."""
    from zero_recipes.checkpointing.atomic import write_text

    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / f"{name}.json", json.dumps(result, indent=2) + "\n")
    write_text(out / f"{name}.md", markdown)
    if say:
        print(f"wrote {out / name}.md and .json")
    return out / f"{name}.md"


def footer(r: dict) -> list[str]:
    """The machine and versions lines every report ends with."""
    m, v = r["machine"], r["versions"]
    return [
        f"- Machine: {m['cpu']}, {m['cores']} cores ({m['cores_usable']} usable), {m['ram_gib']} GiB RAM"
        + (f", GPUs: {', '.join(m['gpus'])}" if m["gpus"] else ", no GPU")
        + ".",
        "- Versions: " + ", ".join(f"{k} {x}" for k, x in v.items()) + ".",
        *filter(None, [host_load.footer_line(r.get("host"))]),
    ]


def embedded_tokenizer_dir() -> Path:
    """The embedded byte-level BPE (zero_recipes.data.builtin) in train.py's own cache (ZERO_RECIPES_CACHE, or
    ~/.cache/zero-recipes): built there once, as train.py builds it, and read back by every later benchmark and run,
    not parsed out of the standard library and retrained in a fresh directory each time (about 4 s)."""
    from zero_recipes import data
    from zero_recipes.config.train_config import TrainConfig

    return data.builtin_tokenizer_dir(TrainConfig())


def embedded_words(documents: int = 2000) -> list[str]:
    """The plain words (letters only, under 12) of the embedded corpus's first `documents` documents, sorted: what
    the SFT and DPO benchmarks write their conversations with. Read from train.py's cached corpus file, which holds
    zero_recipes.data.builtin.stdlib_docstrings() in its order, instead of parsing the standard library again."""
    from zero_recipes import data
    from zero_recipes.config.train_config import TrainConfig

    with data.builtin_corpus_file(TrainConfig()).open() as f:
        texts = [json.loads(line)["text"] for line, _ in zip(f, range(documents))]
    return sorted({w for d in texts for w in d.split() if w.isalpha() and len(w) < 12})


def seed_cache(cache: Path) -> Path:
    """A fresh ZERO_RECIPES_CACHE given the embedded corpus file and tokenizer (copied from train.py's own cache,
    embedded_tokenizer_dir), so a cold launch that uses it pays for its data and nothing else; returns `cache`."""
    from zero_recipes import data
    from zero_recipes.config.train_config import TrainConfig
    from zero_recipes.data.cache import cache_root

    tok, root = embedded_tokenizer_dir(), cache_root(TrainConfig())
    corpus = data.builtin_corpus_file(TrainConfig())
    cache.mkdir(parents=True, exist_ok=True)
    shutil.copy2(corpus, cache / corpus.relative_to(root))
    shutil.copytree(tok, cache / tok.relative_to(root), dirs_exist_ok=True)
    return cache


def spread(values: list[float]) -> dict:
    """Median, min, max and count of samples: how the LoRA, parallel and pipeline reports give a figure."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}
