"""How the model is adapted for training: the interface, and full fine-tuning as its plain case.

An adapter (this class; lora.Lora and lora.QLora) is chosen once from the config (modes.adapter_for) and asked,
in the order a run goes:

    check(model_config)                   before any process group: what this model cannot take
    load_kwargs(dtype)                    extra from_pretrained arguments (QLoRA: the 4-bit base)
    wrap(model, log)                      after the model is built, before DeepSpeed: the trainable module
    files_writer(engine, tokenizer)       what each checkpoint carries besides DeepSpeed's files
    export(engine, tokenizer, out, rank, dtype, log)     output_dir becomes what a user loads
    reload(out, dtype)                    that export loaded as a user loads it (the export check)
    resume_refusal(saved, ranks)          why a checkpoint of another layout cannot resume, or None

What a checkpoint keeps follows from the module itself: frozen parameters are left out
(checkpoint.has_frozen). Which adapters combine with which axes and ZeRO stages is combinations.py's table.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from zero_recipes.checkpointing import export as exporting


class FullFineTuning:
    def __init__(self, cfg):
        self.cfg = cfg

    def check(self, model_config) -> None:
        pass

    def load_kwargs(self, dtype) -> dict:
        return {}

    def wrap(self, model, log):
        return model

    def files_writer(self, engine, tokenizer):
        return exporting.hf_files_writer(engine.module.config, tokenizer)

    def export(self, engine, tokenizer, out_dir: Path, rank: int, dtype, log) -> None:
        exporting.export_hf_model(engine, tokenizer, out_dir, rank)
        log(f"export: AutoModelForCausalLM.from_pretrained('{out_dir}') loads the trained model")

    def reload(self, out_dir: Path, dtype):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(out_dir, dtype=dtype).eval()

    def resume_refusal(self, saved: dict, ranks: str) -> Optional[str]:
        return None
