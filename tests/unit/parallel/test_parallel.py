"""The parallel mesh and what tensor parallelism refuses, without a launcher: the arithmetic of
zero_recipes.parallel.mesh, the batch the "auto"s resolve to, and the resume layouts refused up front."""

import json

import pytest
from transformers import AutoConfig

from zero_recipes import modes
from zero_recipes.checkpointing import resume
from zero_recipes.config import lora_options
from zero_recipes.config.train_config import ConfigError, TrainConfig
from zero_recipes.ds import facts as ds_facts, intake as ds_config
from zero_recipes.modeling.model import TINY_LLAMA
from zero_recipes.parallel import combinations, mesh as parallel, tensor_parallel

TINY = AutoConfig.for_model(**TINY_LLAMA)  # 4 heads over 2 key-value heads


def test_tensor_dimension_is_innermost_as_deepspeed_lays_it_out():
    mesh = parallel.Mesh(8, 2)
    assert mesh.dp == 4
    assert [mesh.coords(r) for r in range(8)] == [(d, t) for d in range(4) for t in range(2)]
    assert [mesh.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]  # a TP group shares a batch
    assert mesh.describe() == "8 ranks = 4 data-parallel x 2 tensor-parallel"
    assert parallel.Mesh(2).describe() == "2 ranks = 2 data-parallel"
    assert parallel.Mesh(1).describe() == "1 rank = 1 data-parallel"


def test_picture_puts_each_rank_at_its_coordinates_and_node():
    lines = parallel.picture(parallel.Mesh(8, 4), gpus_per_node=4).splitlines()
    assert lines[0].split() == ["tp", "0", "tp", "1", "tp", "2", "tp", "3"]
    assert lines[1].split() == ["node", "0", "dp", "0", "0", "1", "2", "3"]
    assert lines[2].split() == ["node", "1", "dp", "1", "4", "5", "6", "7"]
    assert [line.split()[2:] for line in parallel.picture(parallel.Mesh(4, 2)).splitlines()[1:]] == [
        ["0", "1"],
        ["2", "3"],
    ]


def test_tensor_parallel_size_reads_the_autotp_block():
    assert ds_facts.tensor_parallel_size({}) == 1
    assert ds_facts.tensor_parallel_size({"tensor_parallel": {"autotp_size": 0}}) == 1
    assert ds_facts.tensor_parallel_size(json.loads(open("ds_configs/tp4.json").read())) == 4


def resolved(world: int, *fragments: str, **fields):
    raw = ds_config.load_fragments(list(fragments))
    cfg = TrainConfig(**fields)
    return ds_config.resolve(raw, cfg, set(fields), world, 128).ds


def test_auto_batch_counts_data_parallel_replicas_not_ranks():
    ds = resolved(8, "ds_configs/zero1.json", "ds_configs/tp2.json", per_device_train_batch_size=4)
    assert ds["train_batch_size"] == 4 * 1 * 4  # micro x accumulation x (8 ranks / TP 2)
    assert resolved(8, "ds_configs/zero1.json", per_device_train_batch_size=4)["train_batch_size"] == 32


def test_tp_keeps_the_logits_whole_unless_told_otherwise():
    ds = resolved(2, "ds_configs/zero1.json", "ds_configs/tp2.json")
    assert ds["tensor_parallel"]["vocab_parallel_lm_head"] is False  # a tied head would return V/tp slices
    with pytest.raises(ConfigError, match="vocab_parallel_lm_head = true"):
        tensor_parallel.gather_logits({"autotp_size": 2, "vocab_parallel_lm_head": True})
    assert "tensor_parallel" not in resolved(2, "ds_configs/zero1.json")


def test_a_world_size_the_tp_size_does_not_divide_is_refused():
    with pytest.raises(ConfigError, match=r"3 rank\(s\) cannot split into tensor-parallel groups of 2"):
        resolved(3, "ds_configs/zero1.json", "ds_configs/tp2.json")


def check(tp: int, config=TINY, stage: int = 1, **fields):
    ds = {"zero_optimization": {"stage": stage}, "tensor_parallel": {"autotp_size": tp}}
    cfg = TrainConfig(**fields)  # what plan.RunPlan.from_args asks: the modes' pairs, then the axis
    combinations.refuse(combinations.modes({"tensor": tp}, stage, lora_options.adapter_name(cfg)))
    return tensor_parallel.TensorParallel(parallel.Mesh(tp, tp)).check(config, ds, cfg)


def test_heads_and_kv_heads_must_divide():
    check(2)  # 4 heads, 2 KV heads: fine
    with pytest.raises(ConfigError, match="does not divide the model's 2 key-value heads"):
        check(4)
    with pytest.raises(ConfigError, match="does not divide the model's 4 attention heads"):
        check(8, AutoConfig.for_model(**{**TINY_LLAMA, "num_key_value_heads": 8, "num_attention_heads": 4}))


def test_a_family_without_a_tp_plan_is_refused_unless_the_config_gives_a_layout():
    gpt2 = AutoConfig.for_model("gpt2", n_head=4)
    with pytest.raises(ConfigError, match="model type 'gpt2' has no tensor-parallel plan"):
        check(2, gpt2)
    ds = {"zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": 2, "partition_config": {"x": 1}}}
    tensor_parallel.TensorParallel(parallel.Mesh(2, 2)).check(gpt2, ds, TrainConfig())


def test_zero0_and_lora_are_refused_with_tp():
    with pytest.raises(ConfigError, match="with ZeRO-0: .*use ds_configs/zero1.json"):
        check(2, stage=0)
    with pytest.raises(ConfigError, match="with LoRA"):
        check(2, lora_r=8)


def test_zero_init_gets_no_train_batch_size_under_tp_only():
    ds = {"train_batch_size": 8, "zero_optimization": {"stage": 3}}
    assert modes.parallelism_for(parallel.Mesh(2, 2)).zero_init_config(ds) == {"zero_optimization": {"stage": 3}}
    assert modes.parallelism_for(parallel.Mesh(2, 1)).zero_init_config(ds) is ds


def saved(tmp_path, **layout):
    (tmp_path / "step-4").mkdir()
    (tmp_path / "step-4" / "layout.json").write_text(json.dumps({"step": 4, **layout}))
    return tmp_path, "step-4"


def test_a_resume_across_tp_degrees_is_refused_with_the_way_out(tmp_path):
    where = saved(tmp_path, world=1, zero_stage=1, tensor_parallel=2)
    with pytest.raises(ConfigError, match="autotp_size 2 at autotp_size 1.*tools/export_hf.py"):
        resume.layout_change(where, parallel.Mesh(2, 1), 1)
    # the same degree on more data-parallel replicas is a universal conversion
    assert resume.layout_change(where, parallel.Mesh(4, 2), 1)["world"] == 1
    assert resume.layout_change(where, parallel.Mesh(2, 2), 1) is None


def test_zero3_tp_checkpoints_resume_on_their_own_layout_only(tmp_path):
    where = saved(tmp_path, world=1, zero_stage=3, tensor_parallel=2)
    assert resume.layout_change(where, parallel.Mesh(2, 2), 3) is None
    with pytest.raises(ConfigError, match="Resume with 1 data-parallel x 2 tensor-parallel ranks and ZeRO-3"):
        resume.layout_change(where, parallel.Mesh(4, 2), 3)


def test_checkpoints_saved_before_tp_read_as_tp1(tmp_path):
    where = saved(tmp_path, world=2, zero_stage=2)  # no tensor_parallel key: saved before this existed
    assert resume.layout_change(where, parallel.Mesh(2, 1), 2) is None
