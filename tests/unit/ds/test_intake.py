"""DeepSpeed JSON: fragment merging and "auto" resolution with the HF Trainer's semantics."""

import json

import pytest

from zero_recipes.config.cli import parse_args
from zero_recipes.config.train_config import ConfigError
from zero_recipes.ds.intake import deep_merge, load_fragments, resolve, with_steps


def cfg_for(*argv):
    return parse_args(list(argv) + ["--deepspeed", "ds_configs/zero3.json"])


def resolve_all(raw, cfg, explicit, world_size, hidden_size, total_steps):
    """What a launch does: resolve, then fill the step counts. Returns (ds, notes, adopted config)."""
    r = resolve(raw, cfg, explicit, world_size, hidden_size)
    return with_steps(r.ds, r.cfg, total_steps), r.notes, r.cfg


def test_fragments_merge_left_to_right():
    ds = load_fragments(["ds_configs/zero3.json", "ds_configs/offload_all.json", "ds_configs/bf16.json"])
    z = ds["zero_optimization"]
    assert z["stage"] == 3 and z["offload_param"]["device"] == "cpu" and z["offload_optimizer"]["device"] == "cpu"
    assert z["overlap_comm"] is True  # kept from zero3.json
    assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False
    assert deep_merge({"a": {"b": 1, "c": 2}}, {"a": {"c": 3}}) == {"a": {"b": 1, "c": 3}}


def test_autos_resolved_like_hf_trainer():
    cfg, explicit = cfg_for(
        "--per_device_train_batch_size",
        "3",
        "--gradient_accumulation_steps",
        "5",
        "--max_grad_norm",
        "0.5",
        "--learning_rate",
        "1e-4",
        "--weight_decay",
        "0.01",
        "--adam_beta2",
        "0.999",
        "--adam_epsilon",
        "1e-6",
        "--bf16",
        "--warmup_ratio",
        "0.1",
    )
    raw = load_fragments(["ds_configs/zero3.json"])
    raw["optimizer"] = {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    }
    raw["scheduler"] = {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    }
    ds, _, _ = resolve_all(raw, cfg, explicit, world_size=4, hidden_size=100, total_steps=200)
    assert ds["train_micro_batch_size_per_gpu"] == 3 and ds["gradient_accumulation_steps"] == 5
    assert ds["train_batch_size"] == 3 * 5 * 4
    assert ds["gradient_clipping"] == 0.5
    assert ds["optimizer"]["params"] == {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-6, "weight_decay": 0.01}
    assert ds["scheduler"]["params"] == {
        "warmup_min_lr": 0,
        "warmup_max_lr": 1e-4,
        "warmup_num_steps": 20,
        "total_num_steps": 200,
    }
    assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False
    z = ds["zero_optimization"]
    assert z["reduce_bucket_size"] == 100 * 100
    assert z["stage3_prefetch_bucket_size"] == 9000
    assert z["stage3_param_persistence_threshold"] == 1000
    assert "auto" not in json.dumps(ds)


def test_explicit_contradiction_names_both_values():
    cfg, explicit = cfg_for("--per_device_train_batch_size", "8", "--learning_rate", "1e-3")
    raw = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 5e-5}}}
    with pytest.raises(ConfigError) as e:
        resolve_all(raw, cfg, explicit, 2, 64, 10)
    msg = str(e.value)
    assert "train_micro_batch_size_per_gpu=4 but per_device_train_batch_size=8" in msg
    assert "optimizer.params.lr=5e-05 but learning_rate=0.001" in msg


def test_explicit_value_fills_a_field_the_recipe_left_unset():
    cfg, explicit = cfg_for()
    ds, notes, adopted = resolve_all({"train_micro_batch_size_per_gpu": 2}, cfg, explicit, 2, 64, 10)
    assert adopted.per_device_train_batch_size == 2 and ds["train_batch_size"] == 2 * 1 * 2
    assert cfg.per_device_train_batch_size == 16  # the caller's config is not changed behind its back
    assert any("per_device_train_batch_size=2" in n for n in notes)


