"""The GPU benchmark's parts (tools/bench/gpu/benchmark.py runs them in order): each measures one thing on one
device and returns its figures, or raises; benchmark.py records a failure and goes on.

Every training run is train.py's own main(), one rank under torchrun, without its checkpoints (nothing here reads
one): tools/bench/runners/unsaved_train.py on a GPU, whose metrics.jsonl gives tokens/s, MFU and `mem_peak_gb`
(torch.cuda.max_memory_allocated); on the CPU (--quick) tools/bench/runners/profiled_train.py with
--no_checkpoints, whose allocator events give the peak (the CPU logs no device memory). The export is
train.py's as always. The estimate is tools/estimate_memory.py's for the same flags
(zero_recipes.memory.for_run, as train.py logs it on a GPU: GPU accounting there, the CPU accelerator's one
pool under --quick).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from zero_recipes.config.shipped import PRECISIONS, select

from .. import paired
from ..common import REPO, embedded_tokenizer_dir, free_port, run_checked
from ..lora.benchmark import VARIANTS as LORA_VARIANTS
from ..moe import benchmark as moe
from ..parallel.benchmark import model_fields
from ..sft import benchmark as sft

LLAMA_1B = {
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": True,
    "max_position_embeddings": 4096,
    "rope_theta": 500000.0,
}
# the SFT comparison's model on a GPU: a 0.25B Llama body on the embedded 4096-token vocabulary
SFT_MODEL = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 16}
SFT_MODEL |= {"num_attention_heads": 16, "num_key_value_heads": 8}
CONFIGS = select("zero2", "zero3")
SFT_RUNNERS = ("train.py", "TRL SFTTrainer")
# DPO at the 8B shape on one GPU: the 8B recipe one GPU trains without offload (LoRA r 16, ZeRO-2, bf16, 1 pair x 16
# accumulation a step), with --objective dpo; random init of the published config. Not recipes/llama-3.1-8b-dpo.yaml:
# a full fine-tune planned for 8 GPUs, whose model states alone are ~128 GB on one (its estimate's worst case on
# one H200 is 139.55 GiB, over the card)
DPO_RECIPES = ("recipes/llama-3.1-8b-lora-24gb.yaml",)
LLAMA_8B = "recipes/configs/llama-3.1-8b.json"

# dense: the model (None: the embedded tiny Llama); block, micro-batch, steps, logging window (the first left out)
FULL = dict(
    precision="bf16", dense=LLAMA_1B, block=2048, micro=4, steps=20, window=5, moe_model=moe.SIZES["gpu"]["model"],
    moe_block=moe.SIZES["gpu"]["block"], moe_micro=moe.SIZES["gpu"]["micro"], shape_steps=10,
    sft={**sft.FULL, "rounds": 1, "model": SFT_MODEL, "fragments": PRECISIONS["bf16"]},
    dpo=dict(model=LLAMA_8B, pairs=64, steps=4, window=2),
)  # fmt: skip
# threads (--quick only): every child's intra-op threads (OMP_NUM_THREADS). One rank on 2 cores otherwise takes both
# (launcher_env.set_threads), and the tiny shapes' small ops then wait on a second thread whenever another process
# holds the other core, as the test suite's other worker does: the shapes part's full-model step took 0.05 s with 1
# thread and 1.8 s with 2 beside a busy process (2-core EPYC). The figures are a busy CPU's either way.
QUICK = dict(
    precision="fp32", dense=None, block=64, micro=4, steps=3, window=1, moe_model=moe.TINY, moe_block=64,
    moe_micro=4, shape_steps=3,
    sft={**sft.QUICK, "conversations": 24, "block": 256, "longest": 230, "rounds": 1, "threads": 1},
    dpo=dict(model=None, pairs=8, steps=2, window=1, accumulation=2), threads=1,
)  # fmt: skip


def child_env(s: dict) -> dict | None:
    """The children's environment: this process's (None), or with s["threads"] intra-op threads (--quick)."""
    return {**os.environ, "OMP_NUM_THREADS": str(s["threads"])} if s.get("threads") else None


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def train_flags(s: dict, files: tuple[str, ...], model: dict | None, block: int, micro: int) -> list[str]:
    """train.py's flags for one rank: the ZeRO files and the precision's, the model, the shape, a short run."""
    out = ["--deepspeed", *files, *PRECISIONS[s["precision"]], "--block_size", str(block)]
    out += ["--per_device_train_batch_size", str(micro), "--max_steps", str(s["steps"])]
    out += ["--logging_steps", str(s["window"]), "--eval_steps", "0", "--save_steps", "0", "--max_eval_batches", "1"]
    out += ["--learning_rate", "3e-4", "--warmup_steps", "2", "--report_to", "none"]
    return out + (["--model_config", json.dumps(model)] if model else [])


def predicted(argv: list[str]) -> dict:
    """tools/estimate_memory.py's peak for the run these train.py flags make on one rank (for_run: what train.py
    itself logs on a GPU). On the CPU accelerator device and host are one pool: the worst phase's sum."""
    from zero_recipes import memory
    from zero_recipes.plan import RunPlan

    plan = RunPlan.from_args(argv)
    plan = plan.complete(plan.cfg.max_steps)
    e, line = memory.for_run(plan.model_config, plan.ds, plan.cfg, 1)
    if e is None:
        raise RuntimeError(line)
    if cuda():
        return {"estimate_bytes": e.per_gpu["peak_bytes"], "estimate_phase": e.per_gpu["peak_phase"]}
    phase = max(e.phases, key=lambda p: memory.rank_total(e, p))
    return {"estimate_bytes": memory.rank_total(e, phase), "estimate_phase": phase}


