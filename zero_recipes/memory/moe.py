"""The memory estimate of a mixture of experts: what one rank holds of the experts, and what routing adds.

Model states. Every expert's weights, gradients and optimizer states are counted: transformers 5 builds every
expert (packed 3-D parameters, `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]), so ModelShape's count
has them all. Under DeepSpeed AutoEP (`expert_parallel.autoep_size` = ep) a rank holds the dense weights (the
router and shared experts included) and E/ep of every layer's experts (module_inject/auto_ep_layer.py: its
GroupedExperts w1, w3 [E/ep, I, H] and w2 [E/ep, H, I]); ZeRO shards the dense ones over all N ranks and the
experts over the N/ep ranks holding the same ones (the expert-data-parallel group: stage_1_and_2.py's expert
param groups, engine.py `_resolve_zero3_param_placement` under ZeRO-3). So a rank's partitions are
D/N + (X/ep)/(N/ep) = (D + X)/N, as without EP, and what it holds whole is D + X/ep. states.py's terms are
a*P (held whole) and b*P/N (partitioned), and they stay exact with P = D + X/ep and N replaced by
N (D + X/ep) / (D + X) (`Split.zero_world`), gathered ZeRO-3 shards (1 - 1/N) P included.

ZeRO-3 gathers a layer's experts at once (the packed parameters are single tensors; under EP the E/ep local
ones), whichever tokens went where: the gathered term is at least one layer's experts less this rank's shard
(`gather_floor`), whatever stage3_max_live_parameters says; without checkpointing the backward keeps every
layer's (`saved_gather_bytes`). Under EP, AutoEP builds its local experts at
deepspeed.initialize, after the model exists (ep_repack.py `repack_expert_weights`, reading the source
through `GatheredParameters` under ZeRO-3): init holds the built model, the local copies of every layer's
experts, and under ZeRO-3 one layer's whole source experts (`init_floor`).

Activations. Without EP the installed model's code is traced as for a dense model (activations.py): its
router logits [T, E], their fp32 softmax, top-k, the sorted token copies [T*k, H] and each expert's MLP on
the T*k rows its tokens chose (transformers' grouped_mm path, whose saved tensors the trace counts; its
fake-tensor meta refuses fp32, so the trace runs transformers' own fallback op, which saves the same inputs:
`traceable_experts`). Whatever the routing, a rank's experts compute exactly T*k rows (plus alignment).
Under EP the rows a rank's experts receive depend on where every rank's tokens go: at most
ep * T * min(k, E/ep) (each token picks k distinct experts, at most E/ep of them on one rank). The estimate
counts `imbalance` x T*k rows on the most-loaded rank, default 2 (EXPERT_IMBALANCE), capped at that bound:
AutoEP drops no token, and train.py trains with the balancing loss on, under which GShard and Switch train
at a capacity factor of 2 (GShard) or 1.25-2 (Switch) with few tokens over capacity; for ep = 2 with
E/ep >= k, 2 is the hard worst case. The rows beyond the balanced T*k (which the trace already counts) cost
AutoEP's saved bytes per row (`ROW_SAVED`), and one layer's dispatch buffers (the all-to-all receive buffer
and its padded permuted copy, `_AllToAllV` and `permute_by_local_expert`) are live at its peak.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from zero_recipes.modeling import moe

EXPERT_IMBALANCE = 2.0
"""Rows on the most-loaded EP rank over the balanced T*k (see the module docstring)."""


@dataclass(frozen=True)
class Split:
    """One rank's share of a mixture of experts' parameters."""

    total: int
    """Every parameter of the model (every expert)."""
    routed: int
    """Every routed expert's parameters (moe.mlp_params), what EP divides."""
    per_layer: int
    """One MoE layer's routed experts: what ZeRO-3 gathers at once."""
    ep: int
    world: int
    active: int
    """Parameters a token multiplies by (k routed experts, router, shared experts, the rest)."""
    sparse_layers: int
    experts: int
    top_k: int

    @property
    def held(self) -> int:
        """Parameters one rank holds before ZeRO: the dense ones and E/ep of every layer's experts."""
        return self.total - self.routed + self.routed // self.ep

    @property
    def zero_world(self) -> float:
        """The N for states.py over `held` parameters that gives every partitioned term (D + X)/N bytes."""
        return self.world * self.held / self.total

    def as_json(self) -> dict:
        return {
            "total_params": self.total,
            "active_params": self.active,
            "routed_params": self.routed,
            "held_params": self.held,
            "experts": self.experts,
            "top_k": self.top_k,
            "sparse_layers": self.sparse_layers,
            "expert_parallel": self.ep,
            "expert_shards": self.world // self.ep,
        }


def split(model_config, total: int, ep: int, world: int) -> Split | None:
    """None for a dense model. `total`: the built model's parameter count (ModelShape)."""
    if not moe.is_moe(model_config):
        return None
    mlp = moe.mlp_params(model_config)
    return Split(
        total,
        mlp.routed,
        mlp.routed_per_layer,
        ep,
        world,
        total - mlp.total + mlp.active,
        len(moe.sparse_layers(model_config)),
        moe.num_experts(model_config),
        moe.top_k(model_config),
    )