def test_batch_arithmetic_that_does_not_add_up():
    cfg, explicit = cfg_for("--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2")
    with pytest.raises(ConfigError, match=r"train_batch_size=32 but micro 4 x accumulation 2 x data-parallel 2 = 16"):
        resolve_all({"train_batch_size": 32}, cfg, explicit, 2, 64, 10)


def test_precision_from_fragment_and_conflict():
    cfg, explicit = cfg_for()
    ds, _, adopted = resolve_all(
        load_fragments(["ds_configs/zero2.json", "ds_configs/fp16.json"]), cfg, explicit, 1, 64, 10
    )
    assert ds["fp16"]["enabled"] is True and adopted.fp16 is True and cfg.fp16 is None
    cfg, explicit = cfg_for("--bf16")
    with pytest.raises(ConfigError, match="fp16.enabled=True but fp16=False|bf16.enabled=False but bf16=True"):
        resolve_all(load_fragments(["ds_configs/zero2.json", "ds_configs/fp16.json"]), cfg, explicit, 1, 64, 10)


def test_unknown_auto_is_an_error_not_dropped():
    cfg, explicit = cfg_for()
    with pytest.raises(ConfigError, match="'zero_optimization.sub_group_size' is \"auto\""):
        resolve_all({"zero_optimization": {"stage": 3, "sub_group_size": "auto"}}, cfg, explicit, 1, 64, 10)


def test_nvme_path_from_flag(tmp_path):
    cfg, explicit = cfg_for("--nvme_path", str(tmp_path / "nvme"))
    ds, _, _ = resolve_all(load_fragments(["ds_configs/zero3.json", "ds_configs/nvme.json"]), cfg, explicit, 1, 64, 10)
    assert ds["zero_optimization"]["offload_param"]["nvme_path"] == str(tmp_path / "nvme")
    cfg, explicit = cfg_for()
    with pytest.raises(ConfigError, match="--nvme_path"):
        resolve_all(load_fragments(["ds_configs/zero3.json", "ds_configs/nvme.json"]), cfg, explicit, 1, 64, 10)


def test_malformed_json_reports_line_and_column(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "zero_optimization": {"stage": 3,}\n}')
    with pytest.raises(ConfigError, match=r"bad.json:2:36: invalid JSON"):
        load_fragments([str(bad)])
    with pytest.raises(ConfigError, match="not found; shipped in ds_configs/: .*zero3.json"):
        load_fragments(["ds_configs/nope.json"])


def test_an_optimizer_block_gets_only_the_recipe_settings_its_type_takes():
    """DeepSpeedCPULion has no eps: a Lion block given the recipe's eps stopped in deepspeed.initialize with a
    TypeError. Adam's settings reach the types that take them; an "auto" for a key the type lacks is one line."""
    cfg, explicit = cfg_for("--learning_rate", "1e-4", "--adam_epsilon", "1e-7")
    lion = {"optimizer": {"type": "Lion", "params": {"lr": "auto", "betas": "auto", "weight_decay": "auto"}}}
    params = resolve(lion, cfg, explicit, 1, 64).ds["optimizer"]["params"]
    assert params == {"lr": 1e-4, "betas": [cfg.adam_beta1, cfg.adam_beta2], "weight_decay": cfg.weight_decay}
    adamw = resolve({"optimizer": {"type": "AdamW"}}, cfg, explicit, 1, 64).ds["optimizer"]["params"]
    assert adamw["eps"] == 1e-7 and adamw["betas"] == [cfg.adam_beta1, cfg.adam_beta2]
    sgd = resolve({"optimizer": {"type": "SGD", "params": {"momentum": 0.9}}}, cfg, explicit, 1, 64)
    assert sgd.ds["optimizer"]["params"] == {"momentum": 0.9, "lr": 1e-4, "weight_decay": cfg.weight_decay}
    lion["optimizer"]["params"]["eps"] = "auto"
    with pytest.raises(ConfigError, match='optimizer.params.eps is "auto" but Lion takes no eps; delete the key'):
        resolve(lion, cfg, explicit, 1, 64)
