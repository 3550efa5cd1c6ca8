"""What this project knows of mixture-of-experts families: the single home of it (the loss, FLOPs, the memory
estimate, ZeRO-3 and expert parallelism read it here).

A family is known by its transformers model_type: the config fields that give its expert count, the experts a
token uses (k), an expert's width, its shared experts and its dense layers; the class of its sparse block;
DeepSpeed AutoEP's preset for it. In transformers 5 every family here keeps a layer's experts packed into 3-D
parameters (`gate_up_proj`, `down_proj` of shape [experts, ...]), so ZeRO-3 gathers all of a layer's experts
at once whichever tokens went where: ranks routing differently still make the same collectives (no hang;
tested), at the cost of a whole layer's experts live at once (memory/moe.py counts it). Per-expert modules
(an `experts` nn.ModuleList: remote-code and older checkpoints) would hang ZeRO-3, since a rank whose tokens
skip an expert skips its gather; `leaf_blocks` finds them so DeepSpeed gathers the whole block on entry.

The balancing loss (Switch Transformer eq. 4-6, as transformers' `load_balancing_loss_func`) is what
transformers adds as `router_aux_loss_coef x aux_loss`, but only when `output_router_logits` is on, which
every family's config leaves off: `enable_balancing_loss` turns it on for training, so the loss is kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from zero_recipes.errors import ConfigError


@dataclass(frozen=True)
class Family:
    block: str
    """The sparse block's class (what AutoEP replaces and a ZeRO-3 leaf would be)."""
    experts: str
    """Config field: routed experts per MoE layer."""
    expert_width: str
    """Config field: one expert's intermediate size."""
    autoep_preset: Optional[str]
    """DeepSpeed AutoEP's `preset_model` (module_inject/auto_ep_presets), None where it has none."""
    shared_width: Optional[str] = None
    """Config field: the shared experts' total intermediate size (always active), or None."""
    shared_count: Optional[str] = None
    """Config field: how many shared experts of `expert_width` each (DeepSeek), instead of `shared_width`."""
    shared_gate: bool = False
    """A sigmoid gate (hidden -> 1) scales the shared expert (Qwen2-MoE)."""
    balancing_loss: bool = True
    """transformers computes the balancing loss for it (DeepSeek-V2/V3 balance by a routing bias instead)."""


FAMILIES = {
    "mixtral": Family("MixtralSparseMoeBlock", "num_local_experts", "intermediate_size", "mixtral"),
    "qwen2_moe": Family(
        "Qwen2MoeSparseMoeBlock",
        "num_experts",
        "moe_intermediate_size",
        "qwen3_moe",
        shared_width="shared_expert_intermediate_size",
        shared_gate=True,
    ),
    "qwen3_moe": Family("Qwen3MoeSparseMoeBlock", "num_experts", "moe_intermediate_size", "qwen3_moe"),
    "olmoe": Family("OlmoeSparseMoeBlock", "num_experts", "intermediate_size", None),
    "deepseek_v2": Family(
        "DeepseekV2Moe",
        "n_routed_experts",
        "moe_intermediate_size",
        "deepseek_v2",
        shared_count="n_shared_experts",
        balancing_loss=False,
    ),
    "deepseek_v3": Family(
        "DeepseekV3MoE",
        "n_routed_experts",
        "moe_intermediate_size",
        "deepseek_v3",
        shared_count="n_shared_experts",
        balancing_loss=False,
    ),
}

EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "num_experts_total")
"""Where a config of a family not in FAMILIES would say it is a mixture of experts."""


def text_config(model_config):
    return model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config


def family(model_config) -> Optional[Family]:
    return FAMILIES.get(text_config(model_config).model_type)


def num_experts(model_config) -> int:
    """Routed experts per MoE layer (0: a dense model). Read from the family's field, else any field a MoE
    config uses for it."""
    text, fam = text_config(model_config), family(model_config)
    fields = (fam.experts,) if fam else EXPERT_FIELDS
    return max((int(getattr(text, f, 0) or 0) for f in fields), default=0)


def is_moe(model_config) -> bool:
    return num_experts(model_config) > 1


def top_k(model_config) -> int:
    return int(getattr(text_config(model_config), "num_experts_per_tok", 1) or 1)


