"""The causal-LM loss, computed tile by tile so the logits of a whole sequence never exist at once.

At long context the loss region is the largest activation: logits for every token (s x V), their fp32
copy, the log-softmax and its gradient, about 14 s*b*V bytes in bf16 (55 GiB for one 32k sequence at a
128k vocabulary). Here the head and the cross-entropy run over tiles of `tile_tokens` tokens: each tile's
logits are made, reduced to a loss sum and dropped; backward recomputes one tile at a time. The summed loss
equals the untiled one up to summation order.

Two ways, by whether the head's weight is the embedding's. Untied, DeepSpeed's `sequence_tiled_compute`: it
runs a nested `torch.autograd.backward` per tile, accumulating the head's weight gradient in place, and masks
ZeRO's gradient hook on all but the last tile (`ds_grad_is_ready`). Tied, that last tile's hook hands the
weight to ZeRO before the embedding's share arrives later in the same backward: ZeRO-2 asserted
"model.embed_tokens.weight has already been reduced" (a tied Llama-3.2-1B on a GPU, 16 tiles) and ZeRO-3 kept
the embedding's gradient without the head's (docs/dev/deepspeed-bugs.md). So a tied head's tiles are torch
non-reentrant checkpoints in the one autograd graph, whose weight gradients add up with the embedding's before
the hook fires once. That costs a transient second copy of the head's weight gradient (autograd's sum beside
the next tile's), which the untied way avoids: 0.85 GiB more in the traced estimate of an 8B Llama's recipes.
Nor DeepSpeed's `TiledFusedLogitsLoss`: it runs the backward inside the forward with an incoming gradient of
1, so the head's weight gradient misses every later scale, DeepSpeed's 1/gradient_accumulation_steps included
(measured: with 2 accumulation steps the head's gradient came out doubled). Recomputing in backward costs one
more head forward per tile (about 2*h*V FLOPs per token, 2 % of an 8B model's step).

The model's `forward` is replaced on the instance (nothing else changes): called with `labels` or
`shift_labels`, it runs the decoder, then this loss, and returns no logits. Without them (eval,
generation, the export check) it is the model's own forward. Only families whose output is exactly
`lm_head(final hidden state)` are handled (KNOWN_HEADS); others keep transformers' loss.
"""

from __future__ import annotations

import math

from zero_recipes.modeling import moe

KNOWN_HEADS = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "phi3", "olmo", "olmo2", "starcoder2", "gpt2", "smollm3", "gemma"}
    | set(moe.FAMILIES)
)
"""Families whose logits are `lm_head(last_hidden_state)`: no soft-capping, scaling or extra terms. The
mixtures of experts (moe.FAMILIES) add their balancing loss, which `install` adds back (moe.BalancingLoss)."""

TILE_BYTES = 2**28
"""Auto tile: the fp32 logits of one tile stay under 256 MiB (512 tokens at a 128k vocabulary)."""


def knows_head(model_config) -> bool:
    text = model_config.get_text_config()
    if getattr(text, "final_logit_softcapping", None) or getattr(text, "logit_scale", None):
        return False
    return model_config.model_type in KNOWN_HEADS


