"""DeepSpeed's own config models decide what a DeepSpeed JSON may say: the spellings normalised, the
rejections one line each, the combinations DeepSpeed would ignore refused, the machine's limits named."""

import json
from typing import Optional

import pytest
from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from pydantic import Field

from zero_recipes.config.cli import parse_args
from zero_recipes.config.train_config import ConfigError
from zero_recipes.ds import checks as ds_checks
from zero_recipes.ds.intake import load_fragments, resolve
from zero_recipes.ds.schema import describe, names_of, normalise, validate


class FakeZero(DeepSpeedConfigModel):
    stage: int = 0
    live: int = Field(1, alias="stage3_live")
    old_live: Optional[int] = Field(None, json_schema_extra={"deprecated": True, "new_param": "live"})


class FakeZeroRenamed(DeepSpeedConfigModel):
    """FakeZero after an upgrade that renamed the alias of `live`."""

    stage: int = 0
    live: int = Field(1, alias="stage4_live")
    old_live: Optional[int] = Field(None, json_schema_extra={"deprecated": True, "new_param": "live"})


def test_the_alias_table_follows_the_models():
    for model, alias in ((FakeZero, "stage3_live"), (FakeZeroRenamed, "stage4_live")):
        for spelling in ("live", alias, "old_live"):
            ds, notes = normalise({"zero_optimization": {"stage": 3, spelling: 5}}, {"zero_optimization": model})
            assert ds == {"zero_optimization": {"stage": 3, alias: 5}}
            assert notes == (
                [] if spelling == alias else [f"renamed zero_optimization.{spelling} to zero_optimization.{alias}"]
            )


def test_every_aliased_zero_field_of_the_installed_deepspeed_is_accepted_by_both_names():
    names = names_of(DeepSpeedZeroConfig)
    aliased = {n: f.alias for n, f in DeepSpeedZeroConfig.model_fields.items() if f.alias}
    assert len(aliased) >= 8  # stage3_prefetch_bucket_size, ..., stage3_gather_16bit_weights_on_model_save
    for name, alias in aliased.items():
        assert names.canonical[name] == alias and names.canonical[alias] == alias


def test_real_spellings_normalise_to_one():
    raw = {
        "bfloat16": {"enabled": "auto"},
        "zero_optimization": {
            "stage": 3,
            "max_live_parameters": 0,
            "stage3_gather_fp16_weights_on_model_save": True,  # deprecated, replaced by gather_16bit_...
            "cpu_offload": True,  # deprecated, replaced by an offload_optimizer block (DeepSpeed's new_param_fn)
            "offload_param": {"device": "cpu"},
        },
    }
    ds, notes = normalise(raw)
    assert ds == {
        "bf16": {"enabled": "auto"},
        "zero_optimization": {
            "stage": 3,
            "stage3_max_live_parameters": 0,
            "stage3_gather_16bit_weights_on_model_save": True,
            "offload_optimizer": {"device": "cpu"},
            "offload_param": {"device": "cpu"},
        },
    }
    assert len(notes) == 4 and raw["zero_optimization"]["max_live_parameters"] == 0  # the input is not changed


def test_two_spellings_of_one_key():
    same = {"zero_optimization": {"stage3_max_live_parameters": 10, "max_live_parameters": 10}}
    ds, notes = normalise(same)
    assert ds["zero_optimization"] == {"stage3_max_live_parameters": 10} and "repeats" in notes[0]
    with pytest.raises(ConfigError, match="two names for one DeepSpeed setting"):
        normalise({"zero_optimization": {"stage3_max_live_parameters": 10, "max_live_parameters": 0}})
    with pytest.raises(ConfigError, match='keep only "bf16"'):
        normalise({"bf16": {"enabled": True}, "bfloat16": {"enabled": False}})
    assert normalise({"zero_optimization": True})[0] == {"zero_optimization": {"stage": 1}}