def train_run(name: str, argv: list[str], out: Path, timeout: int, skip: int = 1, env: dict | None = None) -> dict:
    """train.py with argv on one rank into `out`, in `env` (default: this process's): steady tokens/s and MFU (median
    over the logging windows after the first `skip`), the measured peak, the estimate and its error. Leaves `out`
    (the caller removes it)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", str(free_port())]
    probe = out.with_name(out.name + "-probe")
    gpu = cuda()
    cmd += (
        ["--module", "bench.runners.unsaved_train"]
        if gpu
        else ["--module", "bench.runners.profiled_train", "--no_checkpoints"]
    )
    cmd += argv + ["--output_dir", str(out)] + ([] if gpu else ["--probe_out", str(probe)])
    log = run_checked(cmd, env, timeout, f"{name}: {' '.join(cmd)}")
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in records if "tokens_per_sec" in r][skip:]
    if gpu:
        peak, source = max(r.get("mem_peak_gb", 0) for r in records) * 2**30, "torch.cuda.max_memory_allocated"
    else:
        peak, source = json.loads(Path(f"{probe}.rank0.json").read_text())["peak_bytes"], "allocator events"
    result = {
        "tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in steady),
        "mfu": statistics.median(r["mfu"] for r in steady),
        "windows": len(steady),
        "final_loss": steady[-1]["loss"],
        "peak_bytes": int(peak),
        "peak_source": source,
        "lora_line": next((x for x in log.splitlines() if x.startswith("lora:")), None),
        **predicted(argv),
    }
    result["estimate_error"] = result["estimate_bytes"] / result["peak_bytes"] - 1 if peak else None
    return result


def dense(s: dict, config: str, tmp: Path, timeout: int) -> dict:
    """The 1B Llama (the embedded tiny one under --quick) under one ZeRO stage. ZeRO-2's export is kept as the
    LoRA part's base (the LoRA part removes it)."""
    out = tmp / config
    argv = train_flags(s, CONFIGS[config], s["dense"], s["block"], s["micro"])
    try:
        return {"deepspeed": list(CONFIGS[config]), **train_run(config, argv, out, timeout, env=child_env(s))}
    finally:
        if config != "zero2":
            shutil.rmtree(out, ignore_errors=True)


def lora(s: dict, tmp: Path, timeout: int) -> dict:
    """LoRA r 16 on all-linear (lora/benchmark.py's variant) of the ZeRO-2 part's export, ZeRO-2, same shape and
    steps."""
    base = tmp / "zero2"
    if not (base / "config.json").exists():
        raise RuntimeError("no base: the ZeRO-2 part left no export")
    argv = train_flags(s, CONFIGS["zero2"], None, s["block"], s["micro"])
    argv += ["--model_name_or_path", str(base), *LORA_VARIANTS["lora"]]
    try:
        result = train_run("lora", argv, tmp / "lora", timeout, env=child_env(s))
        return {"base": "the ZeRO-2 part's export", **result}
    finally:
        shutil.rmtree(tmp / "lora", ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)  # 2.5 GB of bf16 on the device's disk: nothing else reads it


