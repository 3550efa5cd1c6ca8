"""What DeepSpeed would accept and then not do, and what this machine cannot run: refused before any process group.

- `refuse_ignored`: combinations DeepSpeed 0.19.8 accepts and silently ignores (offload_param below ZeRO-3, ZeRO++
  below ZeRO-3, ...), modes train.py cannot lay its data out for yet, removed optimizers, misspelt top-level keys.
- `machine_problems`: the precision's kernels, NVMe offload's async_io op and directory, and the GPU-only knobs
  (ds/gpu_only.py; `refuse_gpu_only` raises those, for --dry_run, which only warns of the rest).
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from zero_recipes.ds import gpu_only
from zero_recipes.ds.facts import offloads, precision, zero_stage
from zero_recipes.ds.schema import block_models
from zero_recipes.errors import ConfigError

# DeepSpeed 0.19.8 removed these optimizers without a message (runtime/engine.py `_configure_basic_optimizer`
# falls through to getattr(torch.optim, name) and raises AttributeError); named here so the line can say so.
REMOVED_OPTIMIZERS = {"onebitadam": "1-bit Adam", "zerooneadam": "0/1 Adam", "onebitlamb": "1-bit LAMB"}


def refuse_ignored(ds: dict) -> list[str]:
    """Raise for settings DeepSpeed would accept and then not honour at this ZeRO stage (the user would train
    believing they are on); return notes for the ignored tuning knobs that change nothing but speed."""

    z = ds.get("zero_optimization") or {}
    stage = zero_stage(ds)
    offload_optimizer, offload_param = offloads(ds)
    if offload_param and stage != 3:
        raise ConfigError(
            f"offload_param needs ZeRO-3; at ZeRO-{stage} DeepSpeed ignores it and offloads nothing. Use "
            "ds_configs/zero3.json with ds_configs/offload_all.json, or ds_configs/offload_optimizer.json for ZeRO-1/2"
        )
    if offload_optimizer and stage == 0:
        raise ConfigError(
            "offload_optimizer needs ZeRO-1, 2 or 3; at ZeRO-0 DeepSpeed ignores it. Use ds_configs/zero2.json "
            "with ds_configs/offload_optimizer.json"
        )
    zeropp = [
        k
        for k in ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients")
        if z.get(k)
    ]
    zeropp += ["zero_hpz_partition_size"] if int(z.get("zero_hpz_partition_size", 1) or 1) > 1 else []
    if zeropp and stage != 3:
        raise ConfigError(
            f"ZeRO++ ({', '.join(zeropp)}) works only with ZeRO-3; at ZeRO-{stage} DeepSpeed ignores it. "
            "Remove those keys or use ds_configs/zero3.json"
        )
    _refuse_forbidden_pairs(ds, z, stage)
    _refuse_unknown_optimizer(ds)
    return _unknown_top_level(ds) + _ignored_knobs(z, stage) + _ignored_blocks(ds)


def _refuse_forbidden_pairs(ds: dict, z: dict, stage: int) -> None:
    """Pairs DeepSpeed 0.19.8 asserts against inside deepspeed.initialize, on every rank, after the model is built."""
    hpz = int(z.get("zero_hpz_partition_size", 1) or 1)
    autoep = isinstance(ds.get("expert_parallel"), dict) and ds["expert_parallel"].get("enabled") is True
    if autoep and stage == 3 and (z.get("zero_quantized_gradients") or hpz > 1):
        # runtime/engine.py `_validate_zero3_moe_compatibility`: "AutoEP with ZeRO Stage 3 does not support
        # zero_quantized_gradients yet" / "... hpZeRO secondary tensor groups yet"
        what = (
            "zero_quantized_gradients (qgZ)"
            if z.get("zero_quantized_gradients")
            else f"zero_hpz_partition_size = {hpz} (hpZ)"
        )
        raise ConfigError(
            f"expert_parallel (AutoEP) with ZeRO-3 and {what}: DeepSpeed 0.19.8 does not support the pair yet and "
            "stops at start-up; drop that ZeRO++ key, or use ds_configs/zero2.json with the ep fragment"
        )
    opt = ds.get("optimizer")
    muon = isinstance(opt, dict) and str(opt.get("type", "")).lower() == "muon"
    if muon and z.get("zero_quantized_gradients"):
        # runtime/zero/stage3.py DeepSpeedZeroOptimizer_Stage3.__init__: qgZ's all-to-all group raises "Muon and
        # all2all process group cannot be used together" (and qgZ asserts the reduce_scatter Muon must turn off)
        raise ConfigError(
            'zero_quantized_gradients (qgZ) with the Muon optimizer: DeepSpeed 0.19.8 refuses the pair ("Muon and '
            'all2all process group cannot be used together"); drop zero_quantized_gradients, or use AdamW'
        )


def _refuse_unknown_optimizer(ds: dict) -> None:
    opt = ds.get("optimizer")
    if not isinstance(opt, dict) or "type" not in opt:
        return
    import torch
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    name = str(opt["type"])
    if name.lower() in REMOVED_OPTIMIZERS:
        raise ConfigError(
            f"optimizer.type = {name!r}: {REMOVED_OPTIMIZERS[name.lower()]} was removed from DeepSpeed 0.19; use "
            '"AdamW" (or delete the "optimizer" block: train.py then builds torch AdamW as the HF Trainer does)'
        )
    if name.lower() not in DEEPSPEED_OPTIMIZERS and not hasattr(torch.optim, name):
        choices = sorted({o.capitalize() for o in DEEPSPEED_OPTIMIZERS} | {"AdamW", "SGD"})
        raise ConfigError(
            f"optimizer.type = {name!r} is neither a DeepSpeed optimizer ({', '.join(choices)}) nor in torch.optim; "
            'use "AdamW", or delete the "optimizer" block'
        )


# Top-level keys DeepSpeed has no constant for (read as literals in runtime/config.py or by HF/accelerate).
_LITERAL_TOP_LEVEL = {"pipeline", "tensor_parallel", "sequence_parallel_size", "weight_quantization", "compile"}
_CONSTANT_MODULES = (
    "deepspeed.runtime.constants",
    "deepspeed.runtime.activation_checkpointing.config",
    "deepspeed.profiling.constants",
    "deepspeed.autotuning.constants",
    "deepspeed.runtime.swap_tensor.constants",
    "deepspeed.runtime.data_pipeline.constants",
    "deepspeed.utils.config",
    "deepspeed.runtime.zero.config",
    "deepspeed.runtime.config",
    "deepspeed.comm.constants",
)


def known_top_level() -> set[str]:
    """Every name DeepSpeed's config modules define as a constant, plus the blocks read through models. A
    superset of the top-level keys (it holds nested names too): enough to tell a typo from an unknown key."""
    import importlib

    known = set(block_models()) | _LITERAL_TOP_LEVEL
    for name in _CONSTANT_MODULES:
        module = importlib.import_module(name)
        known |= {v for k, v in vars(module).items() if k.isupper() and isinstance(v, str) and v.isidentifier()}
    return known


def _unknown_top_level(ds: dict) -> list[str]:
    """A key one letter off a DeepSpeed key is a typo that would silently drop the whole block (a misspelt
    "zero_optimization" trains at ZeRO-0): refused. Other unknown keys (other tools' own blocks) are noted."""
    known = known_top_level()
    notes = []
    for key in ds:
        if key in known or key.startswith("_"):  # "_comment" keys are a common JSON idiom
            continue
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.85)
        if close:
            raise ConfigError(
                f"the DeepSpeed config's top-level key '{key}' is not one DeepSpeed reads; did you mean '{close[0]}'?"
            )
        notes.append(f"top-level key '{key}' is not read by DeepSpeed; ignored")
    return notes


