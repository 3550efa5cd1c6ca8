"""The memory estimate's mixture-of-experts arithmetic (zero_recipes/memory/moe.py): what a rank holds under AutoEP
and how ZeRO shards it, the step's optimizer groups, ZeRO-3's gather of a layer's packed experts, the routed rows
at an imbalance and their bound, and the trace of transformers' experts against a real forward and backward. The
check against real DeepSpeed is tests/integration/memory/test_memory_moe.py."""

from __future__ import annotations

import dataclasses
import json

import pytest

from helpers import REPO
from zero_recipes.memory import Launch, estimate, moe as mm
from zero_recipes.memory.shape import ModelShape
from zero_recipes.memory.states import zero_setting

SHAPE = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
SHAPE |= {"vocab_size": 4096, "max_position_embeddings": 1024, "num_experts_per_tok": 2}
MIXTRAL = {"model_type": "mixtral", "intermediate_size": 256, "num_local_experts": 8, **SHAPE}
QWEN2_MOE = {"model_type": "qwen2_moe", "intermediate_size": 256, "moe_intermediate_size": 64, "num_experts": 8}
QWEN2_MOE |= {"shared_expert_intermediate_size": 256, **SHAPE}


def config(fields: dict):
    from transformers import AutoConfig

    fields = dict(fields)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def ds(stage: int, ep: int = 1, bf16: bool = False) -> dict:
    """A resolved DeepSpeed dict as ds_config.resolve leaves it, the parts the estimate reads."""
    out = {"zero_optimization": {"stage": stage, "reduce_bucket_size": 2_000_000}}
    out |= {"bf16": {"enabled": bf16}, "fp16": {"enabled": False}}
    if ep > 1:
        out["expert_parallel"] = {"enabled": True, "autoep_size": ep}
    return out


def qwen3_30b():
    return config(json.loads((REPO / "recipes/configs/qwen3-30b-a3b.json").read_text()))