def mixture(s: dict, tmp: Path, timeout: int) -> dict:
    """moe/benchmark.py's Mixtral (its GPU size; its tiny one under --quick) under ZeRO-2 on one rank: no expert
    parallelism, every expert on the device. MFU counts active FLOPs (k experts per token)."""
    argv = train_flags(s, CONFIGS["zero2"], s["moe_model"], s["moe_block"], s["moe_micro"])
    try:
        result = train_run("moe", argv, tmp / "moe", timeout, env=child_env(s))
    finally:
        shutil.rmtree(tmp / "moe", ignore_errors=True)
    return {"model": s["moe_model"], "parameters": moe.parameters(s["moe_model"]), **result}


def shapes(s: dict, tmp: Path, timeout: int) -> dict:
    """TP2's, SP2's and PP2's per-rank compute at their split shapes, in one process (bench/gpu/shapes.py)."""
    spec = {"model": model_fields(s["dense"]), "block": s["block"], "micro": s["micro"]}
    spec |= {"steps": s["shape_steps"], "precision": s["precision"]}
    out = tmp / "shapes.json"
    run_checked([sys.executable, "-m", "bench.gpu.shapes", json.dumps(spec), str(out)], child_env(s), timeout, "shapes")
    result = json.loads(out.read_text())
    full = result["shapes"]["full model"]["step_seconds"]
    for x in result["shapes"].values():
        x["step_vs_full"] = x["step_seconds"] / full
    return result


def sft_vs_trl(s: dict, tmp: Path, timeout: int) -> dict:
    """One round of sft/benchmark.py's train.py and TRL runners on one rank: label tokens/s, and train.py / TRL
    paired by window (paired.py) within the round."""
    import time

    settings = s["sft"]
    deadline = time.monotonic() + timeout
    (tmp / "sft").mkdir()
    work = sft.make_work(tmp / "sft", settings)
    runs = {}
    for runner in SFT_RUNNERS:
        left = max(1, int(deadline - time.monotonic()))
        runs[runner] = sft.run_one(runner, settings, work, tmp / "sft", "r0", ranks=1, timeout=left)
        print(f"    {runner}: {sft.line(runs[runner])}", flush=True)
    runners = {
        name: {
            "label_tokens_per_sec": statistics.median(r["label_rates"]),
            "real_tokens_per_sec": statistics.median(r["real_rates"]),
            "padding_share": r["padding_share"],
            "steps": r["steps"],
            "trained_tokens": r["trained"],
            "time_to_first_step": r["time_to_first_step"],
            "eval_loss": r["eval_loss"],
        }
        for name, r in runs.items()
    }
    label = [{name: r["label_rates"] for name, r in runs.items()}]
    ratio = paired.ratio(label, *SFT_RUNNERS)
    model = "embedded tiny Llama" + (f" with {json.dumps(settings['model'])}" if settings.get("model") else "")
    return {"model": model, "settings": settings, "data_tokens": work["tokens"], "runners": runners, "vs_trl": ratio}


def dpo_recipe() -> Path:
    return next(REPO / r for r in DPO_RECIPES if (REPO / r).exists())


# a recipe's keys about its hub dataset (a split of it, its format) or about SFT rows: the local pairs file has none
HUB_DATA_KEYS = ("dataset_config_name", "dataset_split", "eval_split", "dataset_format", "packing", "train_on_prompt")


def local_recipe(recipe: Path, out: Path) -> Path:
    """The recipe without HUB_DATA_KEYS (train.py's CLI can set a key, not unset one), written to `out`."""
    import yaml

    keys = yaml.safe_load(recipe.read_text())
    out.write_text(yaml.safe_dump({k: v for k, v in keys.items() if k not in HUB_DATA_KEYS}, sort_keys=False))
    return out


