"""The precision blocks beyond bf16/fp16 "enabled": DeepSpeed 0.19.8's low-precision master weights, gradients and
optimizer states (`bf16.bf16_master_weights_and_grads`, `bf16.bf16_optimizer_states`; ds_configs/bf16_states.json)
and its `torch_autocast` block (fp32 parameters and master weights, autocast compute; ds_configs/autocast.json).

Called by intake._resolve_precision once both blocks' "enabled" are filled. What DeepSpeed rejects only inside
`deepspeed.initialize` (an assertion on every rank, after the process group and the model) or accepts and then
ignores is refused here in one line, before any of that. Read in DeepSpeed 0.19.8:

- runtime/config.py `_do_error_check`: both bf16 keys only with ZeRO 1, 2 or 3; bf16_optimizer_states only with
  bf16_master_weights_and_grads.
- runtime/base_optimizer.py `_configure_master_weights` (ZeRO-1/2 and ZeRO-3 alike): bf16 master weights
  *without* bf16 optimizer states need optimizer offload with DeepSpeedCPUAdam (the fp32 moments stay on the
  host); bf16 states *with* offload need DeepSpeedCPUAdam built with fp32_optimizer_states=False. train.py builds
  its own DeepSpeedCPUAdam with fp32 moments under offload (training/engine.py), which DeepSpeed then rejects; an
  `optimizer` block makes DeepSpeed build it (engine.py `get_optimizer_configuration` forces
  fp32_optimizer_states=False under bf16_optimizer_states), so one is added with the recipe's AdamW settings.
- runtime/config.py `get_torch_autocast_dtype`: no "dtype" leaves None, which torch_autocast.py then sets as every
  Linear weight's communication dtype: filled with bfloat16 here. Its keys are read one by one
  (`get_scalar_param`), so a misspelt key is ignored: refused here.
- runtime/torch_autocast.py `init_autocast_params`: asserts against zero_quantized_weights, and imports each
  `lower_precision_safe_modules` name at engine start: checked here.
"""

from __future__ import annotations

from zero_recipes.errors import ConfigError

AUTO = "auto"
MASTER, STATES = "bf16_master_weights_and_grads", "bf16_optimizer_states"
AUTOCAST = "torch_autocast"
AUTOCAST_KEYS = ("enabled", "dtype", "lower_precision_safe_modules")
AUTOCAST_DTYPES = {  # DeepSpeed's DtypeEnum spellings -> the one written back
    **dict.fromkeys(("bf16", "bfloat16", "torch.bfloat16"), "bfloat16"),
    **dict.fromkeys(("fp16", "float16", "half", "torch.float16"), "float16"),
}
# An optimizer DeepSpeed builds itself (DeepSpeedCPUAdam under offload); its "auto"s are filled as any
# optimizer block's are (intake._resolve_optimizer), with the recipe's AdamW settings.
DEEPSPEED_ADAMW = {"type": "AdamW", "params": {"lr": AUTO, "betas": AUTO, "eps": AUTO, "weight_decay": AUTO}}


def resolve(ds: dict) -> list[str]:
    """Check and fill the bf16 state keys and the torch_autocast block of a config whose bf16/fp16 "enabled" are
    filled; returns the notes for --dry_run. Raises ConfigError (one line) for what DeepSpeed rejects or ignores."""
    return _bf16_states(ds) + _autocast(ds)


def _stage(ds: dict) -> int:
    z = ds.get("zero_optimization")
    stage = z.get("stage", 0) if isinstance(z, dict) else 0
    return int(stage) if isinstance(stage, (int, float)) and not isinstance(stage, bool) else 0


def _optimizer_offload(ds: dict) -> bool:
    z = ds.get("zero_optimization")
    block = z.get("offload_optimizer") if isinstance(z, dict) else None
    return isinstance(block, dict) and block.get("device") not in (None, "none")


def _flag(block: dict, key: str) -> bool:
    value = block.get(key, False)
    if value == AUTO:
        raise ConfigError(
            f'bf16.{key} is "auto", which has no recipe setting to follow; set it true (ds_configs/bf16_states.json) '
            "or leave it out"
        )
    if not isinstance(value, bool):
        raise ConfigError(f"bf16.{key} must be true or false, got {value!r}")
    return value