def test_field_names_resolve_to_the_same_config_as_stage3_names():
    """The estimator and the engine read the resolved dict: an axolotl-style file means what it says there."""
    cfg, explicit = parse_args(["--deepspeed", "ds_configs/zero3.json"])
    ours = load_fragments(["ds_configs/zero3.json"])
    theirs = json.loads(json.dumps(ours))
    z = theirs["zero_optimization"]
    for key in ("max_live_parameters", "max_reuse_distance", "gather_16bit_weights_on_model_save"):
        z[key] = z.pop(f"stage3_{key}")
    assert resolve(theirs, cfg, explicit, 2, 64).ds == resolve(ours, cfg, explicit, 2, 64).ds


def rejection(ds, sized=frozenset()):
    with pytest.raises(ConfigError) as e:
        validate(ds, sized)
    return str(e.value)


def test_rejections_name_the_key_the_value_and_the_fix():
    msg = rejection(
        {"zero_optimization": {"stage": 2, "reduce_bucket_size": 0}}, {"zero_optimization.reduce_bucket_size"}
    )
    assert msg.endswith('zero_optimization.reduce_bucket_size = 0 must be > 0 (set a size, or "auto")')
    assert "must be one of 0, 1, 2 or 3 (use one of those)" in rejection({"zero_optimization": {"stage": 5}})
    msg = rejection({"zero_optimization": {"stage": 2, "overlap_com": True}, "fp16": {"enabled": "maybe"}})
    assert "zero_optimization.overlap_com is not a key DeepSpeed reads there (did you mean 'overlap_comm'?)" in msg
    assert "fp16.enabled = 'maybe' must be true or false" in msg  # every rejection, in one line
    assert "it is a fp16 setting" in rejection({"bf16": {"enabled": True, "loss_scale": 0}})
    assert "Sparse Attention has been removed" in rejection(
        {"train_micro_batch_size_per_gpu": 1, "sparse_attention": {}}
    )
    assert "\n" not in msg


def test_describe_keeps_unknown_error_kinds_readable():
    err = {"type": "value_error", "loc": ("x",), "input": 3, "msg": "Value error, x must be odd"}
    assert describe(err, "compile", None, frozenset()) == "compile.x = 3 x must be odd (fix the value)"


ZERO = {"train_micro_batch_size_per_gpu": 1}