def sparse_layers(model_config) -> list[int]:
    """The decoder layers whose MLP is the sparse block (the rest are dense), as each family builds them."""
    text = text_config(model_config)
    layers = range(text.num_hidden_layers)
    if not is_moe(model_config):
        return []
    if getattr(text, "first_k_dense_replace", None) is not None:  # DeepSeek: the first k layers are dense
        return [i for i in layers if i >= text.first_k_dense_replace]
    step, dense = getattr(text, "decoder_sparse_step", 1) or 1, set(getattr(text, "mlp_only_layers", None) or ())
    return [i for i in layers if i not in dense and (i + 1) % step == 0]


@dataclass(frozen=True)
class MlpParams:
    """Parameters of the decoder's MLPs (dense and sparse layers together), for FLOPs and memory."""

    total: int
    """Every expert's weights, routers, shared experts and dense MLPs."""
    active: int
    """What one token multiplies by: k routed experts, the router, the shared experts, the dense MLPs."""
    routed: int
    """Every routed expert's weights (what expert parallelism divides)."""
    routed_per_layer: int
    """One MoE layer's routed experts (what ZeRO-3 gathers at once)."""


def mlp_params(model_config) -> MlpParams:
    """From the config alone (tests/unit/modeling/test_moe_families.py checks it against the built model of each family)."""
    text, fam = text_config(model_config), family(model_config)
    h, layers = text.hidden_size, text.num_hidden_layers
    dense_mlp = 3 * h * text.intermediate_size
    sparse = sparse_layers(model_config)
    if not sparse:
        total = layers * dense_mlp
        return MlpParams(total, total, 0, 0)
    e, k = num_experts(model_config), top_k(model_config)
    width = int(getattr(text, fam.expert_width if fam else "moe_intermediate_size", None) or text.intermediate_size)
    expert = 3 * h * width
    shared = 0
    if fam and fam.shared_width:
        shared = 3 * h * int(getattr(text, fam.shared_width, 0) or 0) + (h if fam.shared_gate else 0)
    elif fam and fam.shared_count:
        shared = 3 * h * width * int(getattr(text, fam.shared_count, 0) or 0)
    router = h * e
    n_sparse, n_dense = len(sparse), layers - len(sparse)
    routed_per_layer = e * expert
    total = n_dense * dense_mlp + n_sparse * (router + routed_per_layer + shared)
    active = n_dense * dense_mlp + n_sparse * (router + k * expert + shared)
    return MlpParams(total, active, n_sparse * routed_per_layer, routed_per_layer)


def check(model_config, zero_stage: int, ds: dict) -> None:
    """Before any process group: what this MoE config cannot train."""
    if not is_moe(model_config):
        return
    e, k, text = num_experts(model_config), top_k(model_config), text_config(model_config)
    if k > e:
        raise ConfigError(
            f"num_experts_per_tok = {k} is greater than the {e} experts of this {text.model_type} config: a token "
            f"cannot use more experts than a layer has; set num_experts_per_tok to at most {e}"
        )
    leaves = (ds.get("zero_optimization") or {}).get("leaf_module") or {}
    if zero_stage == 3 and family(model_config) is None and not any(leaves.get(k) for k in leaves):
        raise ConfigError(
            f"model type '{text.model_type}' is a mixture of experts this project does not know, and under ZeRO-3 "
            "experts kept as separate modules hang the run (ranks routing differently gather different experts); "
            'name its sparse block in the DeepSpeed config, "zero_optimization": {"leaf_module": {"classes": '
            '["<its MoE block class>"]}}, or train it with ds_configs/zero2.json'
        )


def leaf_blocks(model) -> list[str]:
    """Class names of the blocks whose experts are separate modules (an `experts` nn.ModuleList): under ZeRO-3
    each must be a leaf (gathered whole on entry), or ranks whose tokens skip an expert skip its gather."""
    import torch.nn as nn

    return sorted(
        {
            type(module).__name__
            for module in model.modules()
            if isinstance(getattr(module, "experts", None), nn.ModuleList) and len(module.experts) > 1
        }
    )


def mark_leaves(model, log) -> None:
    """Make every per-expert block a ZeRO-3 leaf with DeepSpeed's own `set_z3_leaf_modules`, before
    deepspeed.initialize installs its hooks."""
    names = leaf_blocks(model)
    if not names:
        return
    from deepspeed.utils import set_z3_leaf_modules

    classes = list({type(m) for m in model.modules() if type(m).__name__ in names})
    set_z3_leaf_modules(model, classes)
    log(f"moe: {', '.join(names)} keep experts as separate modules: ZeRO-3 gathers each block whole (a leaf)")


