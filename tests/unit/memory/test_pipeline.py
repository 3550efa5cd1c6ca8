"""The memory estimate under pipeline parallelism (zero_recipes/memory/pipeline.py, pipeline_trace.py): the split is
DeepSpeed's own over parallel/pipeline/layers.py's layers, the in-flight micro-batches are its 1F1B schedule's, the worst stage
is the one reported, the bubble's arithmetic, and the refusals are train.py's. Against real DeepSpeed pipelines
(the allocator of 2 CPU ranks): tests/integration/memory/test_memory_pipeline.py."""

from __future__ import annotations

import pytest
import torch

from helpers import SMALL_LLAMA, small_llama
from zero_recipes.config.train_config import ConfigError
from zero_recipes.memory import Launch, estimate, pipeline, training_compute
from zero_recipes.memory.pipeline_trace import stage_activations

EMBED = SMALL_LLAMA["vocab_size"] * SMALL_LLAMA["hidden_size"]
FP32 = {"bf16": {"enabled": False}, "fp16": {"enabled": False}}


def zero(stage: int, pp: int, gas: int = 4, **block) -> dict:
    """A resolved-enough DeepSpeed dict: ZeRO stage, fp32, `pp` pipeline stages, `gas` micro-batches a step."""
    return {"zero_optimization": {"stage": stage}, "gradient_accumulation_steps": gas, **FP32,
            "pipeline": {"stages": pp, **block}}  # fmt: skip


def block_params() -> int:
    from zero_recipes.modeling.model import meta_model

    return sum(p.numel() for p in meta_model(small_llama()).model.layers[0].parameters())


def test_split_is_deepspeeds_over_the_pipeline_layers():
    """[embedding, 4 blocks, norm, head]: by parameters the two 2M-parameter ends balance two blocks each; the
    stages' parameters add up to the model's; uniform splits the 7 layers 4 + 3; type:Block puts two blocks on each
    stage, the norm and head with the last. A tied embedding/head counts on both stages that hold a copy."""
    stages = pipeline.split(small_llama(), 2, "parameters", 4)
    assert [(s.start, s.stop, s.blocks) for s in stages] == [(0, 3, 2), (3, 7, 2)]
    assert (stages[0].embeds, stages[0].heads, stages[1].norms, stages[1].heads) == (True, False, True, True)
    assert stages[0].params == EMBED + 2 * block_params()
    assert sum(s.params for s in stages) == estimate(small_llama(), zero(1, 1), Launch(1, seq_len=64)).num_params
    assert stages[0].largest_param == EMBED
    uniform = pipeline.split(small_llama(), 2, "uniform", 4)
    assert [(s.start, s.stop) for s in uniform] == [(0, 4), (4, 7)]
    by_type = pipeline.split(small_llama(), 2, "type:Block", 4)
    assert [s.blocks for s in by_type] == [2, 2] and by_type[1].heads
    tied = pipeline.split(small_llama(tie_word_embeddings=True), 2, "parameters", 4)
    assert tied[0].params == tied[1].params - SMALL_LLAMA["hidden_size"]  # both hold the embedding; 1 norm more
    with pytest.raises(ConfigError, match="found no valid layers"):
        pipeline.split(small_llama(), 2, "type:Attention", 4)


