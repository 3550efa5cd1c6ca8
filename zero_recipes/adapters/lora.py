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
from typing import Optional

from zero_recipes.adapters.base import FullFineTuning
from zero_recipes.checkpointing.export import gathered_parameters, state_bytes, write_model_dir
from zero_recipes.config.lora_options import ALL_LINEAR
from zero_recipes.config.train_config import TrainConfig
from zero_recipes.errors import ConfigError
from zero_recipes.modeling.model import meta_model, num_params

QLORA_CPU_BLOCK = 64
"""On a CPU, bitsandbytes 0.50's 4-bit matmul repacks each weight in blocks of 64 input features; a layer with
another width fails inside the forward with a shape error (measured: 352 = 5.5 x 64)."""

# bitsandbytes, which peft imports when it is installed, warns at import on CPUs with AVX512-BF16 that an
# optional hub kernel is missing; its built-in fallback is what runs. Once per rank per launch, not actionable.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def enabled_on(module) -> bool:
    """The engine's module is a peft model."""
    return hasattr(module, "peft_config")


def check(cfg: TrainConfig, model_config) -> None:
    """A LoRA run's options against the model, on one meta model, before any process group starts."""
    model = meta_model(model_config)
    check_targets(cfg, model, model_config.model_type)
    check_quantization(cfg, model)


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


def check_quantization(cfg: TrainConfig, model) -> None:
    """QLoRA where it can run, refused in one line where it cannot (with ZeRO-3: combinations.py)."""
    if not cfg.load_in_4bit:
        return
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


def export_adapter(engine, tokenizer, out_dir: Path, rank: int) -> None:
    """output_dir becomes a PEFT adapter directory: adapter_config.json, adapter_model.safetensors, the
    tokenizer. `PeftModel.from_pretrained(base, out_dir)` loads it."""

    sd = gathered_parameters(engine.module, rank, trainable_only=True)

    def write(stage: Path) -> None:
        engine.module.save_pretrained(stage, state_dict=sd, safe_serialization=True)
        tokenizer.save_pretrained(stage)

    write_model_dir(out_dir, rank, write, state_bytes(sd))


def quantized_load(dtype) -> dict:
    """QLoRA's extra from_pretrained arguments: a 4-bit NF4 base (bitsandbytes) on this rank's device,
    where bitsandbytes quantises it as it loads."""
    from deepspeed.accelerator import get_accelerator
    from transformers import BitsAndBytesConfig

    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype,
    )
    return {"quantization_config": quant, "device_map": {"": get_accelerator().current_device_name()}}


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


def export_merged(engine, tokenizer, out_dir: Path, rank: int, dtype) -> None:
    """`--merge_lora`: the pretrained base with the trained adapter merged in, saved as a plain HF model.
    Only the adapter is gathered; rank 0 loads the base from where the adapter config says it is."""

    sd = gathered_parameters(engine.module, rank, trainable_only=True)

    def write(stage: Path) -> None:
        merged = peft_model_from(engine.module.peft_config["default"], sd, dtype).merge_and_unload()
        merged.config.use_cache = True
        merged.save_pretrained(stage, safe_serialization=True)
        tokenizer.save_pretrained(stage)

    write_model_dir(out_dir, rank, write)


def is_adapter_dir(path: Path) -> bool:
    return (Path(path) / "adapter_config.json").is_file()


def load_for_inference(path: Path, dtype, as_trained: bool = True, load_in_4bit: bool = False):
    """An adapter directory as a user loads it: the base it names, then `PeftModel.from_pretrained`.
    `as_trained`: keep a 16-bit adapter in 16 bits (the engine's numerics, for the export check); otherwise
    peft's default, which upcasts it to fp32. `load_in_4bit`: the base quantised as QLoRA trained on it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_name = json.loads((Path(path) / "adapter_config.json").read_text())["base_model_name_or_path"]
    base = AutoModelForCausalLM.from_pretrained(
        base_name, dtype=dtype, **(quantized_load(dtype) if load_in_4bit else {})
    )
    # the adapter in the dtype it was trained in (peft would upcast a 16-bit one to fp32): the engine's numerics
    return PeftModel.from_pretrained(base, str(path), autocast_adapter_dtype=not as_trained).eval()


class Lora(FullFineTuning):
    """LoRA adapters on a frozen pretrained base (peft), under every ZeRO stage."""

    def check(self, model_config) -> None:
        check(self.cfg, model_config)  # a target the model lacks fails here, on the meta model

    def wrap(self, model, log):
        cfg = self.cfg
        model = wrap(model, cfg)
        trainable, total = trainable_count(model)
        log(
            f"lora: r {cfg.lora_r}, alpha {cfg.lora_alpha:g} on {', '.join(cfg.lora_target_modules)}; trains "
            f"{trainable:,} of {total:,} parameters ({100 * trainable / total:.2f} %), the base frozen"
        )
        return model

    def files_writer(self, engine, tokenizer):
        write_model_files = super().files_writer(engine, tokenizer)

        def write(out_dir):
            write_model_files(out_dir)
            engine.module.peft_config["default"].save_pretrained(str(out_dir))

        return write

    def export(self, engine, tokenizer, out_dir: Path, rank: int, dtype, log) -> None:
        if self.cfg.merge_lora:
            export_merged(engine, tokenizer, out_dir, rank, dtype)
            log(f"export: the adapter merged into its base; AutoModelForCausalLM.from_pretrained('{out_dir}') loads it")
        else:
            export_adapter(engine, tokenizer, out_dir, rank)
            log(f"export: a PEFT adapter; PeftModel.from_pretrained(base, '{out_dir}') loads it onto its base")

    def reload(self, out_dir: Path, dtype):
        if is_adapter_dir(out_dir):
            return load_for_inference(out_dir, dtype, load_in_4bit=self.cfg.load_in_4bit)
        return super().reload(out_dir, dtype)

    def resume_refusal(self, saved: dict, ranks: str) -> Optional[str]:
        return (
            f"this LoRA run was saved by {ranks} with ZeRO-{saved['zero_stage']}; its checkpoint "
            "leaves the frozen base out, which DeepSpeed's universal checkpoint conversion does not handle. "
            f"Resume with {ranks} and ZeRO-{saved['zero_stage']}"
        )


class QLora(Lora):
    """LoRA on a base whose linear weights bitsandbytes holds in 4-bit NF4."""

    def load_kwargs(self, dtype) -> dict:
        return quantized_load(dtype)
