"""The learning rate and weight decay a run takes when the recipe and flags leave them unset: by what is trained
(zero_recipes/config/lr_defaults.py), said at launch, recorded in the run signature; a value someone set always wins."""

from pathlib import Path

import pytest
import yaml

from helpers import dry_run_in_process
from zero_recipes.config.cli import help_text, parse_args
from zero_recipes.plan import RunPlan

REPO = Path(__file__).resolve().parents[3]
DS = ["--deepspeed", "ds_configs/zero3.json"]
PRETRAINED = ["--model_name_or_path", "org/model"]  # parse_args reads no model: any name classifies


def optimizer(cfg) -> tuple:
    return cfg.learning_rate, cfg.weight_decay, cfg.adam_beta1, cfg.adam_beta2


@pytest.mark.parametrize(
    "argv, expected",
    [
        ([], (2e-3, 0.1, 0.9, 0.95)),  # the quick start: the embedded tiny Llama from scratch, as before
        (["--model_config", '{"model_type": "gpt2", "n_layer": 2}'], (2e-3, 0.1, 0.9, 0.95)),
        (PRETRAINED + ["--model_config", '{"num_hidden_layers": 2}'], (2e-3, 0.1, 0.9, 0.95)),  # random init
        (PRETRAINED, (2e-5, 0.0, 0.9, 0.95)),
        (PRETRAINED + ["--lora_r", "16"], (2e-4, 0.0, 0.9, 0.95)),
        (
            PRETRAINED + ["--lora_r", "16", "--load_in_4bit", "--deepspeed", "ds_configs/zero2.json"],
            (2e-4, 0.0, 0.9, 0.95),
        ),
    ],
    ids=["embedded", "model-type", "override-of-pretrained", "full-fine-tuning", "lora", "qlora"],
)
def test_unset_values_follow_what_is_trained(argv, expected):
    cfg, explicit = parse_args(DS + argv)
    assert optimizer(cfg) == expected
    assert not {"learning_rate", "weight_decay"} & explicit  # still the user's to set: a default, not a choice


def test_a_flag_or_a_recipe_value_wins_field_by_field(tmp_path):
    cfg, _ = parse_args(DS + PRETRAINED + ["--learning_rate", "1e-3", "--adam_beta2", "0.99"])
    assert optimizer(cfg) == (1e-3, 0.0, 0.9, 0.99)  # weight decay left unset: the fine-tuning default
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model_name_or_path: org/model\nlearning_rate: 3.0e-3\nweight_decay: 0.1\n")
    cfg, _ = parse_args(DS + ["--recipe", str(recipe)])
    assert optimizer(cfg) == (3e-3, 0.1, 0.9, 0.95)
    cfg, _ = parse_args(DS + ["--recipe", str(recipe), "--weight_decay", "0.01"])
    assert optimizer(cfg) == (3e-3, 0.01, 0.9, 0.95)


@pytest.mark.parametrize("path", sorted((REPO / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_trains_with_its_own_values(path):
    """Every recipe sets its learning rate; the four tiny ones leave the betas (and tiny-longctx-sp2 the weight
    decay) unset, and keep what they were measured with: betas (0.9, 0.95), and a from-scratch 0.1."""
    recipe = yaml.safe_load(path.read_text())
    cfg, _ = parse_args(["--recipe", str(path)])
    want = (
        recipe["learning_rate"],
        recipe.get("weight_decay", 0.1),
        recipe.get("adam_beta1", 0.9),
        recipe.get("adam_beta2", 0.95),
    )
    assert optimizer(cfg) == want


def pretrained_dir(tmp_path) -> str:
    """A model directory with a config (all a plan reads of a pretrained model before loading it)."""
    from transformers import LlamaConfig

    fields = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=4096)
    LlamaConfig(**fields).save_pretrained(tmp_path / "model")
    return str(tmp_path / "model")


def test_the_launch_names_the_default_and_the_signature_records_it(tmp_path):
    model = pretrained_dir(tmp_path)
    plan = RunPlan.from_args(DS + ["--model_name_or_path", model])
    assert (
        "learning_rate 2e-05, weight_decay 0.0 (defaults for full fine-tuning of a pretrained checkpoint; "
        "--learning_rate, --weight_decay to set them)"
    ) in plan.notes
    assert (plan.signature["learning_rate"], plan.signature["weight_decay"]) == (2e-5, 0.0)  # run_config.json
    lora = RunPlan.from_args(DS + ["--model_name_or_path", model, "--lora_r", "8", "--learning_rate", "1e-4"])
    assert (
        "weight_decay 0.0 (default for training LoRA/QLoRA adapters on a pretrained checkpoint; --weight_decay to set it)"
        in lora.notes
    )
    assert lora.signature["learning_rate"] == 1e-4
    chosen = RunPlan.from_args(DS + ["--model_name_or_path", model, "--learning_rate", "1e-5", "--weight_decay", "0"])
    assert not [n for n in chosen.notes if "default for" in n or "defaults for" in n]  # nothing to say


def test_a_value_the_deepspeed_file_sets_is_adopted_not_called_a_default(tmp_path):
    ds = tmp_path / "opt.json"
    ds.write_text('{"optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": "auto"}}}')
    plan = RunPlan.from_args(DS + [str(ds), "--model_name_or_path", pretrained_dir(tmp_path)])
    assert plan.cfg.learning_rate == 1e-4 and plan.ds["optimizer"]["params"]["weight_decay"] == 0.0
    assert "adopted learning_rate=0.0001 (from the DeepSpeed config's optimizer.params.lr)" in plan.notes
    assert (
        "weight_decay 0.0 (default for full fine-tuning of a pretrained checkpoint; --weight_decay to set it)"
        in plan.notes
    )


def test_dry_run_prints_the_default_it_took(tmp_path):
    quick_start = dry_run_in_process(*DS)
    assert (
        "note: learning_rate 0.002, weight_decay 0.1 (defaults for training from scratch: the embedded tiny Llama, "
        "randomly initialised; --learning_rate, --weight_decay to set them)"
    ) in quick_start.splitlines()
    override = dry_run_in_process(*DS, "--model_name_or_path", pretrained_dir(tmp_path), "--model_config", "{}")
    assert "overrides the config of" in override and "so its weights are randomly initialised, not loaded" in override


def test_help_gives_each_case_its_default():
    text = help_text()
    assert (
        "--learning_rate (default: by what is trained: 0.002 from scratch, 2e-05 full fine-tuning, 0.0002 LoRA/QLoRA)"
        in text
    )
    assert (
        "--weight_decay (default: by what is trained: 0.1 from scratch, 0.0 full fine-tuning, 0.0 LoRA/QLoRA)" in text
    )
