"""ds_configs/bf16_states.json and autocast.json through the intake (ds/precision_blocks.py): what they resolve to,
the precision in words, and every combination DeepSpeed 0.19.8 asserts against (inside deepspeed.initialize, on
every rank) or silently ignores, refused in one line before any process group."""

import pytest

from helpers import refusal
from zero_recipes.config.cli import parse_args
from zero_recipes.config.train_config import ConfigError
from zero_recipes.ds.facts import precision, precision_words, state_bytes
from zero_recipes.ds.intake import load_fragments, resolve, with_steps


def resolved(*fragments: str, extra: dict | None = None):
    """(ds, notes) of ds_configs/FRAGMENTS merged (and `extra` merged over them), 2 ranks."""
    paths = [f"ds_configs/{f}" for f in fragments]
    cfg, explicit = parse_args(["--deepspeed", *paths])
    raw = load_fragments(paths)
    for key, value in (extra or {}).items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    r = resolve(raw, cfg, explicit, world_size=2, hidden_size=64)
    return with_steps(r.ds, r.cfg, 10), r.notes


@pytest.mark.parametrize("zero", ["zero1.json", "zero2.json", "zero3.json"])
def test_bf16_states_on_every_zero_stage(zero):
    ds, notes = resolved(zero, "bf16_states.json")
    assert ds["bf16"] == {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    assert precision(ds) == "bf16" and state_bytes(ds) == (2, 2)
    assert "precision: bf16 with bf16 master weights and optimizer states" in notes
    assert "optimizer" not in ds  # without offload train.py's own torch AdamW makes bf16 moments of bf16 masters


@pytest.mark.parametrize("fragments", [("zero2.json", "offload_optimizer.json"), ("zero3.json", "offload_all.json")])
def test_bf16_states_with_offload_have_deepspeed_build_its_cpu_adam_from_the_recipe(fragments):
    """DeepSpeed asserts DeepSpeedCPUAdam with fp32_optimizer_states=False; train.py's own is built with fp32 moments,
    so an optimizer block makes DeepSpeed build it (it forces bf16 moments under bf16_optimizer_states)."""
    ds, notes = resolved(*fragments, "bf16_states.json")
    cfg, _ = parse_args(["--deepspeed", "ds_configs/zero2.json"])
    assert ds["optimizer"] == {"type": "AdamW", "params": {
        "lr": cfg.learning_rate, "betas": [cfg.adam_beta1, cfg.adam_beta2], "eps": cfg.adam_epsilon,
        "weight_decay": cfg.weight_decay}}  # fmt: skip
    assert any(n.startswith("optimizer: DeepSpeed builds its DeepSpeedCPUAdam") for n in notes)


def test_bf16_master_weights_alone_with_offload_keep_fp32_moments():
    ds, notes = resolved("zero2.json", "offload_optimizer.json", "bf16.json",
                         extra={"bf16": {"bf16_master_weights_and_grads": True}})  # fmt: skip
    assert state_bytes(ds) == (2, 4) and "optimizer" not in ds
    assert precision_words(ds) == "bf16 with bf16 master weights and gradients, fp32 optimizer states"


@pytest.mark.parametrize("zero", ["zero0.json", "zero3.json"])
def test_autocast_keeps_fp32_parameters(zero):
    ds, notes = resolved(zero, "autocast.json")
    assert ds["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}
    assert precision(ds) == "fp32" and state_bytes(ds) == (4, 4)
    assert "precision: bf16 autocast, fp32 parameters and master weights" in notes


@pytest.mark.parametrize("given,filled", [("auto", "bfloat16"), ("bf16", "bfloat16"), ("torch.float16", "float16")])
def test_autocast_dtype_spellings_and_auto(given, filled):
    ds, _ = resolved("zero2.json", extra={"torch_autocast": {"enabled": True, "dtype": given}})
    assert ds["torch_autocast"]["dtype"] == filled


REFUSED = [
    # DeepSpeed's config asserts: ZeRO 1-3 only
    (("zero0.json", "bf16_states.json"), {}, "needs ZeRO stage 1, 2 or 3"),
    # DeepSpeed's config asserts: optimizer states need master weights
    (("zero2.json", "bf16.json"), {"bf16": {"bf16_optimizer_states": True}}, "needs bf16.bf16_master_weights_and_grads"),
    # base_optimizer asserts ZeRO-Offload with DeepSpeedCPUAdam
    (("zero2.json", "bf16.json"), {"bf16": {"bf16_master_weights_and_grads": True}}, "needs optimizer offload"),
    # not bf16 training: DeepSpeed would make bf16 masters of fp32 parameters
    (("zero2.json", "bf16_states.json"), {"bf16": {"enabled": False}}, "bf16 is not enabled"),
    (("zero2.json", "bf16_states.json", "offload_optimizer.json"),
     {"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}, "remove torch_adam"),
    (("zero2.json", "bf16_states.json"), {"bf16": {"bf16_optimizer_states": "auto"}}, "has no recipe setting"),
    # autocast over 16-bit parameters: its fp32 masters are gone
    (("zero2.json", "autocast.json", "bf16.json"), {}, "torch_autocast is enabled together with bf16.enabled"),
    (("zero2.json",), {"torch_autocast": {"enabled": True, "dtype": "float32"}}, "float32 is no autocast"),
    # DeepSpeed reads the block key by key: a misspelt one would be ignored
    (("zero2.json", "autocast.json"), {"torch_autocast": {"lower_precision_modules": []}}, "does not read"),
    (("zero2.json", "autocast.json"), {"torch_autocast": {"lower_precision_safe_modules": ["torch.nn.Linearr"]}},
     "cannot import 'torch.nn.Linearr'"),
    (("zero3.json", "autocast.json"), {"zero_optimization": {"zero_quantized_weights": True}}, "asserts against"),
]  # fmt: skip


@pytest.mark.parametrize("fragments,extra,says", REFUSED, ids=[r[2] for r in REFUSED])
def test_what_deepspeed_rejects_or_ignores_is_refused_in_one_line(fragments, extra, says):
    with pytest.raises(ConfigError) as e:
        resolved(*fragments, extra=extra)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_train_py_refuses_before_any_process_group():
    line = refusal("--deepspeed", "ds_configs/zero0.json", "ds_configs/bf16_states.json", world=2)
    assert line.startswith("error: bf16.bf16_master_weights_and_grads needs ZeRO stage 1, 2 or 3"), line
