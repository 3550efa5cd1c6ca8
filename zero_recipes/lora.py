"""LoRA with peft on every ZeRO stage: the options, wrapping the base, and what a LoRA run leaves behind.

peft does the adapters (LoraConfig, get_peft_model, PeftModel.from_pretrained, merge_and_unload); what it
lacks under DeepSpeed is written here: ZeRO-3 partitions every parameter, and `PeftModel.save_pretrained`
then writes the partitions' placeholders, an *empty* adapter (trl #4416, peft #2892, DeepSpeed #7900). The
adapter is gathered first, one tensor at a time, and handed to peft's own saving code.

The frozen base is not copied for training: its parameters get no gradient and are in no optimizer group,
so DeepSpeed keeps neither a fp32 master copy nor Adam moments for them, and under bf16/fp16 they stay in 16
bits. Checkpoints leave them out (DeepSpeed's `exclude_frozen_parameters`): they are the pretrained weights,
which the adapter's `base_model_name_or_path` names.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from .config import ConfigError, TrainConfig
from .model import gathered_parameters, num_params

ALL_LINEAR = "all-linear"
QLORA_CPU_BLOCK = 64
"""On a CPU, bitsandbytes 0.50's 4-bit matmul repacks each weight in blocks of 64 input features; a layer with
another width fails inside the forward with a shape error (measured: 352 = 5.5 x 64)."""

# bitsandbytes, which peft imports when it is installed, warns at import on CPUs with AVX512-BF16 that an
# optional hub kernel is missing; its built-in fallback is what runs. Once per rank per launch, not actionable.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

# A recipe's `lora:` block, in peft's LoraConfig names, and the options each key sets.
LORA_BLOCK = {
    "r": "lora_r",
    "alpha": "lora_alpha",
    "dropout": "lora_dropout",
    "target_modules": "lora_target_modules",
    "modules_to_save": "modules_to_save",
}
SETTINGS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "modules_to_save")
"""What makes one adapter: a checkpoint resumes only with the same values."""


def enabled(cfg: TrainConfig) -> bool:
    return cfg.lora_r > 0


def enabled_on(module) -> bool:
    """The engine's module is a peft model."""
    return hasattr(module, "peft_config")


def flatten_recipe_block(recipe: dict, path: str) -> dict:
    """`lora: {r: 16, alpha: 32}` -> lora_r: 16, lora_alpha: 32 (a flat key of the same option wins)."""
    block = recipe.get("lora")
    if block is None:
        return recipe
    if not isinstance(block, dict):
        raise ConfigError(f"recipe {path}: `lora:` must be a mapping, e.g. lora: {{r: 16, alpha: 32}}")
    flat = {k: v for k, v in recipe.items() if k != "lora"}
    for key, value in block.items():
        if key not in LORA_BLOCK:
            raise ConfigError(f"recipe {path}: unknown key '{key}' in `lora:`; use {', '.join(LORA_BLOCK)}")
        flat.setdefault(LORA_BLOCK[key], value)
    return flat


def validate_options(cfg: TrainConfig) -> None:
    if cfg.lora_r < 0:
        raise ConfigError(f"--lora_r must be >= 0 (0 is full fine-tuning), got {cfg.lora_r}")
    if cfg.lora_r == 0:
        if cfg.load_in_4bit:
            raise ConfigError("--load_in_4bit (QLoRA) trains LoRA adapters on a 4-bit base: set --lora_r (e.g. 16)")
        if cfg.merge_lora:
            raise ConfigError("--merge_lora needs LoRA: set --lora_r (e.g. 16), or drop --merge_lora")
        return
    if cfg.lora_alpha <= 0:
        raise ConfigError(f"--lora_alpha must be > 0, got {cfg.lora_alpha}")
    if not 0 <= cfg.lora_dropout < 1:
        raise ConfigError(f"--lora_dropout must be in [0, 1), got {cfg.lora_dropout}")
    if not cfg.model_name_or_path or (cfg.model_config is not None and not cfg.dry_run):  # a dry run: see hub.py
        raise ConfigError(
            "LoRA adapts pretrained weights: set --model_name_or_path to a hub id or a directory from_pretrained "
            "loads (without --model_config); a random init leaves no base to load the adapter onto"
        )


