"""What moe.py knows of each family, checked against the models transformers builds; the balancing loss
train.py adds, against transformers' own; the refusals of expert parallelism's table."""

from __future__ import annotations

import pytest
import torch

from zero_recipes.errors import ConfigError
from zero_recipes.modeling import lm_loss, moe
from zero_recipes.modeling.model import meta_model
from zero_recipes.parallel import combinations
from zero_recipes.parallel.mesh import Mesh
from zero_recipes.training import flops

SHAPE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "vocab_size": 256}
SHAPE |= {"num_attention_heads": 4, "num_key_value_heads": 2, "num_experts_per_tok": 2}
CONFIGS = {
    "mixtral": {"num_local_experts": 4},
    "qwen2_moe": {"num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48},
    "qwen3_moe": {"num_experts": 8, "moe_intermediate_size": 32, "mlp_only_layers": [1]},
    "olmoe": {"num_experts": 8},
    "deepseek_v2": {"n_routed_experts": 4, "moe_intermediate_size": 32, "n_shared_experts": 2}
    | {"first_k_dense_replace": 1, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8}
    | {"v_head_dim": 16, "q_lora_rank": None, "num_key_value_heads": 4},
    "deepseek_v3": {"n_routed_experts": 4, "moe_intermediate_size": 32, "n_shared_experts": 1, "n_group": 2}
    | {"topk_group": 1, "first_k_dense_replace": 1, "kv_lora_rank": 16, "qk_rope_head_dim": 8}
    | {"qk_nope_head_dim": 8, "v_head_dim": 16, "q_lora_rank": None, "num_key_value_heads": 4},
}


def config(model_type: str, **fields):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**SHAPE, **CONFIGS[model_type], **fields})


def built_mlp_params(model) -> tuple[int, int]:
    """(every MLP parameter, the routed experts') of a built model: the layers' `mlp` modules."""
    total = routed = 0
    for name, p in model.named_parameters():
        if ".mlp." in name:
            total += p.numel()
            routed += p.numel() if ".experts." in name else 0
    return total, routed


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_the_parameter_arithmetic_is_the_built_models(model_type):
    c = config(model_type)
    assert moe.family(c) is not None and moe.is_moe(c)
    counted = moe.mlp_params(c)
    assert (counted.total, counted.routed) == built_mlp_params(meta_model(c))
    k, e = moe.top_k(c), moe.num_experts(c)
    assert counted.active == counted.total - counted.routed + counted.routed * k // e  # k of e experts per token


def test_flops_count_the_experts_a_token_uses_not_every_expert():
    few, many = config("mixtral", num_local_experts=4), config("mixtral", num_local_experts=64)
    # 16x the experts: 16x the routed parameters, the same compute per token but the router's 60 more outputs
    extra_router = 6 * SHAPE["num_hidden_layers"] * SHAPE["hidden_size"] * 60
    assert flops.model_flops_per_token(many, 64) - flops.model_flops_per_token(few, 64) == extra_router
    words = moe.parameters_in_words(few, 1_000_000)
    assert "active per token (4 experts, 2 per token, 3 of 3 layers sparse)" in words


def test_dense_layers_are_where_each_family_puts_them():
    assert moe.sparse_layers(config("deepseek_v3")) == [1, 2]  # first_k_dense_replace
    assert moe.sparse_layers(config("qwen3_moe")) == [0, 2]  # mlp_only_layers
    assert moe.sparse_layers(config("qwen2_moe", decoder_sparse_step=2)) == [1]


def routed_batch(model_type="mixtral", seed=0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(model_type, router_aux_loss_coef=0.3))
    ids = torch.randint(0, SHAPE["vocab_size"], (3, 24))
    mask = torch.ones_like(ids)
    mask[2, 16:] = 0  # padding the balancing loss leaves out
    return model, ids, mask


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_the_balancing_loss_is_transformers_own(model_type):
    import importlib

    model, ids, mask = routed_batch(model_type)
    out = model.model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    theirs = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    want = theirs.load_balancing_loss_func(out.router_logits, 4, 2, mask)
    got = moe.BalancingLoss(0.3, 4, 2).aux(out.router_logits, mask)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)


def test_train_pys_loss_adds_it_back_with_transformers_value_and_gradient():
    """train.py's own loss (tiled) against transformers' loss with output_router_logits on: the same loss,
    aux loss and router gradient; without the term the router's gradient is another."""
    grads = {}
    for kind in ("transformers", "train.py", "no balancing loss"):
        model, ids, mask = routed_batch()
        model.config.output_router_logits = kind != "no balancing loss"
        if kind != "transformers":
            balance = moe.BalancingLoss(0.3, 4, 2) if model.config.output_router_logits else None
            lm_loss.install(model, tokens_per_tile=16, tiled=True, zero3=False, balance=balance)
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
        out.loss.backward()
        grads[kind] = (out.loss.item(), out.get("aux_loss"), model.model.layers[0].mlp.gate.weight.grad.clone())
    (a, aux_a, g_a), (b, aux_b, g_b), (_, _, g_none) = grads.values()
    assert b == pytest.approx(a, abs=1e-5) and aux_b.item() == pytest.approx(aux_a.item(), rel=1e-6)
    assert torch.allclose(g_a, g_b, atol=1e-6)
    assert (g_a - g_none).abs().max() > 1e-3  # the term reaches the router's gradient


def test_enable_balancing_loss_turns_it_on_and_takes_the_flag():
    c = config("mixtral")
    assert not c.output_router_logits  # every MoE config leaves it off: transformers would drop the term
    assert moe.enable_balancing_loss(c, None) == c.router_aux_loss_coef and c.output_router_logits
    assert moe.enable_balancing_loss(c, 0.0) == 0.0 and not c.output_router_logits
    assert moe.enable_balancing_loss(config("deepseek_v3"), None) is None  # balanced by a routing bias


def test_per_expert_modules_are_found_to_be_made_leaves():
    import torch.nn as nn

    class SparseBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(8, 4)
            self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    model = nn.Sequential(SparseBlock(), nn.Linear(8, 8))
    assert moe.leaf_blocks(model) == ["SparseBlock"]
    moe.mark_leaves(model, print)
    from deepspeed.utils import z3_leaf_module

    assert z3_leaf_module(model[0]) and not z3_leaf_module(model[1])
    assert moe.leaf_blocks(meta_model(config("mixtral"))) == []  # transformers 5 packs experts: no leaf needed


def test_expert_parallelism_is_on_the_mesh_and_in_the_table():
    mesh = Mesh.of(4, {"expert_parallel": {"enabled": True, "autoep_size": 2}})
    assert (mesh.ep, mesh.dp, mesh.group, mesh.expert_shards) == (2, 4, 1, 2)  # every rank its own rows
    assert mesh.layout()["expert_parallel"] == 2
    assert Mesh.of(4, {"expert_parallel": {"enabled": False, "autoep_size": 2}}).ep == 1  # DeepSpeed's reading
    for other in ("tensor", "sequence", "pipeline", "lora"):
        with pytest.raises(ConfigError, match="expert_parallel.autoep_size = 2 with"):
            combinations.refuse({"expert": 2, other: 2})
