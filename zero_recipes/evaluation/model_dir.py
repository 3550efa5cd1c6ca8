"""What the tools that read a finished run accept as a model: an HF model directory (a train.py output_dir,
tools/export_hf.py's output) or a PEFT adapter directory; a run that stopped before its export is named as
such, with the command that exports it."""

from __future__ import annotations

from pathlib import Path

from zero_recipes.adapters.lora import is_adapter_dir
from zero_recipes.checkpointing.checkpoint import find_checkpoint

from ..errors import ConfigError

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


def load(d: Path):
    """(model, tokenizer) as a user loads them: on the GPU in the saved dtype if there is one, else on the CPU
    in fp32 (CPU bf16/fp16 kernels are slow or missing); a LoRA adapter onto the base it names (peft)."""
    import torch
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from zero_recipes.adapters.lora import load_for_inference

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "auto" if device == "cuda" else torch.float32
    try:
        tok = AutoTokenizer.from_pretrained(d)
        if is_adapter_dir(d):
            model = load_for_inference(d, dtype, as_trained=False)
        else:
            model = AutoModelForCausalLM.from_pretrained(d, dtype=dtype)
    except (OSError, ValueError, SafetensorError) as e:
        raise ConfigError(
            f"cannot load the model in {d}: {str(e).splitlines()[0]}; check that it is a complete HF model "
            "directory, or export the run's checkpoint again with tools/export_hf.py"
        ) from None
    return model.to(device).eval(), tok
