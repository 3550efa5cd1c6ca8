"""The learning rate and weight decay a run takes when its recipe and flags leave them unset: the values that fit
what is trained, in one table (docs/configuration.md, "Default learning rate").

- From scratch (the embedded tiny Llama, or `--model_config`, which always builds a random init): 2e-3 and weight
  decay 0.1, the values tuned for pretraining the embedded demo (nanoGPT-style), so the quick start is unchanged.
- Full fine-tuning of a pretrained checkpoint: 2e-5, TRL SFTConfig's default (the HF Trainer's 5e-5 is the
  aggressive end; the shipped SFT recipes of 1B-8B models use 1e-5..2e-5), and the HF Trainer's weight decay 0.0.
  The demo's 2e-3 took a pretrained 135M model from loss 3.86 to 4.90 in 3 steps.
- LoRA/QLoRA adapters: 2e-4 (the QLoRA paper's for models up to 13B; PEFT, LLaMA-Factory and axolotl examples use
  1e-4..2e-4) and weight decay 0.0: a low-rank update starting from zero wants about 10x full fine-tuning's rate.

The Adam betas are not in the table: (0.9, 0.95) in every case, where the HF Trainer has (0.9, 0.999). beta2 0.95
lets the second-moment estimate follow a change in gradient scale within ~20 steps rather than ~1000, which is the
safer side for a fine-tune too, and tiny-sft.yaml and tiny-lora-sft.yaml, which set the learning rate and weight
decay but not the betas, were measured with it. A value the recipe or a flag sets always wins, and so does one the
DeepSpeed config's optimizer block sets (ds_config adopts it, and says so).

A leaf beside config/train_config.py (it imports only lora_options), so the schema's defaults come from this table.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from zero_recipes.config import lora_options


@dataclass(frozen=True)
class Defaults:
    learning_rate: float
    weight_decay: float
    trained: str
    """What is trained, as the launch's note and the loss-rise warning name it."""


FROM_SCRATCH = Defaults(2e-3, 0.1, "training from scratch")
FULL_FINE_TUNING = Defaults(2e-5, 0.0, "full fine-tuning of a pretrained checkpoint")
ADAPTERS = Defaults(2e-4, 0.0, "training LoRA/QLoRA adapters on a pretrained checkpoint")
TABLE = {"from scratch": FROM_SCRATCH, "full fine-tuning": FULL_FINE_TUNING, "LoRA/QLoRA": ADAPTERS}
FIELDS = ("learning_rate", "weight_decay")


def loads_pretrained(cfg) -> bool:
    """The model starts from a checkpoint's weights: model.build_model loads `model_name_or_path` only when no
    `model_config` is given; with one (which overrides that model's config) it initialises randomly."""
    return bool(cfg.model_name_or_path) and cfg.model_config is None


def defaults_for(cfg) -> Defaults:
    """The row of the table for what `cfg` trains. LoRA always adapts a pretrained base (lora_options refuses a
    random one; a dry run's --model_config only stands in for the base's architecture)."""
    if lora_options.enabled(cfg):
        return ADAPTERS
    return FULL_FINE_TUNING if loads_pretrained(cfg) else FROM_SCRATCH


def why(cfg) -> str:
    """What is trained, in words a launch prints: the table's row and, for a random init, where it comes from."""
    row = defaults_for(cfg)
    if row is not FROM_SCRATCH:
        return row.trained
    if cfg.model_name_or_path:
        return (
            f"{row.trained}: --model_config overrides the config of {cfg.model_name_or_path}, so its weights are "
            "randomly initialised, not loaded"
        )
    if cfg.model_config is not None:
        return f"{row.trained}: --model_config builds a randomly initialised model"
    return f"{row.trained}: the embedded tiny Llama, randomly initialised"


def apply(cfg, explicit: set[str]):
    """`cfg` with each of FIELDS the recipe and flags left unset taken from the table (a new config)."""
    row = defaults_for(cfg)
    unset = {name: getattr(row, name) for name in FIELDS if name not in explicit}
    return dataclasses.replace(cfg, **unset)


def note(cfg, explicit: set[str]) -> tuple[str, ...]:
    """The launch's line on the defaults it took, or none when the recipe and flags set both. `cfg` is the resolved
    config: a value adopted from the DeepSpeed config's optimizer block is not a default, and its own note says so."""
    row = defaults_for(cfg)
    taken = [name for name in FIELDS if name not in explicit and getattr(cfg, name) == getattr(row, name)]
    if not taken:
        return ()
    values = ", ".join(f"{name} {getattr(cfg, name)!r}" for name in taken)
    flags = ", ".join(f"--{name}" for name in taken)
    several = len(taken) > 1
    return (
        f"{values} ({'defaults' if several else 'default'} for {why(cfg)}; {flags} to set {'them' if several else 'it'})",
    )


def help_default(name: str) -> str | None:
    """`--help`'s default for a field of the table: every row's value."""
    if name not in FIELDS:
        return None
    return "by what is trained: " + ", ".join(f"{getattr(row, name)!r} {case}" for case, row in TABLE.items())