def test_a_rank_holds_the_dense_weights_and_its_share_of_the_experts():
    c = config(MIXTRAL)
    total = ModelShape.of(c).num_params
    s = mm.split(c, total, 2, 4)
    routed = 2 * 8 * 3 * 128 * 256  # 2 layers x 8 experts x (gate, up, down) of 128 x 256
    assert (s.routed, s.per_layer, s.experts, s.top_k, s.sparse_layers) == (routed, routed // 2, 8, 2, 2)
    assert s.held == total - routed + routed // 2
    # ZeRO's partitions of a rank are (dense + experts) / N whatever ep is: dense over 4, its experts over 4 / 2
    assert s.held / s.zero_world == pytest.approx((total - routed) / 4 + (routed / 2) / 2)
    assert mm.split(config({**SHAPE, "model_type": "llama", "intermediate_size": 256}), 10, 2, 4) is None
    # AutoEP's w1/w2/w3 are [E/ep, I, H]: 4 x 256 x 128 = 131,072 elements, below the 524,288 of the embedding
    assert mm.held_largest(c, 524_288, s) == 4096 * 128


def test_model_states_under_ep_are_the_dense_ones_over_the_world_and_the_experts_over_their_group():
    """Qwen3-30B-A3B, ZeRO-2 + EP4 on 8 GPUs, bf16: the 16-bit weights of what a rank holds, and the master copy,
    Adam's moments and the gradient partition (4 + 8 + 2 bytes) of every parameter over the 8 ranks."""
    c = qwen3_30b()
    e = estimate(c, ds(2, 4, bf16=True), Launch(8, 1, 1, 512, True))
    m = e.moe
    assert (m["total_params"], m["experts"], m["top_k"], m["expert_parallel"], m["expert_shards"]) == (
        30_532_122_624,
        128,
        8,
        4,
        2,
    )
    assert m["active_params"] == 3_353_032_704 and m["held_params"] == 30_532_122_624 - m["routed_params"] * 3 // 4
    states = e.phases["forward_backward"]["model_states_bytes"]
    assert states == pytest.approx(2 * m["held_params"] + 14 * m["total_params"] / 8, rel=1e-6)
    assert e.params_per_rank == m["held_params"] and e.num_params == m["total_params"]
    # without EP every rank holds every expert: 2 bytes x 30.5B more than 2 bytes x 8.8B
    plain = estimate(c, ds(2, bf16=True), Launch(8, 1, 1, 512, True))
    assert plain.moe["expert_parallel"] == 1 and plain.moe["expert_imbalance"] is None
    assert plain.phases["forward_backward"]["model_states_bytes"] - states == pytest.approx(
        2 * (m["total_params"] - m["held_params"]), rel=1e-6
    )


def test_zero12_steps_one_optimizer_group_at_a_time():
    c = qwen3_30b()
    s = mm.split(c, 30_532_122_624, 8, 8)
    groups = mm.step_groups(s)
    one = s.per_layer // (3 * 8)  # one of AutoEP's w1/w2/w3 on a rank: 16 experts x 768 x 2048
    per_chunk = mm.MAX_GROUP_SIZE // one  # whole parameters a chunk takes
    assert len(groups) == 1 + -(-3 * 48 // per_chunk)
    assert groups[0] == pytest.approx((s.total - s.routed) / 8)
    assert sum(groups[1:]) == pytest.approx(s.routed / 8)  # ep = world: each rank's experts its own
    assert mm.grouped_step_delta(s, 2, 0) == int(6 * (max(groups) - sum(groups)))
    assert mm.grouped_step_delta(dataclasses.replace(s, ep=1), 2, 0) == 0


def test_zero3_gathers_a_whole_layer_of_experts_whatever_the_live_cap():
    c = config(MIXTRAL)
    small_cap = ds(3)
    small_cap["zero_optimization"] |= {"stage3_max_live_parameters": 1000, "stage3_prefetch_bucket_size": 1000}
    e = estimate(c, small_cap, Launch(2, 1, 1, 64, False, accelerator="cpu"))
    layer = 8 * 3 * 128 * 256
    s = mm.split(c, e.num_params, 1, 2)
    assert mm.gather_floor(s, 4) == 4 * layer // 2  # the other rank's half of one layer's experts, fp32
    cap = zero_setting(small_cap["zero_optimization"], "stage3_max_live_parameters", 1e9) * 2
    by_phase = {k: mm_phase(e, k) for k in ("init", "forward", "forward_backward", "optimizer_step")}
    before = by_phase["forward_backward"].buffers
    # with checkpointing: one layer's experts, whatever the cap (4 bytes x 2000 elements) lets DeepSpeed keep
    after = mm.adjust_phases(by_phase, s, 3, 4, cap, 4, 8, False, True)["forward_backward"].buffers
    assert after - before == mm.gather_floor(s, 4) - 4 * cap
    # without: the backward keeps every layer's gathered experts (views saved by their matmuls) and gathers the
    # layer it is in again beside them
    after = mm.adjust_phases(by_phase, s, 3, 4, cap, 4, 8, False, False)["forward_backward"].buffers
    assert after - before == 4 * (2 * layer + layer) - 4 * cap
    # the experts are whole on every rank when the expert-data-parallel group is 1 (ep = world): nothing gathered
    assert mm.saved_gather_bytes(dataclasses.replace(s, ep=2), 4, 0, False) == 0


def mm_phase(e, name):
    from zero_recipes.memory.states import PhaseBytes

    t = e.phases.get(name, e.phases["forward_backward"])
    return PhaseBytes(t["model_states_bytes"], t["buffers_bytes"], t["host_bytes"])


def test_routed_rows_at_an_imbalance_never_beyond_every_token_on_one_rank():
    c = config(MIXTRAL)
    s = mm.split(c, 10**7, 2, 2)
    tokens = 1000
    assert mm.worst_rows(s, tokens, 1.0) == tokens * 2
    assert mm.worst_rows(s, tokens, 2.0) == tokens * 4  # 2 ranks: all of both ranks' k rows on one
    assert mm.worst_rows(s, tokens, 5.0) == tokens * 4  # capped there
    eight = mm.split(c, 10**7, 8, 8)  # one expert a rank: a token sends at most one of its k rows to it
    assert mm.worst_rows(eight, tokens, 9.0) == 8 * tokens * 1
    assert mm.ep_activation_bytes(c, dataclasses.replace(s, ep=1), 1, tokens, 4, False, 2.0) == 0
    # at 2x: every sparse layer keeps the extra rows' saved tensors (2H + 4I each), plus one layer's buffers
    h, i = 128, 256
    extra = mm.ep_activation_bytes(c, s, 1, tokens, 4, False, 2.0)
    assert extra == int(4 * (2 * tokens * 2 * (2 * h + 4 * i) + 2 * (tokens * 4 + 8 * 4) * h))
    # checkpointing: one layer's rows at a time
    assert mm.ep_activation_bytes(c, s, 1, tokens, 4, True, 2.0) < extra


@pytest.mark.parametrize("fields", [MIXTRAL, QWEN2_MOE], ids=["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_trace_of_the_experts_equals_a_real_forward_backward(fields, dtype_name):
    """transformers' grouped experts traced (their fallback op under fake tensors) hold what torch's grouped_mm
    holds on real tensors: the router's logits and fp32 softmax, the sorted copies, each expert on its T*k rows."""
    import torch

    from zero_recipes.memory.activations import trace_peak
    from zero_recipes.memory.probe import fwd_bwd_peak_bytes

    c, dtype = config(fields), getattr(torch, dtype_name)
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(c, dtype=dtype, attn_implementation="sdpa")
    assert fwd_bwd_peak_bytes(model, c, 2, 128) == trace_peak(c, 2, 128, dtype, False, "sdpa")


def test_a_dense_estimate_has_no_moe_block():
    c = config({**SHAPE, "model_type": "llama", "intermediate_size": 256})
    assert estimate(c, ds(2), Launch(2, 1, 1, 64, False, accelerator="cpu")).moe is None