# Which ZeRO optimizer reads which knob: runtime/engine.py `_configure_zero_optimizer` passes these to
# DeepSpeedZeroOptimizer (stages 1-2) only; DeepSpeedZeroOptimizer_Stage3 and zero.Init take the stage3_* ones,
# sub_group_size and the persistence thresholds. DeepSpeed has no table of this; it is read off those calls.
STAGE12_ONLY = (
    "round_robin_gradients",
    "allgather_bucket_size",
    "use_multi_rank_bucket_allreduce",
    "ignore_unused_parameters",
    "parameter_alignment",
    "legacy_stage1",
)


def _ignored_knobs(z: dict, stage: int) -> list[str]:
    """Keys set to something other than DeepSpeed's default that the chosen stage never reads: a note each
    (they change nothing, and a user tuning them should know)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    fields = {f.alias or name: f for name, f in DeepSpeedZeroConfig.model_fields.items()}
    stage3_only = {k for k in fields if k.startswith("stage3_")} | {"sub_group_size"}
    if stage == 0:
        readers = {k: "ZeRO-1/2/3" for k in z if k != "stage" and k in fields}
    elif stage == 3:
        readers = {k: "ZeRO-1/2" for k in STAGE12_ONLY}
    else:
        readers = {k: "ZeRO-3" for k in stage3_only}
    return [
        f"zero_optimization.{k} is read only at {readers[k]}; ignored at ZeRO-{stage}"
        for k in sorted(z)
        if k in readers and z[k] != fields[k].default
    ]


def _ignored_blocks(ds: dict) -> list[str]:
    ac = ds.get("activation_checkpointing") or {}
    if any(ac.get(k) for k in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization")):
        return [
            "activation_checkpointing is DeepSpeed's own checkpointing API, which Hugging Face models do not call; "
            "it is ignored here as in the HF Trainer. Use --gradient_checkpointing true"
        ]
    return []


# ---- this machine -------------------------------------------------------------------------------------------


def machine_problems(ds: dict, tf32: bool | None = None) -> list[str]:
    """What this machine cannot run with a resolved config, found before any process group or model: the
    precision's kernels, TF32, and NVMe offload's async_io op and directory."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    capability = cuda_capability(acc.device_name())
    bf16_ok = native_bf16(acc.is_bf16_supported(), capability)
    problems = gpu_only.machine_problems(ds, acc.device_name(), fused_lion(acc))
    problems += precision_problems(precision(ds), acc.device_name(), acc.is_fp16_supported(), bf16_ok)
    problems += tf32_problems(tf32, acc.device_name(), capability)
    z = ds.get("zero_optimization") or {}
    nvme = [z[k] for k in ("offload_optimizer", "offload_param") if (z.get(k) or {}).get("device") == "nvme"]
    if nvme:
        builder = acc.create_op_builder("AsyncIOBuilder")
        if builder is None or not builder.is_compatible(verbose=False):
            problems.append(
                "NVMe offload needs DeepSpeed's async_io op, which cannot be built here: install libaio "
                "(apt install libaio-dev) and run python tools/build_ops.py, or offload to cpu (ds_configs/offload_all.json)"
            )
        for path in sorted({str(block.get("nvme_path")) for block in nvme}):
            problems += path_problems(path)
    return problems


