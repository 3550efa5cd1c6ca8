"""The pipeline axis without a launcher: the mesh's arithmetic with stages outermost (DeepSpeed's
PipeDataParallelTopology), the "auto" batch, the pipeline block read and checked, and the layer -> HF name
mapping the export and tools/export_hf.py share."""

import json

import pytest
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
from transformers import AutoConfig

from zero_recipes.config.train_config import ConfigError, TrainConfig
from zero_recipes.ds import facts as ds_facts, intake as ds_config
from zero_recipes.modeling.model import TINY_LLAMA, meta_model
from zero_recipes.parallel import mesh as parallel
from zero_recipes.parallel.pipeline import layers as pipeline_model
from zero_recipes.parallel.pipeline.axis import PipelineParallel


def test_stages_are_outermost_as_deepspeeds_topology_lays_them_out():
    mesh = parallel.Mesh(8, pp=2)
    topology = PipeDataParallelTopology(num_pp=2, num_dp=4)
    for rank in range(8):
        coord = topology.get_coord(rank)
        assert mesh.coords(rank) == (coord.data, coord.pipe)
        assert mesh.stage(rank) == coord.pipe
    assert mesh.dp == 4 and mesh.group == 2 and mesh.zero_shards == 4  # ZeRO-1 shards over a stage's replicas
    assert mesh.gradient_divisor(1) == 4
    assert mesh.describe() == "8 ranks = 4 data-parallel x 2 pipeline-parallel"
    assert mesh.layout()["pipeline_parallel"] == 2
    assert parallel.ranks_in_words(mesh.layout()) == "4 data-parallel x 2 pipeline-parallel rank(s)"


def test_picture_gives_each_stage_a_column_and_its_nodes():
    lines = parallel.picture(parallel.Mesh(16, pp=4), gpus_per_node=8).splitlines()
    assert lines[0].split() == ["pp", "0", "pp", "1", "pp", "2", "pp", "3"]
    assert lines[1].split() == ["dp", "0", "0", "4", "8", "12"]
    assert lines[-1].split() == ["node", "0", "0", "1", "1"]
    wide = parallel.picture(parallel.Mesh(32, pp=2), gpus_per_node=8).splitlines()
    assert wide[-1].split() == ["node", "0-1", "2-3"]  # a stage of 16 replicas spans 2 nodes


def test_the_stage_count_comes_from_the_pipeline_block():
    assert ds_facts.pipeline_parallel_size({}) == 1
    assert ds_facts.pipeline_parallel_size({"pipeline": {"stages": "auto"}}) == 1  # DeepSpeed's own default
    assert ds_facts.pipeline_parallel_size(json.loads(open("ds_configs/pp4.json").read())) == 4


def test_auto_batch_counts_pipelines_not_ranks_and_best_partition_is_parameters():
    raw = ds_config.load_fragments(["ds_configs/zero1.json", "ds_configs/pp2.json"])
    raw["pipeline"].pop("partition")
    cfg = TrainConfig(per_device_train_batch_size=2, gradient_accumulation_steps=4)
    ds = ds_config.resolve(raw, cfg, {"per_device_train_batch_size", "gradient_accumulation_steps"}, 8, 128).ds
    assert ds["train_batch_size"] == 2 * 4 * 4  # micro x the pipeline's micro-batches x 4 pipelines
    assert ds["pipeline"]["partition"] == "parameters"


@pytest.mark.parametrize(
    "block,says",
    [
        ({"stages": 2, "partition": "best-effort"}, "is not a way to split layers"),
        ({"stages": 2, "seed_layers": True}, "remove seed_layers"),
        ({"stages": 2, "activation_checkpoint_interval": -1}, "give a number of layers"),
    ],
)
def test_a_pipeline_block_that_would_not_mean_what_it_says_is_refused(block, says):
    axis = PipelineParallel(parallel.Mesh(2, pp=2))
    ds = {"pipeline": dict(block)}
    axis.configure(ds)
    with pytest.raises(ConfigError, match=says):
        axis.check(AutoConfig.for_model(**TINY_LLAMA), ds, TrainConfig())


def test_flash_attention_on_packed_multi_row_micro_batches_is_refused_under_a_pipeline():
    # examples would attend to each other: transformers reads packed position ids for one row only
    axis = PipelineParallel(parallel.Mesh(2, pp=2))
    ds = {"pipeline": {"stages": 2}}
    axis.configure(ds)
    config = AutoConfig.for_model(**TINY_LLAMA)
    flash = TrainConfig(attn_implementation="flash_attention_2", per_device_train_batch_size=4)
    with pytest.raises(ConfigError, match="--per_device_train_batch_size 1, or --packing false"):
        axis.check(config, ds, flash)
    for fine in (
        TrainConfig(attn_implementation="flash_attention_2", per_device_train_batch_size=1),
        TrainConfig(attn_implementation="flash_attention_2", per_device_train_batch_size=4, dataset_format="text"),
        TrainConfig(attn_implementation="sdpa", per_device_train_batch_size=4),
    ):
        assert axis.check(config, ds, fine) == ()


@pytest.mark.parametrize("tied", [False, True])
def test_every_pipeline_layer_key_maps_to_one_hf_name(tied):
    """The layer files' keys (pipeline_model's wrappers) become exactly the HF model's state-dict names."""
    fields = dict(TINY_LLAMA, tie_word_embeddings=tied)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    model = meta_model(config)
    layers = pipeline_model.pipeline_layers(model)
    n = config.num_hidden_layers
    names = []
    for index, layer in enumerate(layers):
        module = layer.build() if hasattr(layer, "build") else layer
        names += [pipeline_model.hf_name(index, key, n, tied) for key in module.state_dict()]
    want = {name for name, _ in model.named_parameters()}
    assert {x for x in names if x is not None} == want
    assert len([x for x in names if x is not None]) == len(want)  # each once: the tied head's copy left out
