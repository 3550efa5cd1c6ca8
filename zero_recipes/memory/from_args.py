"""tools/estimate_memory.py's arguments read through train.py's own parsing: the TrainConfig, model config and
resolved DeepSpeed config a run with them would use (`load`), and the estimate of that one run (`one`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..errors import ConfigError
from . import objective, stack
from .precision import FP32_ASSUMED, assumed_fp32
from .table import lora_of

LORA_OPTIONS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "modules_to_save")


def load(args, deepspeed: list[str], world: int, micro: int | None = None, memo: dict | None = None):
    """(TrainConfig, model config, resolved DeepSpeed config, notes) through train.py's own parsing. `memo`
    (see `loader`) keeps the model config of arguments already read."""
    from zero_recipes import modes
    from zero_recipes.config import lora_options
    from zero_recipes.config.cli import parse_args
    from zero_recipes.ds import intake as ds_config
    from zero_recipes.ds.facts import zero_stage
    from zero_recipes.parallel import combinations
    from zero_recipes.parallel.mesh import Mesh

    cfg, explicit = parse_args(train_argv(args, deepspeed, micro))
    key = tuple(train_argv(args, [], micro))  # all that decides the model config: the arguments but --deepspeed
    memo = {} if memo is None else memo
    if key not in memo:
        memo[key] = model_config(args, cfg)
    config, hidden = memo[key]
    raw = ds_config.load_fragments(cfg.deepspeed)
    flag_overrides(args, raw)
    notes = precision_notes(raw, cfg)
    resolved = ds_config.resolve(raw, cfg, explicit, world, hidden)
    cfg = resolved.cfg
    ds = ds_config.with_steps(resolved.ds, cfg, 1000)
    mesh = Mesh.of(world, ds)  # checked by ds_config.resolve
    # what train.py refuses, refused the same way; but the estimate sizes QLoRA under ZeRO-3 as well, which
    # train.py refuses (as before: issue 30 changed no output of the estimator)
    active = combinations.modes(mesh.sizes, zero_stage(ds), lora_options.adapter_name(cfg), cfg.objective)
    combinations.refuse({mode: n for mode, n in active.items() if mode != "qlora"})
    notes += modes.parallelism_for(mesh).check(config, ds, cfg)
    return cfg, config, ds, notes


def loader():
    """`load` for the table, which loads once per cell with only the DeepSpeed files and the world changing: the
    model config (and, under LoRA, the meta model its targets are checked on) is read once, not once a cell."""
    memo: dict = {}

    def cached(args, deepspeed: list[str], world: int, micro: int | None = None):
        return load(args, deepspeed, world, micro, memo)

    return cached


def train_argv(args, deepspeed: list[str], micro: int | None) -> list[str]:
    """The CLI's arguments as train.py's command line."""
    argv = ["--recipe", args.recipe] if args.recipe else []
    if args.model:
        # LoRA needs a pretrained base (zero_recipes.config.lora_options.validate_options); of a config.json the estimate reads
        # only the architecture, which AutoConfig.from_pretrained reads from the file as well
        as_config = args.model.endswith(".json") and not lora_requested(args)
        argv += ["--model_config" if as_config else "--model_name_or_path", args.model]
    for name in LORA_OPTIONS:
        value = getattr(args, name)
        if value is not None:
            argv += [f"--{name}", *(value if isinstance(value, list) else [str(value)])]
    if args.load_in_4bit:
        argv += ["--load_in_4bit", "true"]
    if micro or args.micro_batch_size or not args.recipe:
        argv += ["--per_device_train_batch_size", str(micro or args.micro_batch_size or 1)]
    if args.seq_len:
        argv += ["--block_size", str(args.seq_len)]
    if args.gradient_checkpointing:
        argv += ["--gradient_checkpointing", "true"]
    if getattr(args, "gradient_accumulation_steps", None):  # a pipeline's micro-batches a step
        argv += ["--gradient_accumulation_steps", str(args.gradient_accumulation_steps)]
    for name in ("tiled_loss", "loss_tile_tokens", "tiled_mlp", "objective"):  # train.py's flags, parsed by its parser
        value = getattr(args, name, None)
        if value is not None:
            argv += [f"--{name}", str(value).lower()]
    argv += stack.train_argv(args)
    if deepspeed:
        argv += ["--deepspeed", *deepspeed]
    return argv


def model_config(args, cfg):
    """(model config, hidden size), the input checked as train.py checks it, and a config.json checked for what
    the estimate needs of it."""
    from zero_recipes.modeling import model as modeling

    # a config.json is checked once: under LoRA before the DeepSpeed check, as before, otherwise after it
    config_file = args.model if args.model and args.model.endswith(".json") else None
    if config_file and cfg.lora_r > 0:
        check_config_file(config_file)
    if not cfg.deepspeed:
        raise ConfigError("no DeepSpeed config: give --deepspeed ds_configs/zero2.json (or any of ds_configs/)")
    if config_file and cfg.lora_r <= 0:
        check_config_file(config_file)
    # the length is checked here, in the tool's words, against the context RoPE scaling extends it to
    config = modeling.load_model_config(dataclasses.replace(cfg, block_size=1))
    stack.scaled_positions(args, config, cfg.block_size)
    hidden = modeling.hidden_size(config)
    if not hidden:
        raise ConfigError(
            "the model config has no hidden_size; give a complete config.json (with model_type "
            "and hidden_size), a model directory or a hub id"
        )
    if cfg.lora_r > 0:
        from zero_recipes.adapters import lora

        lora.check_targets(
            cfg, modeling.meta_model(config), config.model_type
        )  # a target the model lacks: the same one-line error as train.py's
    return config, hidden


def flag_overrides(args, raw: dict) -> None:
    """--tensor_parallel, --sequence_parallel, --pipeline_parallel and --expert_parallel over what the merged
    DeepSpeed fragments set."""
    if args.tensor_parallel and not args.table:  # --table sets each cell's size itself
        raw["tensor_parallel"] = {**(raw.get("tensor_parallel") or {}), "autotp_size": args.tensor_parallel}
    if args.sequence_parallel and not args.table:
        raw["sequence_parallel_size"] = args.sequence_parallel
    if getattr(args, "pipeline_parallel", None) and not args.table:
        raw["pipeline"] = {**(raw.get("pipeline") or {}), "stages": args.pipeline_parallel}
    if getattr(args, "expert_parallel", None) and not args.table:
        raw["expert_parallel"] = {**(raw.get("expert_parallel") or {}), "enabled": True}
        raw["expert_parallel"]["autoep_size"] = args.expert_parallel


def precision_notes(raw: dict, cfg) -> list[str]:
    """What the estimate assumes about the precision: fp32 when nothing sets one, NF4 under load_in_4bit."""
    notes = [FP32_ASSUMED] if assumed_fp32(raw, cfg) else []
    if cfg.load_in_4bit:
        notes.append(
            "load_in_4bit (QLoRA): linear weights counted at NF4's 0.52 bytes each (4-bit codes and double-"
            "quantised scales), the rest of the base in 16 bits; derived from bitsandbytes' layout, not measured"
        )
    return notes


def lora_requested(args) -> bool:
    """LoRA set by a flag or by the recipe (a `lora:` block or `lora_r:`)."""
    if args.lora_r is not None:
        return args.lora_r > 0
    if not args.recipe:
        return False
    from zero_recipes.config.cli import load_recipe

    recipe = load_recipe(args.recipe)
    block = recipe.get("lora") if isinstance(recipe.get("lora"), dict) else {}
    return bool(recipe.get("lora_r", block.get("r", 0)))


def check_config_file(path: str) -> None:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{path} does not exist; give a config.json, a model directory or a hub id")
    data = json.loads(p.read_text())
    if not any(k in data or k in data.get("text_config", {}) for k in ("hidden_size", "n_embd", "d_model")):
        raise ConfigError(
            f"{path} has no hidden_size; a config.json must give the model's width (hidden_size, or "
            "n_embd for GPT-2) so the estimate is of your model, not of a default one"
        )
    if "model_type" not in data:
        raise ConfigError(f'{path} has no model_type; add it (e.g. "model_type": "llama") so the architecture is known')


def one(args, gpu_memory):
    """The estimate of the one run the arguments describe, with its notes: (Estimate, TrainConfig, model config)."""
    from .estimate import estimate

    world = args.num_gpus * args.num_nodes
    cfg, config, ds, notes = load(args, args.deepspeed, world)
    launch = stack.launch_of(args, cfg, config, args.num_gpus, cfg.gradient_checkpointing)
    e = estimate(config, ds, launch, gpu_memory=gpu_memory, lora=lora_of(cfg), load_in_4bit=cfg.load_in_4bit)
    if e.tensor_parallel > args.num_gpus:
        notes.append(
            f"a tensor-parallel group of {e.tensor_parallel} spans {args.num_gpus}-GPU nodes: its per-layer all-reduces "
            "would cross the network; keep autotp_size within the GPUs per node"
        )
    if e.sequence_parallel > args.num_gpus:
        notes.append(
            f"a sequence-parallel group of {e.sequence_parallel} spans {args.num_gpus}-GPU nodes: its all-to-alls in "
            "every attention layer would cross the network; keep sequence_parallel_size within the GPUs per node"
        )
    e.notes = (
        notes + e.notes + (pipeline_notes(e, ds) if e.pipeline else loss_notes(launch, config, e.sequence_parallel))
    )
    e.notes += stack.notes(args)
    return e, cfg, config


def pipeline_notes(e, ds: dict) -> list[str]:
    """What the estimate of a pipeline says beyond its figures: the loss is the last stage's, whole; the bubble
    when the step has few micro-batches for its stages; DeepSpeed's own activation checkpointing, not modelled."""
    m, pp = e.pipeline["micro_batches"], e.pipeline_parallel
    notes = ["loss: the last stage's, over each micro-batch's whole fp32 logits (a pipeline's head is not tiled)"]
    if m < 4 * pp:
        notes.append(
            f"pipeline: {m} micro-batch(es) a step for {pp} stages leave every GPU idle "
            f"{100 * e.pipeline['bubble']:.0f} % of the step (the bubble, (p-1)/(m+p-1)); more "
            "--gradient_accumulation_steps shrink it, the first stage then holding up to "
            f"{pp} micro-batches' activations"
        )
    interval = (ds.get("pipeline") or {}).get("activation_checkpoint_interval") or 0
    if interval:
        notes.append(
            f"pipeline.activation_checkpoint_interval = {interval} is not modelled: the activations are those "
            "without it, an upper bound (--gradient_checkpointing true is)"
        )
    return notes


def loss_notes(launch, config, sp: int) -> list[str]:
    """Which loss and MLP the estimate traced for this Launch, as train.py will run them
    (zero_recipes.modeling.lm_loss), or in Liger's chunks (stack.use_liger)."""
    from .activations import loss_tile

    micro, seq = launch.micro_batch_size, launch.seq_len
    # as activation_bytes traces it: DPO's answer logits are never tiled
    tile = (
        None
        if launch.objective == "dpo"
        else loss_tile(config, micro, seq, sp, launch.tiled_loss, launch.loss_tile_tokens)
    )
    local = micro * seq // sp
    notes = []
    if launch.objective == "dpo":
        notes.append(objective.note(micro, seq))
    if tile and local > tile:
        notes.append(
            f"loss: tiled, {-(-local // tile)} tiles of {tile} tokens (one tile's logits held at a time, not "
            f"{local} tokens'); --tiled_loss false for the whole logits"
        )
    if launch.tiled_mlp:
        hidden = config.get_text_config().hidden_size
        notes.append(f"mlp: tiled, {-(-seq // sp // hidden)} tile(s) of up to {hidden} tokens per MLP")
    return notes
