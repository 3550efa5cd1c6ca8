"""Model: config resolution, construction (ZeRO-3 straight into partitions), seeded init, HF export."""

from __future__ import annotations

import os
import zlib
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Optional

from zero_recipes.config.train_config import TrainConfig, parse_model_config
from zero_recipes.errors import ConfigError

TINY_LLAMA = dict(
    model_type="llama",
    hidden_size=128,
    intermediate_size=352,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    initializer_range=0.02,
    vocab_size=4096,
)
"""The embedded default: a 2.3M-parameter Llama (GQA, SwiGLU, RoPE) that trains in minutes on 2 CPU cores."""


def local_missing(name: str) -> None:
    """A path that does not exist would otherwise be tried as a hub id, and fail with a network error."""
    p = Path(os.path.expanduser(name))
    if p.exists():
        return
    if Path(name) == Path(TrainConfig.output_dir):
        raise ConfigError(
            f"model directory '{name}' does not exist; it is what the quick start leaves: run "
            "`deepspeed train.py --deepspeed ds_configs/zero3.json` first"
        )
    if name.startswith((".", "/", "~")) or (len(p.parts) > 1 and Path(p.parts[0]).is_dir()):
        raise ConfigError(f"model directory '{name}' does not exist; give an existing directory or a hub id")


def load_model_config(cfg: TrainConfig, vocab_size: Optional[int] = None, local_files_only: bool = False):
    """The HF config of the model to train. `vocab_size` (the tokenizer's) sizes the embedded model;
    `local_files_only` reads a hub model's config from the local cache alone (hub.dry_run_model_config)."""
    from huggingface_hub.errors import StrictDataclassError  # transformers 5 validates config fields with it
    from transformers import AutoConfig

    overrides = parse_model_config(cfg.model_config)
    try:
        if overrides and "model_type" in overrides:
            fields = dict(overrides)
            config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        elif cfg.model_name_or_path:
            local_missing(cfg.model_name_or_path)
            config = AutoConfig.from_pretrained(
                cfg.model_name_or_path, trust_remote_code=cfg.trust_remote_code, local_files_only=local_files_only
            )
            for k, v in (overrides or {}).items():
                setattr(config, k, v)
        else:
            fields = dict(TINY_LLAMA)
            fields.pop("model_type")
            if vocab_size:
                fields["vocab_size"] = vocab_size
            fields.update(overrides or {})
            config = AutoConfig.for_model("llama", **fields)
    except (OSError, ValueError, KeyError, StrictDataclassError) as e:
        raise ConfigError(f"cannot build the model config: {' '.join(str(e).split())[:300]}") from None
    text = config.get_text_config()
    max_pos = getattr(text, "max_position_embeddings", None)
    if max_pos and cfg.block_size > max_pos:
        raise ConfigError(
            f"block_size {cfg.block_size} exceeds the model's max_position_embeddings {max_pos}; "
            f"use --block_size {max_pos} or less"
        )
    if cfg.attn_implementation:
        config._attn_implementation = cfg.attn_implementation
    return config


ATTENTION_SUPPORT = {"sdpa": "_supports_sdpa", "flex_attention": "_supports_flex_attn"}
ATTENTION_SUPPORT |= {f"flash_attention_{v}": "_supports_flash_attn" for v in (2, 3)}
"""transformers' class flags: which implementations a model class can run (eager: all of them)."""


def check_attention(config) -> None:
    """Refuse in one line an attention implementation that cannot run here, before anything is built. The
    check is transformers' own (PreTrainedModel._check_and_adjust_attn_implementation, which the model's
    __init__ runs: the model class supports it, its package is installed, a device it runs on is present),
    run on a meta model built with eager attention so that only the attention can fail. What transformers
    leaves to torch's first backward is added: flex_attention has no backward on CPU or MPS."""
    import copy

    requested = config._attn_implementation
    probe = copy.deepcopy(config)
    probe._attn_implementation = "eager"
    if causal_lm_class(probe).__name__ == "AutoModelForCausalLM":
        return  # remote code: transformers checks it when it builds the model
    model = meta_model(probe)
    choices = ["eager"] + [name for name, flag in ATTENTION_SUPPORT.items() if getattr(model, flag, False)]
    fix = f"use --attn_implementation {'sdpa' if 'sdpa' in choices else 'eager'}"
    try:
        model._check_and_adjust_attn_implementation(requested, is_init_check=True)
    except (ImportError, ValueError) as e:
        text = " ".join(str(e).split()).split("due to the following error: ")[-1]
        reason = text.split(". ")[0].rstrip(".")
        if "installed" in reason:
            fix = f"install it, or {fix}"
        raise ConfigError(
            f"--attn_implementation {requested} cannot be used: {reason}; {fix} "
            f"({type(model).__name__} supports {', '.join(choices)})"
        ) from None
    if requested == "flex_attention":
        from deepspeed.accelerator import get_accelerator

        device = get_accelerator().device_name()
        if device in ("cpu", "mps"):  # torch's flex_attention._validate_device refuses requires_grad inputs there
            raise ConfigError(
                f"--attn_implementation flex_attention cannot train on {device}: torch's "
                f"FlexAttention has no backward there; {fix}"
            )


def hidden_size(config) -> Optional[int]:
    return getattr(config.get_text_config(), "hidden_size", None)


