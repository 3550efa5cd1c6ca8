"""The memory estimate under tensor parallelism (DeepSpeed's AutoTP), against first principles. The checks against
a real AutoTP-split model run DeepSpeed in a child process: tests/integration/memory/test_memory_against_deepspeed.py."""

from __future__ import annotations

import pytest
import torch

from helpers import small_llama
from zero_recipes.config.train_config import ConfigError
from zero_recipes.memory import Launch, ModelShape, activation_bytes, estimate
from zero_recipes.memory.states import Setup, phases
from zero_recipes.modeling.model import meta_model


def named_sizes(config) -> dict[str, int]:
    return {n: p.numel() for n, p in meta_model(config).named_parameters()}


def test_tp2_halves_the_split_layers_and_keeps_embedding_and_norms_whole():
    """From the names alone: q/k/v/o/gate/up/down and the (untied) head split in two, the embedding and the
    norms whole; the per-rank count is exactly that, and TP4 quarters the same layers."""
    config = small_llama()
    sizes = named_sizes(config)
    whole = sum(n for k, n in sizes.items() if "embed_tokens" in k or "norm" in k)
    split = sum(sizes.values()) - whole
    assert whole > 0 and split > 0
    one, two, four = (ModelShape.of(config, tp=t) for t in (1, 2, 4))
    assert two.num_params == whole + split // 2 and four.num_params == whole + split // 4
    assert two.model_params == one.num_params == sum(sizes.values())
    assert two.largest_param == sizes["model.embed_tokens.weight"]  # the embedding stays whole, the largest
    assert not two.vocab_parallel


def test_tp2_model_states_scale_with_the_split_and_zero_partitions_over_dp():
    """ZeRO-2 bf16 on a GPU: TP2 on 4 GPUs holds the states of a 2-rank ZeRO-2 over one TP rank's parameters;
    the sharded weights' bytes are half TP1's, the embedding's equal."""
    config = small_llama()
    sizes = named_sizes(config)
    emb = sizes["model.embed_tokens.weight"]
    zero2 = {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
    tp2 = {**zero2, "tensor_parallel": {"autotp_size": 2}}
    e1 = estimate(config, zero2, Launch(2, seq_len=16))
    e2 = estimate(config, tp2, Launch(4, seq_len=16))
    assert (e2.tensor_parallel, e2.data_parallel, e1.data_parallel) == (2, 2, 2)
    # model states are linear in the parameter count at a fixed N: compare the split and the whole part
    per_param = e1.phases["optimizer_step"]["model_states_bytes"] / e1.num_params
    sharded_tp1 = (e1.num_params - emb - _norms(sizes)) * per_param
    sharded_tp2 = e2.phases["optimizer_step"]["model_states_bytes"] - (emb + _norms(sizes)) * per_param
    assert sharded_tp2 == pytest.approx(sharded_tp1 / 2, rel=1e-6)
    s = Setup(e2.params_per_rank, emb, 2, 2, 2, True, None, None, {"stage": 2})
    assert e2.phases["optimizer_step"]["model_states_bytes"] == phases(s)["optimizer_step"].states
    # host RAM at init: every rank builds the whole model before AutoTP splits it
    assert e2.per_node["cpu_bytes"] == 4 * 4 * e2.num_params


def _norms(sizes: dict) -> int:
    return sum(n for k, n in sizes.items() if "norm" in k)


def test_activations_inside_attention_and_mlp_divide_the_residual_stream_does_not():
    """Per layer, TP2 saves less than TP1 but more than half: the norms, the residual stream and the column
    layers' inputs stay whole; the loss region (a gathered head: full logits) does not shrink at all."""
    config = small_llama()
    a1, a2 = (activation_bytes(config, 2, 256, torch.bfloat16, False, "sdpa", None, t) for t in (1, 2))
    assert a1.method == a2.method == "traced"
    assert a1.per_layer_bytes / 2 < a2.per_layer_bytes < a1.per_layer_bytes
    layers = config.num_hidden_layers
    loss1, loss2 = a1.bytes - layers * a1.per_layer_bytes, a2.bytes - layers * a2.per_layer_bytes
    assert loss2 == loss1


def test_world_not_divisible_by_tp_is_refused():
    config = small_llama()
    ds = {"zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": 2}}
    with pytest.raises(ConfigError, match="multiple of tensor_parallel.autotp_size"):
        estimate(config, ds, Launch(3, seq_len=16))
