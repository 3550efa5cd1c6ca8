"""What the tools that read a finished run accept as a model: an HF model directory (a train.py output_dir,
tools/export_hf.py's output) or a PEFT adapter directory; a run that stopped before its export is named as
such, with the command that exports it."""

from __future__ import annotations

from pathlib import Path

from ..checkpoint import find_checkpoint
from ..errors import ConfigError
from ..lora import is_adapter_dir

WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def check_model_dir(d: Path, then: str = "generate from") -> None:
    """A ConfigError naming what `d` is instead, and the fix. `then`: the tool's verb in that fix."""
    if not d.is_dir():
        raise ConfigError(f"{d} is not a directory; give a finished train.py --output_dir or an HF model directory")
    if is_adapter_dir(d) and (d / "adapter_model.safetensors").is_file():
        return
    if not (d / "config.json").is_file() or not any((d / w).is_file() for w in WEIGHTS):
        # the checkpoint lookup export_hf.py and resume use: an output_dir, its checkpoints/ or a step-N
        found = find_checkpoint(d)
        if found is not None:
            run = d.parent.parent if d.parent.name == "checkpoints" else d.parent if d.name == "checkpoints" else d
            raise ConfigError(
                f"{d} holds DeepSpeed checkpoints but no exported model (a run stopped before its "
                f"export, or a checkpoint directory); export one with `python tools/export_hf.py {d} "
                f"{run}-hf`, then {then} {run}-hf"
            )
        raise ConfigError(
            f"{d} holds no HF model (config.json and weights); give a finished train.py --output_dir "
            "or a directory written by tools/export_hf.py"
        )
    if not (d / "tokenizer_config.json").is_file() and not (d / "tokenizer.json").is_file():
        raise ConfigError(f"{d} has a model but no tokenizer; save the tokenizer there with tokenizer.save_pretrained")