def check(cfg: TrainConfig, model_config, zero_stage: int) -> None:
    """A LoRA run's options against the model, on one meta model, before any process group starts."""
    from .model import meta_model

    model = meta_model(model_config)
    check_targets(cfg, model, model_config.model_type)
    check_quantization(cfg, model, zero_stage)


def check_targets(cfg: TrainConfig, model, model_type: str) -> None:
    """Every named target and module to save exists in the (meta) model (peft's matching: the whole name or
    its last dotted parts)."""
    import torch

    modules = dict(model.named_modules())
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in modules.items() if isinstance(m, torch.nn.Linear)})
    for option in ("lora_target_modules", "modules_to_save"):
        for target in getattr(cfg, option):
            if option == "lora_target_modules" and target == ALL_LINEAR:
                continue
            if not any(name == target or name.endswith("." + target) for name in modules):
                raise ConfigError(
                    f"--{option}: the model ({model_type}) has no module '{target}'; its linear "
                    f"layers are {', '.join(linear)} (or use {ALL_LINEAR})"
                )


def quantized_linears(model) -> list:
    """(name, Linear) of the layers --load_in_4bit stores in NF4: every Linear but the output head
    (transformers' bitsandbytes integration keeps the head in 16 bits)."""
    import torch

    head = model.get_output_embeddings()
    return [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head]


def check_quantization(cfg: TrainConfig, model, zero_stage: int) -> None:
    """QLoRA where it can run, refused in one line where it cannot."""
    if not cfg.load_in_4bit:
        return
    if zero_stage == 3:
        raise ConfigError(
            "--load_in_4bit with ZeRO-3 is not supported here: ZeRO-3 would partition bitsandbytes' packed 4-bit "
            "weights and lose their quantisation state. Use ZeRO-2 (ds_configs/zero2.json): the 4-bit base is "
            "a quarter of its bf16 size on every GPU, and the adapters' states are partitioned"
        )
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ConfigError("--load_in_4bit needs bitsandbytes: pip install bitsandbytes") from None
    import torch

    if torch.cuda.is_available():
        return
    narrow = sorted(
        {
            f"{name.rsplit('.', 1)[-1]} ({m.in_features})"
            for name, m in quantized_linears(model)
            if m.in_features % QLORA_CPU_BLOCK
        }
    )
    if narrow:
        raise ConfigError(
            f"--load_in_4bit on a CPU: bitsandbytes' CPU 4-bit kernel needs layers {QLORA_CPU_BLOCK} inputs wide "
            f"or a multiple of it; this model has {', '.join(narrow)}. Train LoRA without --load_in_4bit here"
        )


def lora_config(cfg: TrainConfig):
    from peft import LoraConfig

    targets = cfg.lora_target_modules
    return LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=ALL_LINEAR if targets == [ALL_LINEAR] else list(targets),
        modules_to_save=list(cfg.modules_to_save) or None,
        task_type="CAUSAL_LM",
    )


def base_model_reference(name: str) -> str:
    """What the adapter names as its base: a local directory absolutely (the adapter may be loaded from
    anywhere), a hub id as is."""
    p = Path(name).expanduser()
    return str(p.resolve()) if p.is_dir() else name


