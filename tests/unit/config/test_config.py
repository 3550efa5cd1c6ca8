"""The config schema: recipes, flags, booleans, unknown keys, model_config."""

import json

import pytest

from zero_recipes.config.cli import parse_args
from zero_recipes.config.train_config import ConfigError, TrainConfig, parse_model_config

DS = ["--deepspeed", "ds_configs/zero2.json"]


def test_flags_override_recipe_and_defaults(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("learning_rate: 1.0e-4\nper_device_train_batch_size: 3\nmax_steps: 7\n")
    cfg, explicit = parse_args(["--recipe", str(recipe), "--max_steps", "9", *DS])
    assert (cfg.learning_rate, cfg.per_device_train_batch_size, cfg.max_steps) == (1e-4, 3, 9)
    assert cfg.weight_decay == TrainConfig().weight_decay  # untouched default
    assert {"learning_rate", "per_device_train_batch_size", "max_steps", "deepspeed"} <= explicit
    assert "weight_decay" not in explicit


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--gradient_checkpointing"], True),
        (["--gradient_checkpointing", "true"], True),
        (["--gradient_checkpointing", "false"], False),
        (["--gradient_checkpointing=False"], False),
        ([], False),
    ],
)
def test_booleans_as_hf_argument_parser(argv, expected):
    cfg, _ = parse_args(argv + DS)
    assert cfg.gradient_checkpointing is expected


def test_bad_boolean_names_the_flag():
    with pytest.raises(ConfigError, match="--bf16 expects true or false"):
        parse_args(["--bf16", "maybe", *DS])


def test_unknown_flag_suggests_nearest():
    with pytest.raises(ConfigError, match="unknown option 'lerning_rate'.*did you mean 'learning_rate'"):
        parse_args(["--lerning_rate", "1e-3", *DS])


def test_unknown_recipe_key_suggests_nearest(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("per_device_train_batchsize: 4\n")
    with pytest.raises(ConfigError, match="recipe .*did you mean 'per_device_train_batch_size'"):
        parse_args(["--recipe", str(recipe), *DS])


def test_deepspeed_takes_several_fragments_and_local_rank_is_accepted():
    cfg, _ = parse_args(["--deepspeed", "ds_configs/zero3.json", "ds_configs/bf16.json", "--local_rank=1"])
    assert cfg.deepspeed == ["ds_configs/zero3.json", "ds_configs/bf16.json"]


def test_type_errors_name_the_field():
    with pytest.raises(ConfigError, match="--max_steps expects int"):
        parse_args(["--max_steps", "ten", *DS])


def test_fp16_and_bf16_together_refused():
    with pytest.raises(ConfigError, match="bf16 and fp16 are both on"):
        parse_args(["--bf16", "--fp16", *DS])


def test_model_config_inline_file_and_yaml(tmp_path):
    assert parse_model_config('{"num_hidden_layers": 2}') == {"num_hidden_layers": 2}
    j = tmp_path / "m.json"
    j.write_text(json.dumps({"model_type": "gpt2", "n_layer": 1}))
    assert parse_model_config(str(j)) == {"model_type": "gpt2", "n_layer": 1}
    y = tmp_path / "m.yaml"
    y.write_text("hidden_size: 64\n")
    assert parse_model_config(str(y)) == {"hidden_size": 64}
    with pytest.raises(ConfigError, match="inline JSON is invalid at column"):
        parse_model_config('{"a": }')
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "a": 1,\n}')
    with pytest.raises(ConfigError, match=r"bad.json:3:1: invalid JSON"):
        parse_model_config(str(bad))


def test_accelerate_launch_passes_its_deepspeed_json_and_precision(monkeypatch):
    """`accelerate launch` with a DeepSpeed accelerate config: its JSON and mixed_precision reach train.py
    through the environment, and anything on the command line or in a recipe wins over them."""
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "ds_configs/zero3.json")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    cfg, explicit = parse_args([])
    assert cfg.deepspeed == ["ds_configs/zero3.json"] and cfg.bf16 is True and "bf16" in explicit
    cfg, _ = parse_args(["--deepspeed", "ds_configs/zero2.json", "--fp16", "false"])
    assert cfg.deepspeed == ["ds_configs/zero2.json"] and cfg.bf16 is None and cfg.fp16 is False
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")  # plain accelerate (DDP): nothing is taken
    with pytest.raises(ConfigError, match="no DeepSpeed config given"):
        parse_args([])
