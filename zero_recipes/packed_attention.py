"""Packed rows attend per example under sdpa: one causal sdpa call per example instead of one masked call
over the whole row.

A packed SFT row carries several examples, told apart by position ids that restart at 0. transformers keeps
them apart with a block-diagonal s x s mask, and sdpa with a mask computes every query against every key of
the row: attention costs grow with the row (s^2), not with the examples (the sum of their squared lengths), and
the mask also rules out sdpa's causal fast path. Measured on the SFT benchmark's rows (2048 tokens, skewed chat
lengths; docs/speed.md). The split here is exact: an example's tokens see the same keys as in a row of its own.
flash-attention does this itself (varlen from position ids), which is what to use on GPUs.

Where it applies: training forwards whose position ids restart inside a row (train.py's packed rows), and any
forward that reaches attention with no mask (Ulysses drops it, sequence_parallel.py). Everything else (eval,
generation, padded batches, sliding-window layers) takes sdpa unchanged.
"""

from __future__ import annotations


def per_example_sdpa(sdpa):
    import torch

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        pos = kwargs.get("position_ids")
        if (
            pos is None
            or query.shape[2] != pos.shape[-1]
            or query.shape[2] != key.shape[2]  # a KV cache: decoding, not a packed row
            or not (attention_mask is None or module.training)
            or getattr(module, "sliding_window", None)
        ):
            return sdpa(module, query, key, value, attention_mask, *args, **kwargs)
        starts = [(row == 0).nonzero().flatten().tolist() for row in pos.reshape(-1, pos.shape[-1])]
        if all(s == [0] for s in starts) or len(starts) != query.shape[0]:
            return sdpa(module, query, key, value, attention_mask, *args, **kwargs)
        rows = []
        for b, row_starts in enumerate(starts):
            cuts = (row_starts if row_starts and row_starts[0] == 0 else [0, *row_starts]) + [query.shape[2]]
            parts = [
                sdpa(module, query[b : b + 1, :, a:e], key[b : b + 1, :, a:e], value[b : b + 1, :, a:e], None,
                     *args, **kwargs)[0]
                for a, e in zip(cuts[:-1], cuts[1:])
                if e > a
            ]  # fmt: skip
            rows.append(torch.cat(parts, dim=1))  # sdpa returns [batch, seq, heads, head_dim]
        return torch.cat(rows, dim=0), None

    attention.per_example = True
    return attention


def install() -> None:
    """Put the per-example split in front of transformers' sdpa (once per process; before the first forward)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if not getattr(ALL_ATTENTION_FUNCTIONS["sdpa"], "per_example", False):
        ALL_ATTENTION_FUNCTIONS["sdpa"] = per_example_sdpa(ALL_ATTENTION_FUNCTIONS["sdpa"])
