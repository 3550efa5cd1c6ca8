"""LoRA's options, read before anything is built: a recipe's `lora:` block, the rules between the options, and
which of them make one adapter. A leaf beside config/train_config.py (it imports only the error type), so the schema's
validation and the recipe reader use it without importing peft, the model code or lora.py.
"""

from __future__ import annotations

from zero_recipes.errors import ConfigError

ALL_LINEAR = "all-linear"

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


def enabled(cfg) -> bool:
    """The run trains LoRA adapters (QLoRA included)."""
    return cfg.lora_r > 0


def adapter_name(cfg) -> str:
    """How this run adapts the model: 'full' fine-tuning, 'lora', or 'qlora' (LoRA on a 4-bit base)."""
    if not enabled(cfg):
        return "full"
    return "qlora" if cfg.load_in_4bit else "lora"


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


def validate_options(cfg) -> None:
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


def changed_settings(previous: dict, signature: dict) -> list[str]:
    """The adapter settings that differ between a saved run and this launch (a resume cannot change them:
    the checkpoint holds tensors of the old adapter's shapes)."""
    return [k for k in SETTINGS if previous.get(k) != signature.get(k)]
