"""Where an estimate's precision comes from, in words: the single estimate's note and the table's first line.

train.py trains in what the DeepSpeed config (or the recipe's bf16:/fp16:) enables; the shipped ZeRO fragments
say "auto", which with nothing else set means fp32 (ds_config._resolve_precision). That is 2x the model states of
bf16, and a model's config.json saying torch_dtype bfloat16 does not change it, so the estimate says which it took.
"""

from __future__ import annotations

FP32_ASSUMED = 'precision: fp32 assumed (nothing enables bf16/fp16: "auto" is fp32); add ds_configs/bf16.json for bf16'


def assumed_fp32(raw: dict, cfg) -> bool:
    """Nothing chose a precision: every bf16/fp16 block of the merged fragments says "auto", the recipe neither."""
    blocks = (raw.get(k, {}) for k in ("bf16", "fp16"))
    return all(b.get("enabled", "auto") == "auto" for b in blocks) and cfg.bf16 is None and cfg.fp16 is None


def statement(precision: str, assumed: bool, files: list[str], model_config, words: str = "") -> str:
    """One line: the precision the estimate used and what set it (the last --deepspeed file whose bf16/fp16
    block says so, else the recipe), or that fp32 was `assumed` (`assumed_fp32`); when the model's own torch_dtype differs from an
    assumed fp32, that too, since it is the likeliest reason to expect otherwise."""
    from zero_recipes.ds.intake import load_fragments

    if assumed:
        stored = str(getattr(model_config, "dtype", None) or getattr(model_config, "torch_dtype", "") or "")
        stored = stored.removeprefix("torch.")
        if stored in ("bfloat16", "float16"):
            return f"{FP32_ASSUMED} (the model's torch_dtype {stored} is how its weights are stored, not trained)"
        return FP32_ASSUMED
    setters = [f for f in files if _sets(load_fragments([f]), precision)]
    recipe = f"the recipe's {precision}: true" if precision != "fp32" else "the recipe's bf16/fp16: false"
    # `words`: ds.facts.precision_words, where the dtype alone misleads (torch_autocast, bf16 optimizer states)
    return f"precision: {words or precision} ({f'set by {setters[-1]}' if setters else recipe})"


def _sets(fragment: dict, precision: str) -> bool:
    """The fragment decides this precision: enables it, or (fp32) disables a 16-bit block."""
    enabled = [(fragment.get(k) or {}).get("enabled", "auto") for k in ("bf16", "fp16")]
    if precision == "fp32":
        return False in enabled
    return enabled[("bf16", "fp16").index(precision)] is True