def tile_tokens(cfg, model_config) -> int:
    """Tokens per loss tile: `loss_tile_tokens`, or as many as keep one tile's fp32 logits under TILE_BYTES."""
    if cfg.loss_tile_tokens:
        return cfg.loss_tile_tokens
    return max(1, TILE_BYTES // (4 * model_config.get_text_config().vocab_size))


def applies(cfg, model_config, sp: int) -> bool:
    """Whether train.py computes the loss itself: always under SP (transformers ignores `shift_labels`
    without `labels`), else when tiling is on and could engage for this run's micro-batch."""
    # DPO keeps the logits of answer tokens only (preference/pairs.py); the estimator's cfg may not name an objective
    if not knows_head(model_config) or getattr(cfg, "objective", "lm") != "lm":
        return False
    local_tokens = cfg.per_device_train_batch_size * cfg.block_size // sp
    return sp > 1 or (cfg.tiled_loss and local_tokens > tile_tokens(cfg, model_config))


def tiles_loss(cfg) -> bool:
    """Whether the run's loss may be tiled (what the memory estimate traces): `tiled_loss` for the LM objective.
    DPO computes the logits of its answer tokens whole (preference/pairs.py), traced by memory/objective.py."""
    return bool(getattr(cfg, "tiled_loss", True)) and getattr(cfg, "objective", "lm") == "lm"


def install(model, tokens_per_tile: int, tiled: bool, zero3: bool, balance: moe.BalancingLoss | None = None) -> None:
    """Replace `model.forward` (on this instance) by one that computes the loss with `summed_loss`, plus a
    mixture of experts' balancing loss (`balance`), which a loss from the logits alone would drop."""
    import torch.nn.functional as F
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    decoder = getattr(model, model.base_model_prefix)
    head = model.get_output_embeddings()
    tied = head.weight is model.get_input_embeddings().weight
    own_forward = model.forward

    def forward(input_ids=None, labels=None, shift_labels=None, num_items_in_batch=None, eval_targets=None, **kwargs):
        if eval_targets is not None:  # eval: per-row sums, no logits kept (loop.evaluate)
            hidden = decoder(input_ids=input_ids, **kwargs).last_hidden_state
            return {"row_stats": row_stats(head, hidden, eval_targets, tokens_per_tile, zero3)}
        if labels is None and shift_labels is None:
            return own_forward(input_ids=input_ids, **kwargs)
        if shift_labels is None:  # as transformers shifts: the target of token t is token t+1
            shift_labels = F.pad(labels[:, 1:], (0, 1), value=-100)
        kwargs.pop("logits_to_keep", None)
        kwargs.pop("output_router_logits", None)
        routed = {"output_router_logits": True} if balance is not None else {}
        out = decoder(input_ids=input_ids, **kwargs, **routed)
        hidden = out.last_hidden_state
        tiles = agreed_tiles(shift_labels.numel(), tokens_per_tile, zero3, hidden.device) if tiled else 1
        loss = summed_loss(head, hidden, shift_labels, tiles, tied)
        count = num_items_in_batch if num_items_in_batch is not None else (shift_labels != -100).sum()
        if balance is None:
            return CausalLMOutputWithPast(loss=loss / count)
        mask = kwargs.get("attention_mask")
        aux = balance.aux(out.router_logits, mask if mask is not None and mask.dim() == 2 else None)
        return MoeCausalLMOutputWithPast(loss=loss / count + balance.term(aux), aux_loss=aux)

    model.forward = forward
    model.computes_own_loss = True  # eval_row_stats asks for row sums instead of logits


def agreed_tiles(tokens: int, tokens_per_tile: int, zero3: bool, device) -> int:
    """Tiles for this micro-batch. Under ZeRO-3 the same on every rank (one small all-reduce): each call
    of a layer gathers its weights, a collective, so ranks with different row lengths (SFT) must still make
    the same number of calls."""
    import torch
    import torch.distributed as dist

    tiles = math.ceil(tokens / tokens_per_tile)
    if zero3 and dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([tiles], dtype=torch.long, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        tiles = int(t.item())
    return max(1, tiles)


def row_stats(head, hidden, targets, tokens_per_tile: int, zero3: bool):
    """Eval without the whole logits: per row, the summed cross-entropy over its targets, their count, and
    how many the argmax gets wrong (0 with at least one target: greedy exact match), tile by tile."""
    import torch
    import torch.nn.functional as F

    b, s = targets.shape
    tiles = agreed_tiles(b * s, tokens_per_tile, zero3, hidden.device)
    step = -(-s // tiles)
    out = torch.zeros(b, 3, dtype=torch.float64, device=hidden.device)
    with torch.no_grad():
        for i in range(tiles):  # every rank the same number of head calls (ZeRO-3 gathers per call)
            x, y = hidden[:, i * step : (i + 1) * step], targets[:, i * step : (i + 1) * step]
            logits = head(x).float()
            valid = y != -100
            ce = F.cross_entropy(logits.transpose(1, 2), y, ignore_index=-100, reduction="none")
            out[:, 0] += ce.sum(dim=1)
            out[:, 1] += valid.sum(dim=1)
            out[:, 2] += ((logits.argmax(-1) != y) & valid).sum(dim=1)
    return out


def summed_loss(head, hidden, targets, tiles: int, tied: bool = False):
    """Sum of the cross-entropy over the tokens whose target is not -100, in `tiles` tiles (the module's
    docstring: DeepSpeed's tiles for an untied head, checkpointed tiles for a tied one). The logits are upcast
    to fp32 before the softmax, as transformers' ForCausalLMLoss does. Exactly `tiles` head calls each way,
    empty trailing tiles included: under ZeRO-3 each call gathers (agreed_tiles)."""
    import torch.nn.functional as F

    def tile_loss(x, y):
        logits = head(x).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100, reduction="sum")

    if tiles <= 1:
        return tile_loss(hidden, targets)
    if tied:
        return _checkpointed_tiles(tile_loss, hidden, targets, tiles)
    from deepspeed.runtime.sequence_parallel.ulysses_sp import sequence_tiled_compute

    x = hidden.reshape(1, -1, hidden.shape[-1])  # batch and sequence as one axis: tiles cut across rows
    y = targets.reshape(1, -1)
    return sequence_tiled_compute(
        tile_loss,
        x.shape[1],
        tiles,
        kwargs_to_shard={"x": x, "y": y},
        kwargs_to_pass={},
        grad_requiring_tensor_key="x",
        compute_params=[head.weight],
        output_unshard_dimension=0,
        output_reduction="sum",
    )


def _checkpointed_tiles(tile_loss, hidden, targets, tiles: int):
    """The tiles as non-reentrant checkpoints in the caller's autograd graph: every parameter's gradient (the
    head's, and the tied embedding's) is summed by autograd and accumulated once per backward, as ZeRO-1/2's
    hook requires."""
    import torch
    from torch.utils.checkpoint import checkpoint

    x = hidden.reshape(-1, hidden.shape[-1])  # batch and sequence as one axis: tiles cut across rows
    y = targets.reshape(-1)
    step = -(-x.shape[0] // tiles)
    sizes = [max(0, min(step, x.shape[0] - i * step)) for i in range(tiles)]
    # split, not slices: its backward concatenates the tiles' input gradients once, where each slice's would
    # make a whole-size zero tensor. No RNG in a head and a cross-entropy: nothing to restore on recompute.
    losses = [
        checkpoint(tile_loss, xt, yt, use_reentrant=False, preserve_rng_state=False)
        for xt, yt in zip(x.split(sizes), y.split(sizes))
    ]
    return torch.stack(losses).sum()


def install_tiled_mlp(model, zero3: bool) -> int:
    """Run every decoder layer's MLP through DeepSpeed's TiledMLP: in ceil(tokens / hidden_size) tiles, the
    intermediate (gate, up, activation: about 3 x intermediate_size per token) made one tile at a time and
    recomputed in backward. Returns how many MLPs were wrapped."""
    n = 0
    hidden_size = model.config.get_text_config().hidden_size
    for name, module in model.named_modules():
        if name.endswith(".mlp") and ".layers." in name and hasattr(module, "down_proj"):
            _tile_mlp(module, hidden_size, zero3)
            n += 1
    return n


def _tile_mlp(mlp, hidden_size: int, zero3: bool) -> None:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    own_forward = mlp.forward
    params = list(mlp.parameters())

    def forward(x):
        tiles = agreed_tiles(x.shape[-2], hidden_size, zero3, x.device)
        if tiles == 1:
            return own_forward(x)
        return TiledMLP.apply(lambda _self, x_tile: own_forward(x_tile), mlp, x, tiles, params)

    mlp.forward = forward


def eval_row_stats(model, module, batch: dict, labels):
    """Per row of an eval batch: (loss sum, label tokens, wrong argmax tokens). `model` is called (the engine),
    `module` is what it wraps. A model whose loss this module computes gives its row sums tile by tile (no
    logits kept); any other is asked for its logits."""
    import torch

    if getattr(module, "computes_own_loss", False):
        targets = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
        loss_sum, n, wrong = model(**batch, eval_targets=targets, use_cache=False)["row_stats"].unbind(1)
        return loss_sum, n, wrong
    target = labels[:, 1:]
    logits = model(**batch, use_cache=False).logits[:, :-1].float()
    valid = target != -100
    losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none", ignore_index=-100)
    return losses.sum(dim=1), valid.sum(dim=1), ((logits.argmax(-1) != target) & valid).sum(dim=1)


def install_for_run(model, plan, log) -> None:
    """train.py's own loss (tiled over the sequence; always under SP) and the tiled MLP, where they apply to
    the run `plan` (plan.RunPlan). Under ZeRO-3 the ranks agree on their tile counts (`agreed_tiles`)."""
    cfg, model_config, sp, zero3 = plan.cfg, plan.model_config, plan.mesh.sp, plan.zero_stage == 3
    if plan.parallelism.owns_loss:
        log("loss: train.py's, on the pipeline's last stage (the head is a stage's layer: not tiled)")
    elif applies(cfg, model_config, sp):
        tokens = tile_tokens(cfg, model_config)
        install(model, tokens, cfg.tiled_loss, zero3, balancing_loss(plan))
        local = cfg.per_device_train_batch_size * cfg.block_size // sp
        if cfg.tiled_loss and local > tokens:
            log(f"loss: head and cross-entropy in tiles of {tokens} tokens; the whole logits are never held")
        else:
            log(f"loss: computed by train.py over each rank's {local} tokens per micro-batch (one tile)")
    elif cfg.tiled_loss and not knows_head(model_config):
        log(f"loss: transformers' own (untiled): train.py does not know the output head of {model_config.model_type}")
    if cfg.tiled_mlp:
        n = install_tiled_mlp(model, zero3)
        log(f"mlp: {n} decoder MLPs run in tiles of {model_config.get_text_config().hidden_size} tokens (TiledMLP)")


def balancing_loss(plan) -> moe.BalancingLoss | None:
    """The balancing loss train.py's loss adds for this run, when its model has one turned on."""
    text = plan.model_config.get_text_config()
    if not getattr(text, "output_router_logits", False):
        return None
    group, scale, mesh = None, 1.0, plan.mesh
    if mesh.sp > 1:  # one sequence's routing adds up over its SP group (moe.BalancingLoss)
        from deepspeed.runtime.sequence_parallel import parallel_state_sp

        group = parallel_state_sp.get_sequence_parallel_group()
        scale = mesh.gradient_divisor(plan.zero_stage) / mesh.world
    experts, k = moe.num_experts(plan.model_config), moe.top_k(plan.model_config)
    return moe.BalancingLoss(text.router_aux_loss_coef, experts, k, scale, group)