def causal_lm_class(config):
    """Resolve (and so import) the model class before any `zero.Init`: importing transformers model
    code or torch._dynamo inside zero.Init breaks (measured)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        if getattr(config, "auto_map", None) and "AutoModelForCausalLM" in config.auto_map:
            return AutoModelForCausalLM
        raise ConfigError(f"model type '{config.model_type}' has no causal-LM head in transformers") from None


def meta_model(config):
    """The model built on the meta device from its config alone: shapes, no weights, no memory."""
    import torch

    cls = causal_lm_class(config)
    with torch.device("meta"):
        return cls._from_config(config) if hasattr(cls, "_from_config") else cls.from_config(config)


def num_params(model, trainable_only: bool = False) -> int:
    """The one parameter count: a tied lm_head counts once, a ZeRO-3 partitioned parameter by its full
    size (ds_numel), a meta-device one by its shape."""
    unique = {id(p): p for p in model.parameters()}.values()
    return sum(getattr(p, "ds_numel", None) or p.numel() for p in unique if p.requires_grad or not trainable_only)


def count_params_meta(config) -> int:
    """Parameter count without allocating."""
    return num_params(meta_model(config))


def build_model(cfg: TrainConfig, config, dtype, rank: int, load_kwargs: dict | None = None):
    """Pretrained weights or a seeded random init. The caller keeps an `HfDeepSpeedConfig` alive, so
    under ZeRO-3 transformers builds inside `zero.Init` and each rank only ever holds its partition.
    `load_kwargs`: the adapter's extra from_pretrained arguments (adapter.FullFineTuning.load_kwargs)."""
    import torch
    from transformers import AutoModelForCausalLM

    cls = causal_lm_class(config)
    if cfg.model_name_or_path and cfg.model_config is None:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                cfg.model_name_or_path,
                config=config,
                dtype=dtype,
                trust_remote_code=cfg.trust_remote_code,
                **(load_kwargs or {}),
            )
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot load model '{cfg.model_name_or_path}': {str(e).splitlines()[0]}") from None
    else:
        torch.manual_seed(cfg.seed)
        model = (
            AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=cfg.trust_remote_code)
            if cls is AutoModelForCausalLM
            else cls._from_config(config, dtype=dtype)
        )
        seeded_reinit(model, cfg.seed, rank)
    if cfg.gradient_checkpointing:
        enable_checkpointing(model)
        model.config.use_cache = False
    return model


def seeded_reinit(model, seed: int, rank: int) -> None:
    """Re-initialise every module from a seed derived from (seed, module name).

    transformers initialises differently with and without zero.Init (the RNG stream is consumed in a
    different order, measured), so a seed would not mean one model across ZeRO stages. Seeding each
    module by its name makes the weights independent of stage, world size and construction order.
    Under ZeRO-3 each module is gathered, initialised on rank 0 and re-partitioned."""
    import torch
    from transformers import PreTrainedModel
    from transformers.integrations import is_deepspeed_zero3_enabled

    zero3 = is_deepspeed_zero3_enabled()
    owners = {"": model}
    with torch.no_grad():
        for name, module in model.named_modules():
            parent = owners.get(name.rpartition(".")[0] if "." in name else "", model)
            owner = module if isinstance(module, PreTrainedModel) else parent
            owners[name] = owner
            params = list(module.parameters(recurse=False))
            if not params:
                continue
            if zero3:
                import deepspeed

                ctx = deepspeed.zero.GatheredParameters(params, modifier_rank=0)
            else:
                ctx = nullcontext()
            with ctx:
                if zero3 and rank != 0:
                    continue
                with torch.random.fork_rng(devices=[]), drawn_on_host(params):
                    torch.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                    owner._init_weights(module)
    if hasattr(model, "tie_weights"):
        model.tie_weights()


@contextmanager
def drawn_on_host(params):
    """Let an initialiser draw into CPU copies of `params`, then copy the draws back. Under ZeRO-3 the gathered
    parameters are on the GPU, where `normal_` draws from the CUDA generator: the same seed gives other
    numbers than the CPU generator that ZeRO-0/1/2's host-built model draws from."""
    away = [(p, p.data) for p in params if p.device.type != "cpu"]
    for p, data in away:
        p.data = data.to("cpu")
    try:
        yield
    finally:
        for p, data in away:
            data.copy_(p.data)
            p.data = data


def partition_numel(model) -> int:
    """Parameters this rank holds: its ZeRO-3 partitions (ds_tensor), or everything when not partitioned."""
    return sum(
        p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel()
        for p in {id(p): p for p in model.parameters()}.values()
    )


def enable_checkpointing(model) -> None:
    """Non-reentrant activation checkpointing (works with ZeRO-3's hooks). transformers 5 renamed the method
    and deprecates the old name; older releases only have the old one."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def use_tokenizer_special_ids(config, tokenizer) -> None:
    """A config built from fields (the embedded Llama, a recipe's model_config) carries its architecture's
    default bos/eos ids, which name arbitrary tokens of another tokenizer (the embedded Llama's eos 2 is '"',
    so generate() stopped at the first quote). Take them from the tokenizer the model is trained with.
    pad_token_id stays: Llama makes it the embedding's padding_idx, whose row never trains, and with the
    embedded tokenizer pad is eos."""
    text = config.get_text_config()
    for name in ("bos_token_id", "eos_token_id"):
        if getattr(tokenizer, name, None) is not None:
            setattr(text, name, getattr(tokenizer, name))