def refuse_gpu_only(ds: dict) -> None:
    """Raise, in one line, for the GPU-only knobs (and Lion without offload) this machine cannot run: --dry_run
    refuses these, where it only warns of a missing NVMe directory or kernel (ds/gpu_only.py)."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if problems := gpu_only.machine_problems(ds, acc.device_name(), fused_lion(acc)):
        raise ConfigError("; ".join(problems))


def fused_lion(acc) -> bool:
    """Whether this accelerator has DeepSpeed's FusedLion op (the CPU accelerator maps FusedLionBuilder to its
    NotImplementedBuilder, which still says is_compatible)."""
    builder = acc.create_op_builder("FusedLionBuilder")
    return builder is not None and type(builder).__name__ != "NotImplementedBuilder" and builder.is_compatible(False)


def precision_problems(precision: str, device: str, fp16_ok: bool, bf16_ok: bool) -> list[str]:
    if precision == "fp16" and not fp16_ok:
        return [
            f"this {device} has no fp16 support in DeepSpeed; use ds_configs/bf16.json, or fp32 (no precision fragment)"
        ]
    if precision == "bf16" and not bf16_ok:
        return [
            f"this {device} has no bf16 support (NVIDIA GPUs need compute capability 8.0, A100 or newer); use "
            "ds_configs/fp16.json, or fp32 (no precision fragment)"
        ]
    return []


def cuda_capability(device: str) -> tuple[int, int] | None:
    """The GPU's compute capability, None off CUDA."""
    import torch

    return torch.cuda.get_device_capability() if device == "cuda" and torch.cuda.is_available() else None


def native_bf16(accelerator_says: bool, capability: tuple[int, int] | None) -> bool:
    """bf16 the hardware computes. torch.cuda.is_bf16_supported() (which DeepSpeed asks) also counts a V100's or
    T4's emulation, which runs bf16 matmuls many times slower than fp16: NVIDIA's bf16 tensor cores start at
    compute capability 8.0 (A100)."""
    return accelerator_says and (capability is None or capability >= (8, 0))


def tf32_problems(tf32: bool | None, device: str, capability: tuple[int, int] | None) -> list[str]:
    """--tf32 true asks for Ampere's tensor-core fp32, as the HF Trainer refuses it elsewhere."""
    if not tf32 or (capability is not None and capability >= (8, 0)):
        return []
    where = f"compute capability {capability[0]}.{capability[1]}" if capability else f"a {device}, not an NVIDIA GPU"
    return [f"--tf32 needs an NVIDIA GPU of compute capability 8.0 or newer (A100, H100); this is {where}: drop --tf32"]


def path_problems(nvme_path: str) -> list[str]:
    p = Path(nvme_path)
    if not p.exists():
        return [f"nvme_path {nvme_path} does not exist; create it on the NVMe drive (mkdir -p {nvme_path})"]
    if not p.is_dir():
        return [f"nvme_path {nvme_path} is not a directory; give a directory on the NVMe drive (--nvme_path)"]
    if not os.access(p, os.W_OK | os.X_OK):
        return [f"nvme_path {nvme_path} is not writable by this user; give a directory you can write to (--nvme_path)"]
    return []
