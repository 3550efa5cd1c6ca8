"""ds_configs/muon.json and a hand-written Muon block through the intake (intake._resolve_muon): the "auto"s
filled from the recipe, what ZeRO-3 needs set (reduce_scatter false, with a note), and the two settings DeepSpeed
0.19.8 cannot run with Muon refused in one line: reduce_scatter at ZeRO-3, clipping at ZeRO-1/2/3
(docs/dev/deepspeed-bugs.md#muon). Muon with qgZ is checks.py's refusal."""

import pytest

from helpers import refusal
from zero_recipes.config.cli import parse_args
from zero_recipes.config.train_config import ConfigError
from zero_recipes.ds.intake import load_fragments, resolve, with_steps


def resolved(stage: int, *argv, block: dict | None = None, zero: dict | None = None):
    """(ds, notes, adopted config) for zeroN.json + muon.json (or + `block` as the optimizer), 2 ranks."""
    cfg, explicit = parse_args([*argv, "--deepspeed", f"ds_configs/zero{stage}.json"])
    raw = load_fragments([f"ds_configs/zero{stage}.json"] + ([] if block else ["ds_configs/muon.json"]))
    if block:
        raw["optimizer"] = block
    raw["zero_optimization"].update(zero or {})
    r = resolve(raw, cfg, explicit, world_size=2, hidden_size=64)
    return with_steps(r.ds, r.cfg, 10), r.notes, r.cfg


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_fragment_fills_its_autos_from_the_recipe_on_every_stage(stage):
    ds, notes, cfg = resolved(stage, "--learning_rate", "1e-3", "--weight_decay", "0.1", "--adam_epsilon", "1e-6")
    assert ds["optimizer"] == {"type": "Muon", "params": {
        "lr": 1e-3, "adam_lr": 1e-3, "muon_lr": 0.02, "momentum": 0.95, "weight_decay": 0.1,
        "betas": [cfg.adam_beta1, cfg.adam_beta2], "eps": 1e-6}}  # fmt: skip
    # clipping off, adopted into the recipe with a note (not refused: the user never asked for 1.0)
    assert ds["gradient_clipping"] == 0 and cfg.max_grad_norm == 0
    assert any("adopted max_grad_norm=0" in n for n in notes)
    said = [n for n in notes if "reduce_scatter" in n]
    shipped = load_fragments([f"ds_configs/zero{stage}.json"])["zero_optimization"].get("reduce_scatter")
    assert ds["zero_optimization"].get("reduce_scatter") is (False if stage == 3 else shipped)
    assert len(said) == (stage == 3), notes


def test_a_hand_written_block_at_zero3_gets_reduce_scatter_off_and_its_autos_filled():
    block = {"type": "muon", "params": {"lr": "auto", "muon_lr": "auto", "adam_lr": "auto"}}
    ds, notes, _ = resolved(3, "--learning_rate", "2e-3", "--max_grad_norm", "0", block=block)
    p = ds["optimizer"]["params"]
    assert p["lr"] == p["muon_lr"] == p["adam_lr"] == 2e-3
    assert ds["zero_optimization"]["reduce_scatter"] is False
    assert any("reduce_scatter=false" in n and "Muon" in n for n in notes)


def test_reduce_scatter_false_given_at_zero3_is_kept_without_a_note():
    ds, notes, _ = resolved(3, zero={"reduce_scatter": False})
    assert ds["zero_optimization"]["reduce_scatter"] is False and not [n for n in notes if "reduce_scatter" in n]


def test_reduce_scatter_true_with_muon_at_zero3_is_refused_naming_the_fix():
    with pytest.raises(ConfigError) as e:
        resolved(3, zero={"reduce_scatter": True})
    msg = str(e.value)
    assert "\n" not in msg and "Muon and reduce scatter cannot be used together" in msg
    assert 'set "reduce_scatter": false' in msg


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_clipping_with_muon_is_refused_where_deepspeed_clips_the_update(stage):
    block = {"type": "Muon", "params": {"lr": "auto"}}  # gradient_clipping "auto": the recipe's 1.0
    with pytest.raises(ConfigError) as e:
        resolved(stage, block=block)
    msg = str(e.value)
    assert f"gradient_clipping 1 with the Muon optimizer at ZeRO-{stage}" in msg and "deepspeed#8439" in msg
    assert "set gradient_clipping 0 (--max_grad_norm 0)" in msg and "\n" not in msg


def test_clipping_with_muon_at_zero0_is_kept():
    ds, _, _ = resolved(0, block={"type": "Muon", "params": {"lr": "auto"}})
    assert ds["gradient_clipping"] == 1.0  # ZeRO-0 clips the gradients before Muon's step, as torch does


def test_the_fragment_with_an_explicit_max_grad_norm_is_a_contradiction_train_py_prints_in_one_line():
    line = refusal("--deepspeed", "ds_configs/zero3.json", "ds_configs/muon.json", "--max_grad_norm", "1.0")
    assert "gradient_clipping=0 but max_grad_norm=1.0" in line, line