def dpo_8b(s: dict, tmp: Path, timeout: int) -> dict:
    """train.py's DPO at the 8B shape on one rank: the recipe (dpo_recipe) on a base directory of the published
    config's shape (random init on the device, bf16, saved: no hub here, and a LoRA recipe needs a base to load),
    the embedded tokenizer and generated pairs (bench/dpo/data.py: prompts of 100-300 tokens, answers of 50-200),
    a short run. Pairs/s from bench/dpo's probe (each micro-batch's pairs and start; the reference pass is
    before them), tokens/s and MFU from metrics.jsonl, the peak (`mem_peak_gb` on a GPU; the CPU's RSS under
    --quick), the reference pass's seconds from train.py's log. --quick: the embedded tiny Llama, fp32, zero2.json."""
    from zero_recipes import data as zr_data
    from zero_recipes.config.train_config import TrainConfig
    from zero_recipes.data import formats

    from ..dpo import benchmark as dpo_bench, data as dpo_data

    d, gpu = s["dpo"], cuda()
    work = tmp / "dpo"
    work.mkdir()
    try:
        tok_dir = embedded_tokenizer_dir()
        tok = zr_data.load_tokenizer(TrainConfig(tokenizer_name_or_path=str(tok_dir)))
        formats.ensure_chat_template(tok, lambda *a: None)
        words, per_word = dpo_data.words_and_rate(tok)
        rows = dpo_data.realistic_pairs(d["pairs"], words, per_word, seed=0)
        pairs = dpo_data.write_jsonl(rows, work / "pairs.jsonl")
        fields = json.loads((REPO / d["model"]).read_text()) if d["model"] else {"max_position_embeddings": 2048}
        started = time.monotonic()
        base = dpo_data.base_model(work / "base", tok, fields, dtype="bfloat16" if gpu else "float32",
                                   device="cuda" if gpu else "cpu")  # fmt: skip
        base_seconds = time.monotonic() - started
        recipe = dpo_recipe()
        argv = ["--recipe", str(local_recipe(recipe, work / "recipe.yaml")), "--objective", "dpo",
                "--model_name_or_path", str(base), "--dataset_name", str(pairs), "--validation_split_percentage", "0",
                "--max_steps", str(d["steps"]), "--logging_steps", str(d["window"]), "--eval_steps", "0",
                "--save_steps", "0", "--report_to", "none"]  # fmt: skip
        if not gpu:
            argv += ["--deepspeed", *CONFIGS["zero2"], *PRECISIONS[s["precision"]]]
        if d.get("accumulation"):  # --quick: fewer micro-batches a step than the recipe's
            argv += ["--gradient_accumulation_steps", str(d["accumulation"])]
        out, probe = work / "run", work / "probe"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "1",
            "--master_port",
            str(free_port()),
        ]
        cmd += ["--module", "bench.dpo.train_run", *argv, "--output_dir", str(out), "--probe_out", str(probe)]
        log = run_checked(cmd, child_env(s), timeout, f"dpo 8B: {' '.join(cmd)}")
        records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        p = json.loads(Path(f"{probe}.rank0.json").read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)  # 16 GB of bf16 base on the device's disk
    logged = [r for r in records if "tokens_per_sec" in r]
    steady = logged[1:] or logged
    per_step = len(p["starts"]) // d["steps"]  # forwards (micro-batches) a step; the last step has no end stamp
    ends = [k * per_step for k in range(d["steps"])]
    rates = [sum(t[0] for t in p["tokens"][a:b]) / (p["starts"][b] - p["starts"][a]) for a, b in zip(ends, ends[1:])]
    rates = rates[1:] or rates  # the first step's warm-up left out when there are others
    ref = dpo_bench.REFERENCE_LINE.search(log)
    if not ref:
        raise RuntimeError(f"train.py logged no reference pass:\n{log[-2000:]}")
    peak = max(r.get("mem_peak_gb", 0) for r in records) * 2**30 if gpu else p["max_rss_bytes"]
    return {
        "recipe": str(recipe.relative_to(REPO)),
        "model": d["model"] or "embedded tiny Llama",
        "pairs": d["pairs"],
        "steps": d["steps"],
        "pairs_per_step": sum(t[0] for t in p["tokens"]) // d["steps"],
        "pairs_per_sec": statistics.median(rates),
        "tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in steady),
        "mfu": statistics.median(r["mfu"] for r in steady),
        "peak_bytes": int(peak),
        "peak_source": "torch.cuda.max_memory_allocated" if gpu else "peak RSS (the CPU)",
        "reference_pairs": int(ref[1]),
        "reference_seconds": float(ref[3]),
        "base_seconds": base_seconds,
        "time_to_first_step": p["time_to_first_step"],
        "final_loss": steady[-1]["loss"],
    }