def enable_balancing_loss(model_config, coef: Optional[float]) -> Optional[float]:
    """Turn transformers' balancing loss on for training (`output_router_logits`), with `coef` replacing the
    config's `router_aux_loss_coef` when given. Returns the coefficient in effect, or None when the family
    has no balancing loss in transformers."""
    text, fam = text_config(model_config), family(model_config)
    if not is_moe(model_config) or (fam is not None and not fam.balancing_loss):
        return None
    if not hasattr(text, "router_aux_loss_coef"):
        return None
    if coef is not None:
        text.router_aux_loss_coef = coef
    text.output_router_logits = text.router_aux_loss_coef > 0
    return text.router_aux_loss_coef


def describe(model_config) -> str:
    """`8 experts, 2 per token, 24 of 24 layers sparse` for the startup line ('' for a dense model)."""
    if not is_moe(model_config):
        return ""
    n = len(sparse_layers(model_config))
    return (
        f"{num_experts(model_config)} experts, {top_k(model_config)} per token, {n} of "
        f"{text_config(model_config).num_hidden_layers} layers sparse"
    )


@dataclass(frozen=True)
class BalancingLoss:
    """The balancing loss train.py's own loss adds (lm_loss.install): transformers' `load_balancing_loss_func`
    made over a sequence-parallel group. Written here because transformers' function sees one rank's tokens
    only: under SP it would balance each slice of a sequence on its own, not the sequence (the fraction of
    tokens per expert times the mean router probability is not additive over slices). So the per-expert sums
    are all-reduced over the group first, the probabilities' with autograd, and the result equals
    transformers' on the whole row (tests/unit/modeling/test_moe_families.py)."""

    coef: float
    experts: int
    top_k: int
    scale: float = 1.0
    """Each rank's share of the term in the gradient. Without SP, 1. Under SP every rank of a group computes
    the group's aux and autograd's all-reduce sums the group's gradients, so each term is scaled by
    gradient_divisor / world (mesh.Mesh.gradient_divisor): 1/sp under ZeRO-1/2, 1 under ZeRO-3's average."""
    group: object = None
    """The process group over which one sequence's routing adds up (the SP group), None: this rank alone."""

    def aux(self, router_logits, attention_mask=None):
        """The balancing loss over every MoE layer's router logits ([tokens, experts] each), pad tokens
        (attention_mask 0) left out, as transformers counts them."""
        import torch
        import torch.nn.functional as F

        mask = None if attention_mask is None else attention_mask.reshape(-1).float()
        counts = torch.zeros(self.experts, device=router_logits[0].device)
        probs = torch.zeros(self.experts, device=router_logits[0].device)
        rows = torch.zeros((), device=router_logits[0].device)
        for logits in router_logits:
            weights = F.softmax(logits.float(), dim=-1)
            chosen = torch.topk(weights, self.top_k, dim=-1).indices
            keep = torch.ones(weights.shape[0], device=weights.device) if mask is None else mask.to(weights.device)
            counts = counts.index_add(0, chosen.reshape(-1), keep.repeat_interleave(self.top_k))
            probs = probs + (weights * keep.unsqueeze(-1)).sum(dim=0)
            rows = rows + keep.sum()
        if self.group is not None:
            import torch.distributed as dist
            import torch.distributed.nn.functional as dist_fn

            counts, rows = counts.clone(), rows.clone()
            dist.all_reduce(counts, group=self.group)
            dist.all_reduce(rows, group=self.group)
            probs = dist_fn.all_reduce(probs, group=self.group)
        return (counts / rows * probs / rows).sum() * self.experts

    def term(self, aux):
        """What this rank adds to its loss."""
        return self.coef * self.scale * aux


def parameters_in_words(model_config, n_params: int) -> str:
    """`4.32M parameters` for a dense model; `4.32M parameters, 2.10M active per token (8 experts, 2 per
    token, ...)` for a mixture of experts, where a token multiplies by only its k experts."""
    words = f"{n_params / 1e6:.2f}M parameters"
    if not is_moe(model_config):
        return words
    mlp = mlp_params(model_config)
    active = n_params - mlp.total + mlp.active
    return f"{words}, {active / 1e6:.2f}M active per token ({describe(model_config)})"