def test_in_flight_is_the_1f1b_schedules_and_the_first_stage_holds_the_most():
    """min(stages - s, micro-batches) forwards in flight on stage s (DeepSpeed's TrainSchedule)."""
    assert [pipeline.in_flight(4, s, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [pipeline.in_flight(4, s, 2) for s in range(4)] == [2, 2, 2, 1]
    assert [pipeline.in_flight(2, s, 1) for s in range(2)] == [1, 1]


def test_first_stage_activations_grow_with_the_micro_batches_in_flight_checkpointing_keeps_inputs():
    """PP4, 4 blocks uniform over the stages by type: stage 1 (one block, no embedding) holds 3 micro-batches with
    8 a step and 1 with 1 a step, so about 3x (the persistent receive/gradient buffers are once); with
    --gradient_checkpointing each micro-batch in flight keeps its block's input only."""
    config = small_llama()
    stages = pipeline.split(config, 4, "type:Block", 8)
    one = pipeline.split(config, 4, "type:Block", 1)
    assert (stages[1].blocks, stages[1].in_flight, one[1].in_flight) == (1, 3, 1)
    launch = Launch(4, 1, 2, 256)
    many = stage_activations(config, stages[1], 4, 8, launch, torch.float32)
    few = stage_activations(config, one[1], 4, 1, launch, torch.float32)
    acts = lambda a: a.peak - a.grads_at_peak  # noqa: E731
    assert 2.5 < acts(many) / acts(few) <= 3.05
    gc_launch = Launch(4, 1, 2, 256, True)
    gc_many, gc_few = (
        stage_activations(config, st[1], 4, m, gc_launch, torch.float32) for st, m in ((stages, 8), (one, 1))
    )
    # what each more micro-batch in flight adds: its block's input (and the pipeline's clones), not its activations
    assert acts(gc_many) - acts(gc_few) < (acts(many) - acts(few)) / 4
    assert acts(gc_many) < acts(many) / 1.8  # one block recomputed at a time in the backward
    # the last stage keeps the last two micro-batches' logits through the step: 2 x rows x vocab x 4 bytes at least
    last = stage_activations(config, stages[3], 4, 8, launch, torch.float32)
    assert last.resident >= 2 * 2 * 256 * SMALL_LLAMA["vocab_size"] * 4


def test_the_worst_stage_is_the_estimate_and_zero1_partitions_a_stage_over_its_replicas():
    config = small_llama()
    e = estimate(config, zero(0, 2), Launch(2, seq_len=256))
    rows = e.pipeline["stages"]
    assert (e.pipeline_parallel, e.data_parallel, len(rows)) == (2, 1, 2)
    assert e.per_gpu["peak_bytes"] == max(r["peak_bytes"] for r in rows)
    worst = rows[e.pipeline["worst_stage"]]
    assert worst["peak_bytes"] == e.per_gpu["peak_bytes"] and e.params_per_rank == worst["params"]
    assert e.num_params == sum(r["params"] for r in rows)
    # 4 GPUs: 2 replicas of each stage; ZeRO-1 halves a stage's optimizer states, ZeRO-0 does not
    z0, z1 = (estimate(config, zero(s, 2), Launch(4, seq_len=256)) for s in (0, 1))
    assert z1.data_parallel == 2
    states = lambda e: e.phases["optimizer_step"]["model_states_bytes"]  # noqa: E731
    assert states(z1) < states(z0)
    # the first stage's bytes at gradient accumulation 1 and 8: more in flight, a higher peak
    m1, m8 = (estimate(config, zero(0, 2, gas), Launch(2, seq_len=256)) for gas in (1, 8))
    first = lambda e: e.pipeline["stages"][0]["activations_bytes"]  # noqa: E731
    assert first(m8) > first(m1)


def test_bubble_and_compute():
    assert pipeline.bubble(1, 8) == 0 and pipeline.bubble(2, 1) == 0.5
    assert pipeline.bubble(4, 8) == pytest.approx(3 / 11)
    plain = training_compute(small_llama(), 7e6, 1e9, 256, 8, "H100", "bf16", 0.4, None)
    piped = training_compute(small_llama(), 7e6, 1e9, 256, 8, "H100", "bf16", 0.4, None, 4, 8)
    assert plain["pipeline_bubble"] == 0 and piped["pipeline_bubble"] == pytest.approx(3 / 11)
    assert piped["wall_seconds"] == pytest.approx(plain["wall_seconds"] * 11 / 8)
    assert piped["effective_mfu"] == pytest.approx(0.4 * 8 / 11)


@pytest.mark.parametrize(
    ("ds", "world", "config", "words"),
    [
        (zero(2, 2), 2, {}, "with ZeRO-2"),
        (zero(3, 2), 2, {}, "with ZeRO-3"),
        ({**zero(1, 2), "tensor_parallel": {"autotp_size": 2}}, 4, {}, "with tensor_parallel"),
        ({**zero(1, 2), "sequence_parallel_size": 2}, 4, {}, "with sequence_parallel_size"),
        (zero(1, 2), 3, {}, "multiple of pipeline.stages"),
        (zero(1, 8), 8, {}, "exceeds the model's 4 decoder layers"),
    ],
)
def test_refusals_are_train_pys(ds, world, config, words):
    with pytest.raises(ConfigError, match=words):
        estimate(small_llama(**config), ds, Launch(world, seq_len=64))


def test_a_family_the_pipeline_cannot_split_is_refused():
    from transformers import AutoConfig

    gpt2 = AutoConfig.for_model("gpt2", n_embd=64, n_layer=2, n_head=2, vocab_size=1000)
    with pytest.raises(ConfigError, match="model type 'gpt2' cannot be split"):
        estimate(gpt2, zero(1, 2), Launch(2, seq_len=64))