def wrap(model, cfg: TrainConfig):
    """The base with adapters on its targets, everything else frozen. lora_A is drawn from the run's seed, so
    every rank and every ZeRO stage starts from the same adapter (lora_B starts at zero: the base's output)."""
    import torch
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        # Adapters in the base's dtype. peft's default upcasts them to fp32, and ZeRO-3, which does not cast the
        # module as ZeRO-0/1/2 do, then multiplies bf16 activations by fp32 weights (an error, measured); the
        # fp32 master copy of the adapters is DeepSpeed's, in the optimizer, as for full fine-tuning.
        peft_model = get_peft_model(model, lora_config(cfg), autocast_adapter_dtype=False)
    peft_model.peft_config["default"].base_model_name_or_path = base_model_reference(cfg.model_name_or_path)
    return peft_model


def trainable_count(model) -> tuple[int, int]:
    """(trainable, all) parameters, ZeRO-3 partitions by their full size."""
    return num_params(model, trainable_only=True), num_params(model)


def export_adapter(engine, tokenizer, out_dir: Path, zero3: bool, rank: int) -> None:
    """output_dir becomes a PEFT adapter directory: adapter_config.json, adapter_model.safetensors, the
    tokenizer. `PeftModel.from_pretrained(base, out_dir)` loads it."""
    import torch

    sd = gathered_parameters(engine.module, zero3, rank, trainable_only=True)
    if rank == 0:
        engine.module.save_pretrained(out_dir, state_dict=sd, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
    torch.distributed.barrier()


def peft_model_from(config, trainable: dict, dtype):
    """A PeftModel on the pretrained base the LoraConfig `config` names, holding `trainable` (the adapter as the
    engine names it). For merging, and for tools/export_hf.py's LoRA checkpoints."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # a plain load on one process, not one inside zero.Init
    base = AutoModelForCausalLM.from_pretrained(config.base_model_name_or_path, dtype=dtype)
    model = get_peft_model(base, config)
    params = dict(model.named_parameters())
    missing = [k for k, p in params.items() if p.requires_grad and k not in trainable]
    unexpected = [k for k in trainable if k not in params]
    if missing or unexpected:
        raise ConfigError(
            f"the adapter does not match its base {config.base_model_name_or_path}: "
            f"missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    model.load_state_dict(trainable, strict=False)
    return model


def export_merged(engine, tokenizer, out_dir: Path, zero3: bool, rank: int, dtype) -> None:
    """`--merge_lora`: the pretrained base with the trained adapter merged in, saved as a plain HF model.
    Only the adapter is gathered; rank 0 loads the base from where the adapter config says it is."""
    import torch

    sd = gathered_parameters(engine.module, zero3, rank, trainable_only=True)
    if rank == 0:
        merged = peft_model_from(engine.module.peft_config["default"], sd, dtype).merge_and_unload()
        merged.config.use_cache = True
        merged.save_pretrained(out_dir, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
    torch.distributed.barrier()


def is_adapter_dir(path: Path) -> bool:
    return (Path(path) / "adapter_config.json").is_file()


def load_for_inference(path: Path, dtype, as_trained: bool = True, load_in_4bit: bool = False):
    """An adapter directory as a user loads it: the base it names, then `PeftModel.from_pretrained`.
    `as_trained`: keep a 16-bit adapter in 16 bits (the engine's numerics, for the export check); otherwise
    peft's default, which upcasts it to fp32. `load_in_4bit`: the base quantised as QLoRA trained on it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from .model import quantized_load

    base_name = json.loads((Path(path) / "adapter_config.json").read_text())["base_model_name_or_path"]
    base = AutoModelForCausalLM.from_pretrained(base_name, dtype=dtype, **quantized_load(load_in_4bit, dtype))
    # the adapter in the dtype it was trained in (peft would upcast a 16-bit one to fp32): the engine's numerics
    return PeftModel.from_pretrained(base, str(path), autocast_adapter_dtype=not as_trained).eval()


def changed_settings(previous: dict, signature: dict) -> list[str]:
    """The adapter settings that differ between a saved run and this launch (a resume cannot change them:
    the checkpoint holds tensors of the old adapter's shapes)."""
    return [k for k in SETTINGS if previous.get(k) != signature.get(k)]
