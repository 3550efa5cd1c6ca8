"""What Ulysses sequence parallelism (DeepSpeed 0.19.8's ALST, `"sequence_parallel_size": N`) leaves on one rank.

The N ranks of a group hold the same rows, each its s/N slice of every sequence (zero_recipes/parallel/sequence_parallel.py
`shard`), so everything a decoder layer keeps outside attention is that of s/N tokens: embeddings, norms, the
projections' inputs and outputs, the MLP, and the loss region of the local tokens. Inside attention DeepSpeed's
all-to-all (runtime/sequence_parallel/ulysses_sp.py `UlyssesSPAttentionHF`) trades the sequence split for a head
split: the kernel runs on the whole sequence with heads/N query heads and kv_heads/N key-value heads, or one copy
of a key-value head when N > kv_heads (`kv_replication_factor`, `repeat_interleave`). For q and the output that is
the same bytes as s/N tokens of every head; for k and v it is N/kv_heads times more when the heads are replicated.
sdpa and flash keep no s x s matrix, so nothing grows with s^2.

The trace runs the model at s/N tokens with `ulysses_attention` in place of the kernel: DeepSpeed's reshapes, its
contiguous copies and a same-size buffer for each all-to-all (`_dim_zero_all_to_all` returns a new tensor of its
input's size, and so does its backward), then the real sdpa on the whole-sequence, heads/N shapes. Only the
values differ (one process holds no other rank's slice), which the memory does not depend on.

ZeRO partitions over every rank (DeepSpeed's seq_data_parallel_group is the world): model states are those of a
world-sized ZeRO group, not divided further by N.
"""

from __future__ import annotations


class _Exchange:
    """An all-to-all's memory in one process: a new buffer of the input's size forward, and another for the
    gradient backward (deepspeed/sequence/layer.py `_dim_zero_all_to_all_op` and its registered backward)."""

    fn = None

    @classmethod
    def apply(cls, x):
        if cls.fn is None:
            import torch

            class Exchange(torch.autograd.Function):
                @staticmethod
                def forward(ctx, t):
                    return t.clone()

                @staticmethod
                def backward(ctx, grad):
                    return grad.contiguous().clone()

            cls.fn = Exchange
        return cls.fn.apply(x.contiguous())


def ulysses_attention(sp: int):
    """An attention function with the shapes and copies of DeepSpeed's `UlyssesSPAttentionHF.forward` around
    transformers' own sdpa (the original, not whatever DeepSpeed has put under "sdpa" in this process)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def combine(x, local_heads: int, replicate: int):
        # [b, h, s_l, d] -> [s_l, b, h, d] (a view) -> repeat kv heads -> [ws, s_l, b, h_l, d] contiguous
        # -> all-to-all -> [s, b, h_l, d] contiguous -> [b, h_l, s, d] contiguous
        b, _h, s_l, d = x.shape
        x = x.permute(2, 0, 1, 3)
        if replicate > 1:
            x = x.repeat_interleave(replicate, dim=2)
        x = x.reshape(s_l, b, sp, local_heads, d).permute(2, 0, 1, 3, 4).contiguous()
        x = _Exchange.apply(x)
        x = x.reshape(sp * s_l, b, local_heads, d).contiguous()
        return x.permute(1, 2, 0, 3).contiguous()

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        b, heads, s_l, d = query.shape
        kv = key.shape[1]
        replicate = sp // kv if sp > kv else 1
        local_kv = 1 if replicate > 1 else kv // sp
        q = combine(query, heads // sp, 1)
        k, v = combine(key, local_kv, replicate), combine(value, local_kv, replicate)
        groups = getattr(module, "num_key_value_groups", None)
        module.num_key_value_groups = q.shape[1] // k.shape[1]
        kwargs.pop("position_ids", None)
        try:
            out, weights = sdpa_attention_forward(module, q, k, v, None, *args, **kwargs)  # [b, s, h_l, d]
        finally:
            if groups is not None:
                module.num_key_value_groups = groups
        # [b, s, h_l, d] -> [s, b, h_l * d] -> [ws, s_l, b, em_l] contiguous -> all-to-all
        # -> [s_l, b, ws, em_l] -> [s_l, b, em] contiguous -> [b, s_l, em]
        out = out.permute(1, 0, 2, 3).reshape(sp * s_l, b, -1)
        out = out.reshape(sp, s_l, b, out.shape[-1]).contiguous()
        out = _Exchange.apply(out)
        out = out.permute(1, 2, 0, 3).reshape(s_l, b, -1).contiguous()
        return out.permute(1, 0, 2).reshape(b, s_l, -1), weights

    return attention


def traced_attention(sp: int) -> str:
    """The attn_implementation name under which the trace finds `ulysses_attention(sp)` (and sdpa's mask)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = f"zero_recipes_ulysses_trace_{sp}"
    AttentionInterface.register(name, ulysses_attention(sp))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return name