def _bf16_states(ds: dict) -> list[str]:
    bf16 = ds["bf16"]
    master, states = _flag(bf16, MASTER), _flag(bf16, STATES)
    if not (master or states):
        return []
    if not bf16["enabled"]:
        raise ConfigError(
            f"bf16.{MASTER if master else STATES} is set but bf16 is not enabled: low-precision master weights and "
            "states are an option of bf16 training; add ds_configs/bf16.json (or bf16: true)"
        )
    if _stage(ds) == 0:
        raise ConfigError(
            f"bf16.{MASTER if master else STATES} needs ZeRO stage 1, 2 or 3 (DeepSpeed asserts it): ZeRO-0 keeps no "
            "partitioned master weights to make low-precision; add ds_configs/zero1.json, zero2.json or zero3.json"
        )
    if states and not master:
        raise ConfigError(
            f"bf16.{STATES} needs bf16.{MASTER} true too (DeepSpeed asserts it): Adam's moments follow the master "
            "weights' dtype; use ds_configs/bf16_states.json, which sets both"
        )
    offload = _optimizer_offload(ds)
    if not states:
        if not offload:
            raise ConfigError(
                f"bf16.{MASTER} without bf16.{STATES} needs optimizer offload (DeepSpeed asserts ZeRO-Offload with "
                "DeepSpeedCPUAdam: the fp32 moments live on the host); add ds_configs/offload_optimizer.json, or "
                f"set bf16.{STATES} true (ds_configs/bf16_states.json)"
            )
        return ["precision: bf16 master weights and gradients (2 B/param each, offloaded), Adam's moments fp32 on "
                "the host (DeepSpeedCPUAdam)"]  # fmt: skip
    notes = []
    if offload:
        opt = ds.get("optimizer")
        if opt is None:
            ds["optimizer"] = {"type": DEEPSPEED_ADAMW["type"], "params": dict(DEEPSPEED_ADAMW["params"])}
            notes.append(
                "optimizer: DeepSpeed builds its DeepSpeedCPUAdam (AdamW, the recipe's lr, betas, eps and weight "
                f"decay) with bf16 moments: bf16.{STATES} under optimizer offload needs it built so"
            )
        elif isinstance(opt, dict) and (opt.get("params") or {}).get("torch_adam"):
            raise ConfigError(
                f"optimizer.params.torch_adam with bf16.{STATES} and optimizer offload: DeepSpeed needs its "
                "DeepSpeedCPUAdam there (it asserts); remove torch_adam"
            )
    return notes


def _autocast(ds: dict) -> list[str]:
    block = ds.get(AUTOCAST)
    if block is None:
        return []
    if not isinstance(block, dict):
        raise ConfigError(
            f'DeepSpeed config \'{AUTOCAST}\' must be an object like {{"enabled": true, "dtype": "bfloat16"}}'
        )
    unknown = sorted(set(block) - set(AUTOCAST_KEYS))
    if unknown:
        raise ConfigError(
            f"{AUTOCAST} has key(s) {', '.join(unknown)} that DeepSpeed does not read (it would ignore them); "
            f"its keys are {', '.join(AUTOCAST_KEYS)}"
        )
    enabled = block.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ConfigError(f"{AUTOCAST}.enabled must be true or false, got {enabled!r}")
    if not enabled:
        return []
    dtype = block.get("dtype", AUTO)
    if dtype == AUTO:
        block["dtype"] = "bfloat16"
    elif str(dtype) in AUTOCAST_DTYPES:
        block["dtype"] = AUTOCAST_DTYPES[str(dtype)]
    else:
        raise ConfigError(
            f"{AUTOCAST}.dtype {dtype!r}: autocast computes in bfloat16 or float16 (float32 is no autocast: set "
            "enabled false)"
        )
    on = [name for name in ("bf16", "fp16") if ds[name]["enabled"]]
    if on:
        raise ConfigError(
            f"{AUTOCAST} is enabled together with {on[0]}.enabled: {on[0]} casts the parameters to 16 bits, so "
            f"autocast's fp32 parameters and master weights are gone; use ds_configs/autocast.json alone "
            f"(fp32 parameters, {block['dtype']} compute) or {on[0]} without {AUTOCAST}"
        )
    z = ds.get("zero_optimization")
    if isinstance(z, dict) and z.get("zero_quantized_weights"):
        raise ConfigError(
            f"{AUTOCAST} with zero_optimization.zero_quantized_weights: DeepSpeed asserts against the pair"
        )
    modules = block.get("lower_precision_safe_modules")
    if modules is not None:
        if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
            raise ConfigError(
                f'{AUTOCAST}.lower_precision_safe_modules must be a list of class paths like ["torch.nn.Linear"]'
            )
        for name in modules:
            _importable(name)
    return []


def _importable(name: str) -> None:
    """DeepSpeed imports each class at engine start (torch_autocast.init_autocast_params); here, before it."""
    import importlib

    package, _, cls = name.rpartition(".")
    try:
        getattr(importlib.import_module(package), cls)
    except Exception:  # noqa: BLE001 -- any failure is the same one line
        raise ConfigError(
            f"{AUTOCAST}.lower_precision_safe_modules: cannot import {name!r}; give module classes by their full "
            "path, e.g. torch.nn.Linear"
        ) from None
