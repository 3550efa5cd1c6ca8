"""The shipped DeepSpeed config combinations, named once: the fragments of ds_configs/ to pass to --deepspeed
for each ZeRO stage and offload, and for each precision. The tests, tools/estimate_memory.py's --table and the
benchmarks each take the names they need from here, so a file added or renamed in ds_configs/ is changed here
alone. Paths are relative to the repository root, as train.py takes them."""

from __future__ import annotations

COMBINATIONS: dict[str, tuple[str, ...]] = {
    "zero0": ("ds_configs/zero0.json",),
    "zero1": ("ds_configs/zero1.json",),
    "zero2": ("ds_configs/zero2.json",),
    "zero3": ("ds_configs/zero3.json",),
    "zero2+offload_optimizer": ("ds_configs/zero2.json", "ds_configs/offload_optimizer.json"),
    "zero3+offload_optimizer": ("ds_configs/zero3.json", "ds_configs/offload_optimizer.json"),
    "zero3+offload_all": ("ds_configs/zero3.json", "ds_configs/offload_all.json"),
    "zero3+nvme": ("ds_configs/zero3.json", "ds_configs/nvme.json"),
}
"""ZeRO stage and offload: the fragments, in the order they merge."""

TENSOR_PARALLEL: dict[int, str] = {n: f"ds_configs/tp{n}.json" for n in (2, 4, 8)}
"""AutoTP fragments by degree, added after a ZeRO combination: `ds_configs/zero1.json ds_configs/tp2.json`."""

SEQUENCE_PARALLEL: dict[int, str] = {n: f"ds_configs/sp{n}.json" for n in (2, 4, 8)}
"""Ulysses fragments by degree, added after a ZeRO-1/2/3 combination: `ds_configs/zero3.json ds_configs/sp2.json`."""

PIPELINE_PARALLEL: dict[int, str] = {n: f"ds_configs/pp{n}.json" for n in (2, 4, 8)}
"""Pipeline fragments by stage count, added after ZeRO-0 or ZeRO-1: `ds_configs/zero1.json ds_configs/pp2.json`."""

EXPERT_PARALLEL: dict[int, str] = {n: f"ds_configs/ep{n}.json" for n in (2, 4, 8)}
"""AutoEP fragments by degree, added after any ZeRO combination: `ds_configs/zero2.json ds_configs/ep2.json`."""

PRECISIONS: dict[str, tuple[str, ...]] = {"fp32": (), "bf16": ("ds_configs/bf16.json",)}
"""Fragments added for a precision (fp32 is the default: none)."""


def select(*names: str) -> dict[str, tuple[str, ...]]:
    """The named combinations, in the order asked for."""
    return {name: COMBINATIONS[name] for name in names}


ARCHITECTURES: dict[str, str] = {
    "openai-community/gpt2": "recipes/configs/gpt2.json",
    "HuggingFaceTB/SmolLM2-135M": "recipes/configs/smollm2-135m.json",
    "meta-llama/Llama-3.2-1B": "recipes/configs/llama-3.2-1b.json",
    "meta-llama/Llama-3.2-3B": "recipes/configs/llama-3.2-3b.json",
    "meta-llama/Llama-3.1-8B": "recipes/configs/llama-3.1-8b.json",
    "meta-llama/Llama-3.1-70B": "recipes/configs/llama-3.1-70b.json",
    "mistralai/Mistral-7B-v0.3": "recipes/configs/mistral-7b-v0.3.json",
    "mistralai/Mixtral-8x7B-v0.1": "recipes/configs/mixtral-8x7b-v0.1.json",
    "Qwen/Qwen2.5-7B": "recipes/configs/qwen2.5-7b.json",
    "Qwen/Qwen3-30B-A3B": "recipes/configs/qwen3-30b-a3b.json",
}
"""Hub model id -> its published config.json, copied into recipes/configs/: what `--dry_run` plans with when the
hub cannot be reached and the config is not in the local cache (a real run always loads from_pretrained(id)).
The recipes that train these models name the same file in their '# Memory:' command."""


def architecture_file(model_id: str):
    """The shipped config.json of a hub model id (an absolute Path, wherever train.py is run from), or None."""
    from pathlib import Path

    rel = ARCHITECTURES.get(model_id)
    return Path(__file__).resolve().parents[2] / rel if rel else None