def held_largest(model_config, largest: int, s: Split) -> int:
    """The largest parameter a rank holds under EP: AutoEP's w1/w2/w3 are [E/ep, I, H] each (the packed
    gate_up [E, 2I, H] cut in two), so the largest is the dense model's largest or one of those."""
    if s.ep == 1:
        return largest
    text = moe.text_config(model_config)
    one = s.per_layer // (3 * s.experts)  # one expert's I x H
    dense = [p for name, p in _param_sizes(model_config) if ".experts." not in name]
    return max(max(dense, default=0), one * s.experts // s.ep, text.hidden_size)


def _param_sizes(model_config):
    from zero_recipes.modeling.model import meta_model

    return [(n, p.numel()) for n, p in meta_model(model_config).named_parameters()]


def gather_floor(s: Split, p: int) -> int:
    """ZeRO-3: the bytes of one layer's (local) experts gathered beyond this rank's shard of them."""
    local = s.per_layer // s.ep
    shards = s.world // s.ep
    return int(p * local * (1 - 1 / shards))


def saved_gather_bytes(s: Split, p: int, counted: float, checkpointing: bool) -> int:
    """ZeRO-3: the gathered experts the backward keeps alive, beyond what states.py's gathered term (`counted`
    bytes, the live parameters DeepSpeed tracks) holds. DeepSpeed releases a parameter by rebinding `param.data`
    (partition_parameters.py `free_param`), and it wraps `nn.functional.linear` so a Linear's backward saves the
    parameter, not its data (`zero3_linear_wrap`); the experts' matmuls are not Linears (transformers'
    `grouped_mm`, AutoEP's per-expert `matmul` of `w1[e]`), so their autograd nodes save views of the gathered
    tensor, which then outlives the release until that layer's backward: every sparse layer's gathered experts
    from the forward on, and the one the backward gathers again beside it. Under gradient checkpointing the
    forward saves nothing inside a layer, so it is one layer's (the gather floor). With one shard (ep = world) the
    experts are never gathered: none. Measured: Qwen2-MoE ZeRO-3, -8.9 % without this term, -0.4 % with it."""
    shards = s.world // s.ep
    if shards == 1 or checkpointing:
        return 0
    local, layer = s.routed / s.ep, s.per_layer / s.ep
    counted_experts = min(counted, p * (1 - 1 / shards) * local)  # the experts' part of what states.py counts
    return int(max(0.0, p * (local + layer) - counted_experts))


def init_floor(s: Split, stage: int, build_bytes: int) -> int:
    """Under EP, what init holds at AutoEP's repack: the model as built (every rank's whole model under ZeRO-1/2;
    its 1/N partition under ZeRO-3's zero.Init, plus one layer's source experts gathered whole), and the local
    copies of every layer's experts, at `build_bytes` a parameter."""
    if s.ep == 1:
        return 0
    built = s.total if stage < 3 else s.total / s.world + s.per_layer
    return int(build_bytes * (built + s.routed / s.ep))


def adjust_phases(
    by_phase: dict,
    s: Split,
    stage: int,
    p: int,
    cap: float,
    build_bytes: int,
    temp: int,
    gpu: bool,
    checkpointing: bool,
):
    """states.phases' result with the MoE terms: ZeRO-3's gathered parameters hold at least a layer's experts
    (the cap bounds the rest), and without checkpointing every layer's, which the backward keeps (saved_gather_bytes); init at least AutoEP's repack; ZeRO-1/2's step one optimizer group at a time
    under EP (`grouped_step_delta`, `temp` the optimizer's temporaries per element). `gpu`: device and host
    apart (ZeRO-1/2 build the model and AutoEP repacks it on the host: engine.py runs
    `_configure_expert_parallel` before `_configure_distributed_model` moves the module)."""
    from dataclasses import replace

    out = dict(by_phase)
    if stage in (1, 2):
        step, cut = out["optimizer_step"], -grouped_step_delta(s, p, temp)
        from_buffers = min(cut, step.buffers)
        out["optimizer_step"] = replace(
            step, buffers=step.buffers - from_buffers, states=step.states - (cut - from_buffers)
        )
    if stage == 3 and s.world > 1:
        counted = p * min((1 - 1 / s.zero_world) * s.held, cap)  # what states.py's gathered term holds
        extra = max(gather_floor(s, p) - int(counted), saved_gather_bytes(s, p, counted, checkpointing), 0)
        for k in ("forward", "forward_backward"):
            out[k] = replace(out[k], buffers=out[k].buffers + extra)
    floor, init = init_floor(s, stage, build_bytes), out["init"]
    if gpu and stage < 3:
        out["init"] = replace(init, host_buffers=max(init.host_buffers, floor - init.host_states))
    elif floor > init.device:
        out["init"] = replace(init, buffers=floor - init.states)
    return out


# deepspeed/moe/utils.py `split_params_into_different_moe_groups_for_optimizer`'s default chunk of expert params
MAX_GROUP_SIZE = 178956971


def step_groups(s: Split) -> list[float]:
    """Under EP, the optimizer groups' partitions one rank steps, in elements, in the order ZeRO-1/2 step them:
    the dense group(s) (over N ranks), then the experts' groups (engine.make_optimizer hands DeepSpeed's own split
    the parameters: one group per expert-parallel group name, chunked at MAX_GROUP_SIZE elements whole
    parameters at a time), each over the N/ep expert-data-parallel ranks. AutoEP's w1, w2, w3 are E/ep x I x H
    each, one layer after another."""
    shards = s.world // s.ep
    one = s.per_layer // (3 * s.ep)  # one of AutoEP's w1/w2/w3
    chunks, cur = [], 0
    for _ in range(3 * s.sparse_layers):
        if cur and cur + one > MAX_GROUP_SIZE:
            chunks.append(cur)
            cur = 0
        cur += one
    chunks.append(cur)
    return [(s.total - s.routed) / s.world] + [c / shards for c in chunks]


def grouped_step_delta(s: Split, p: int, temp: int) -> int:
    """ZeRO-1/2 steps one optimizer group at a time (stage_1_and_2.py `step`, per group: the flat copy of its
    gradient partition (p B), its fp32 copy (4 B) and the optimizer's temporaries (`temp` B), freed before the
    next group), where states.py counts one group of everything, (p + 4 + temp) / N a parameter. The
    difference, <= 0: the transients of the largest group instead of all of them."""
    if s.ep == 1:
        return 0
    groups = step_groups(s)
    return int((p + 4 + temp) * (max(groups) - sum(groups)))


# AutoEP's saved bytes per routed row, in units of p (module_inject/auto_ep_layer.py `_forward`, moe/ep_experts.py):
# the permuted input (H, saved by w1 and w3's matmuls), gate and up (I each, saved by the SwiGLU), silu(gate)
# (I, saved by the product), its product (I, saved by w2's matmul), and the expert output (H, saved by the
# combine's weighting)
def row_saved(h: int, i: int) -> int:
    return 2 * h + 4 * i


def worst_rows(s: Split, tokens: int, imbalance: float) -> float:
    """Rows the most-loaded EP rank's experts receive: imbalance x the balanced T*k, at most every rank's tokens
    to this rank's E/ep experts, k distinct ones each."""
    balanced = tokens * s.top_k
    bound = s.ep * tokens * min(s.top_k, s.experts // s.ep)
    return min(max(1.0, imbalance) * balanced, bound)


def ep_activation_bytes(
    model_config, s: Split, micro: int, seq: int, p: int, checkpointing: bool, imbalance: float
) -> int:
    """Under EP, what routing adds to the traced activations: the rows beyond the balanced T*k on the most
    loaded rank (every sparse layer keeps them, one layer under gradient checkpointing), and one layer's
    dispatch buffers (the all-to-all receive buffer and the permuted, alignment-padded copy of it)."""
    if s.ep == 1:
        return 0
    text = moe.text_config(model_config)
    h, i = text.hidden_size, s.per_layer // (3 * s.experts * text.hidden_size)
    tokens = micro * seq
    rows = worst_rows(s, tokens, imbalance)
    extra_rows = rows - tokens * s.top_k
    layers = 1 if checkpointing else s.sparse_layers
    align = 8 * (s.experts // s.ep)  # ep_kernels.TOKEN_GROUP_ALIGN_SIZE_M per local expert
    dispatch = 2 * (rows + align) * h
    return int(p * (layers * extra_rows * row_saved(h, i) + dispatch))


@contextlib.contextmanager
def traceable_experts():
    """Inside the activation trace: transformers' grouped_mm experts run its own fallback op
    (`transformers::grouped_mm_fallback`, with a fake kernel) instead of torch's grouped_mm, whose meta kernel
    refuses fp32 under fake tensors (a real CPU run takes fp32). Both save the input and the weight for the
    backward and return [rows, out], so the bytes counted are the same; only fake inputs are redirected."""
    try:
        from transformers.integrations import moe as hf_moe
    except ImportError:  # a transformers without packed experts: nothing to redirect
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensor

    original = hf_moe._can_use_grouped_mm

    def can_use(input, weight, offs):
        return (
            False if isinstance(weight, FakeTensor) or isinstance(input, FakeTensor) else original(input, weight, offs)
        )

    hf_moe._can_use_grouped_mm = can_use
    try:
        yield
    finally:
        hf_moe._can_use_grouped_mm = original


def describe(s: Split) -> str:
    """`46.70B parameters, 12.88B active per token; 8 experts, 2 per token; EP 8: each rank holds 1 of every
    layer's 8 experts (5.63B parameters)` for the tool."""
    words = f"{s.total / 1e9:.2f}B parameters, {s.active / 1e9:.2f}B active per token; {s.experts} experts, "
    words += f"{s.top_k} per token, {s.sparse_layers} sparse layers"
    if s.ep > 1:
        words += (
            f"; EP {s.ep}: each rank holds {s.experts // s.ep} of every layer's {s.experts} experts "
            f"({s.held / 1e9:.2f}B parameters), their states sharded over {s.world // s.ep} rank(s)"
        )
    return words