@pytest.mark.parametrize(
    "ds,words",
    [
        ({"zero_optimization": {"stage": 1, "offload_param": {"device": "cpu"}}}, "offload_param needs ZeRO-3"),
        ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, "offload_optimizer needs ZeRO-1"),
        ({"zero_optimization": {"stage": 2, "zero_quantized_weights": True}}, "ZeRO++ (zero_quantized_weights)"),
        ({"zero_optimization": {"stage": 1, "zero_hpz_partition_size": 8}}, "ZeRO++ (zero_hpz_partition_size)"),
        ({"optimizer": {"type": "ZeroOneAdam"}}, "0/1 Adam was removed"),
        ({"optimizer": {"type": "FancyAdam"}}, "neither a DeepSpeed optimizer"),
        ({"zero_optimisation": {"stage": 3}}, "did you mean 'zero_optimization'"),
    ],
)
def test_combinations_deepspeed_would_ignore_are_refused(ds, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        ds_checks.refuse_ignored({**ZERO, **ds})


def test_what_is_allowed_passes_with_notes_for_ignored_knobs():
    ok = [
        {"zero_optimization": {"stage": 3, "zero_quantized_weights": True, "offload_param": {"device": "cpu"}}},
        {"tensor_parallel": {"autotp_size": 1}, "sequence_parallel_size": 1, "optimizer": {"type": "adamw"}},
        {"optimizer": {"type": "SGD"}, "_comment": "a JSON comment key"},
    ]
    for ds in ok:
        assert ds_checks.refuse_ignored({**ZERO, **ds}) == []
    notes = ds_checks.refuse_ignored(
        {
            **ZERO,
            "zero_optimization": {"stage": 2, "stage3_max_live_parameters": 1e8, "sub_group_size": 1e8},
            "activation_checkpointing": {"partition_activations": True},
            "monitor_config": {"enabled": True},
        }
    )
    assert any("top-level key 'monitor_config' is not read by DeepSpeed" in n for n in notes)
    assert any("stage3_max_live_parameters is read only at ZeRO-3; ignored at ZeRO-2" in n for n in notes)
    assert any("sub_group_size" in n for n in notes)
    assert any("--gradient_checkpointing" in n for n in notes)
    z3 = {"stage": 3, "round_robin_gradients": True, "allgather_bucket_size": 2e8, "ignore_unused_parameters": True}
    notes = ds_checks.refuse_ignored({**ZERO, "zero_optimization": z3})
    assert notes == [  # ignore_unused_parameters true is DeepSpeed's default: ignoring it changes nothing
        "zero_optimization.allgather_bucket_size is read only at ZeRO-1/2; ignored at ZeRO-3",
        "zero_optimization.round_robin_gradients is read only at ZeRO-1/2; ignored at ZeRO-3",
    ]
    notes = ds_checks.refuse_ignored({**ZERO, "zero_optimization": {"stage": 0, "reduce_bucket_size": 5e7}})
    assert notes == ["zero_optimization.reduce_bucket_size is read only at ZeRO-1/2/3; ignored at ZeRO-0"]


@pytest.mark.parametrize(
    "gpu,capability,bf16_refused,tf32_refused",
    [
        ("V100", (7, 0), True, True),
        ("T4", (7, 5), True, True),
        ("A100", (8, 0), False, False),
        ("H100", (9, 0), False, False),
    ],
)
def test_bf16_and_tf32_need_compute_capability_8(gpu, capability, bf16_refused, tf32_refused):
    # torch.cuda.is_bf16_supported() says True on a V100 or T4 (emulation): the capability decides
    bf16_ok = ds_checks.native_bf16(accelerator_says=True, capability=capability)
    assert bool(ds_checks.precision_problems("bf16", "cuda", True, bf16_ok)) == bf16_refused
    tf32 = ds_checks.tf32_problems(True, "cuda", capability)
    assert bool(tf32) == tf32_refused
    assert ds_checks.tf32_problems(None, "cuda", capability) == ds_checks.tf32_problems(False, "cpu", None) == []


def test_tf32_is_refused_on_the_cpu_in_one_line():
    assert ds_checks.machine_problems({"bf16": {"enabled": False}, "fp16": {"enabled": False}}, tf32=True) == [
        "--tf32 needs an NVIDIA GPU of compute capability 8.0 or newer (A100, H100); this is a cpu, not an NVIDIA "
        "GPU: drop --tf32"
    ]


def test_machine_precision_and_nvme_problems(tmp_path):
    assert ds_checks.precision_problems("fp16", "cuda", fp16_ok=False, bf16_ok=True)[0].startswith(
        "this cuda has no fp16"
    )
    assert "compute capability 8.0" in ds_checks.precision_problems("bf16", "cuda", fp16_ok=True, bf16_ok=False)[0]
    assert ds_checks.precision_problems("bf16", "cpu", fp16_ok=True, bf16_ok=True) == []
    missing = tmp_path / "nvme"
    assert ds_checks.path_problems(str(missing)) == [
        f"nvme_path {missing} does not exist; create it on the NVMe drive (mkdir -p {missing})"
    ]
    assert not missing.exists()  # nothing created
    (tmp_path / "file").write_text("x")
    assert "is not a directory" in ds_checks.path_problems(str(tmp_path / "file"))[0]
    assert ds_checks.path_problems(str(tmp_path)) == []
    ds = {
        "bf16": {"enabled": False},  # resolved, as train.py passes it
        "fp16": {"enabled": False},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(missing)}},
    }
    assert any("does not exist" in p for p in ds_checks.machine_problems(ds))


def test_a_deepspeed_path_that_is_a_directory():
    with pytest.raises(ConfigError, match="is a directory .*zero3.json.*; give the JSON file"):
        load_fragments(["ds_configs"])
