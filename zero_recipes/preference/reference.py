"""The reference model's log-probs, computed once, by the run's own engine, and kept.

DPO compares the policy with a frozen reference: the model as the run starts (for LoRA, the base with a zero
adapter, which is what the model is before the first step). TRL keeps a second model (a second DeepSpeed engine
under ZeRO-3) and runs it on every step, or precomputes with a separate pass on every run. Here, before the first
step, the engine itself runs over every pair once (ZeRO-3 gathers, TP, EP as the run is configured), in eval mode
and without gradients, and the summed log-probs of both answers are stored with the prepared data, keyed by what
the reference is (the model's identity and precision, the pairs). No second copy of the weights exists at any
time; a relaunch, a resume or another run on the same pairs and model reads the file instead of recomputing.

A resume must read it: the trained weights are no longer the reference.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from zero_recipes import data
from zero_recipes.checkpointing.atomic import staged
from zero_recipes.data.cache import digest
from zero_recipes.errors import ConfigError

SPLITS = ("train", "eval")


WEIGHTS = (".safetensors", ".bin")
CONFIGS = ("config.json", "adapter_config.json")
"""What a model directory's reference is made of (a run directory also holds logs and run records, which a
relaunch rewrites without changing the model)."""


def identity(cfg, precision: str) -> dict:
    """What the reference is, without its weights: the pretrained files (names, sizes, modification times) or
    the random init's config and seed, the precision and a 4-bit base. Reading every weight would cost as much
    as the pass it saves."""
    out = {"precision": precision, "load_in_4bit": cfg.load_in_4bit}
    path = cfg.model_name_or_path
    if path and Path(path).is_dir():
        files = sorted(p for p in Path(path).iterdir() if p.suffix in WEIGHTS or p.name in CONFIGS)
        out["model"] = str(Path(path).resolve())
        out["files"] = [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]
    else:
        out["model"] = path  # a hub id: its cached snapshot is what from_pretrained reads
        out["model_config"] = cfg.model_config
        out["seed"] = cfg.seed if path is None else None
    return out


def cache_path(cfg, prepared, precision: str) -> tuple[Path, dict]:
    """Where this run's reference log-probs live, and what the file must say it holds."""
    meta = {"reference": identity(cfg, precision), "pairs": prepared.key,
            "counts": [len(getattr(prepared, s) or ()) for s in SPLITS]}  # fmt: skip
    meta = json.loads(json.dumps(meta))  # as the file will give it back (tuples become lists)
    if cfg.reference_cache:
        return Path(cfg.reference_cache), meta
    return prepared.entry / f"reference-{digest(meta)}.npz", meta


def load(path: Path, meta: dict) -> dict | None:
    """The stored log-probs, or None when there are none; a file made for another model or data is refused."""
    if not path.exists():
        return None
    with np.load(path) as f:
        stored = json.loads(str(f["meta"]))
        if stored != meta:
            what = "model" if stored.get("reference") != meta["reference"] else "data"
            raise ConfigError(
                f"--reference_cache {path} holds the reference log-probs of another {what} ({short(stored, what)}, "
                f"this run: {short(meta, what)}); point --reference_cache at a new file or delete that one"
            )
        return {s: torch.from_numpy(np.array(f[s])) for s in SPLITS}


def check_given_file(cfg, precision: str) -> None:
    """A --reference_cache that exists and holds another model's log-probs, refused before anything starts (the
    data's part of its record is checked once the pairs are prepared, in `load`)."""
    if not cfg.reference_cache or not Path(cfg.reference_cache).is_file():
        return
    with np.load(cfg.reference_cache) as f:
        stored = json.loads(str(f["meta"]))
    meta = json.loads(json.dumps({"reference": identity(cfg, precision)}))
    if stored.get("reference") != meta["reference"]:
        raise ConfigError(
            f"--reference_cache {cfg.reference_cache} holds the reference log-probs of another model "
            f"({short(stored, 'model')}, this run: {short(meta, 'model')}); point --reference_cache at a new file or "
            "delete that one"
        )


def short(meta: dict, what: str) -> str:
    if what == "model":
        ref = meta.get("reference", {})
        model = ref.get("model") or f"a random init (seed {ref.get('seed')})"
        weights = sum(size for name, size, _ in ref.get("files", []) if name.endswith(WEIGHTS))
        return f"{model}, {ref.get('precision')}" + (
            f", weights of {weights} bytes saved at their times" if weights else ""
        )
    return f"pairs {meta.get('pairs')}, {meta.get('counts')}"


def prepare(runner, plan, rank: int, resumed: bool, log) -> None:
    """Give `runner` its reference log-probs: read them, or (a fresh run) compute and store them."""
    cfg, prepared = plan.cfg, runner.prepared
    path, meta = cache_path(cfg, prepared, plan.precision)
    stored = load(path, meta)
    if stored is not None:
        runner.reference = stored
        log(f"reference: log-probs of {len(prepared.train)} pairs read from {path}")
        return
    if resumed:
        raise ConfigError(
            f"the reference log-probs this run started from ({path}) are gone, and the trained weights are no longer "
            "the reference; restore the file (or --reference_cache), or start the run over with --overwrite_output_dir"
        )
    start = time.perf_counter()
    runner.reference = {s: compute(runner, getattr(prepared, s), plan, rank) for s in SPLITS}
    seconds = time.perf_counter() - start
    if rank == 0:
        with staged(path) as tmp:
            with open(tmp, "wb") as f:
                np.savez(f, meta=json.dumps(meta), **{s: runner.reference[s].numpy() for s in SPLITS})
    torch.distributed.barrier()
    log(f"reference: log-probs of {len(prepared.train)} + {len(prepared.eval or ())} pairs in {seconds:.1f} s, "
        f"by this run's engine, once; stored at {path}")  # fmt: skip


def compute(runner, rows, plan, rank: int) -> torch.Tensor:
    """Every pair's summed log-probs under the model as it is now, [n, 2] float64 on the host. Each data-parallel
    replica takes every dp-th micro-batch (the ranks of a TP group the same ones); all run the same number of
    forwards; the results meet in one all-reduce (max over -inf: a pair computed by a TP group's ranks twice is
    the same value)."""
    n = len(rows) if rows is not None else 0
    out = torch.full((n, 2), -torch.inf, dtype=torch.float64)
    if n == 0:
        return out
    micro, engine = plan.cfg.per_device_train_batch_size, runner.engine
    engine.eval()
    with torch.no_grad():
        batches = data.eval_batches(rows, micro, plan.mesh.dp_rank(rank), plan.mesh.dp, 0, runner.prepared.pad_id)
        for batch, weight in batches:
            batch = runner.micro_batch(batch)
            logps, _ = runner.answer_logps(batch)
            real = weight.bool()  # padding pairs repeat real ones: not stored twice
            out[batch["pair_index"].cpu()[real]] = logps[real.to(logps.device)].double().cpu()
    engine.train()
    total = out.to(engine.device)
    torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.MAX)
    return total.cpu()
