"""Samples made of token segments, packing, and collation into model inputs.

A sample (one row of a batch) is a list of segments of a flat token array. Pretraining samples are
fixed windows of the whole concatenated stream (one segment, nothing dropped but the final tail). SFT
samples are whole examples: one per row, or several packed per row by best-fit decreasing. In a packed
row the position ids restart at each example, and the batch carries the cut points between examples
(packed_attention.varlen_kwargs: computed here once per batch, so no attention layer derives them from the
position ids on the device), so examples never see each other.
"""

from __future__ import annotations

import bisect

import numpy as np


class Samples:
    """Rows over one flat token array: row i is segments seg[ptr[i]:ptr[i+1]] of (start, length)."""

    def __init__(self, tokens: np.ndarray, mask, seg: np.ndarray, ptr: np.ndarray):
        self.tokens, self.mask, self.seg, self.ptr = tokens, mask, seg, ptr

    def __len__(self) -> int:
        return len(self.ptr) - 1

    def row(self, i: int):
        segs = self.seg[self.ptr[i] : self.ptr[i + 1]]
        return [(self.tokens[s : s + n], None if self.mask is None else self.mask[s : s + n]) for s, n in segs]

    def row_lengths(self) -> np.ndarray:
        return np.add.reduceat(self.seg[:, 1], self.ptr[:-1]) if len(self) else np.zeros(0, dtype=np.int64)

    @property
    def num_tokens(self) -> int:
        return int(self.seg[:, 1].sum())


def windows(n_tokens: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Pretraining: consecutive windows of the whole stream; only the final partial window is dropped."""
    n = n_tokens // block
    seg = np.stack([np.arange(n, dtype=np.int64) * block, np.full(n, block, dtype=np.int64)], axis=1)
    return seg.reshape(-1, 2), np.arange(n + 1, dtype=np.int64)


def one_per_row(starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    seg = np.stack([starts.astype(np.int64), lengths.astype(np.int64)], axis=1)
    return seg.reshape(-1, 2), np.arange(len(starts) + 1, dtype=np.int64)


def pack(starts: np.ndarray, lengths: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Best-fit decreasing: longest example first, each into the fullest row it still fits. Rows keep
    whole examples (none is split across rows). A bisected, sorted list of free space keeps it fast
    (400k examples in under a second)."""
    order = np.argsort(-lengths, kind="stable")
    free: list[tuple[int, int]] = []  # sorted (free tokens, row id)
    rows: list[list[int]] = []
    for i in order:
        n = int(lengths[i])
        k = bisect.bisect_left(free, (n, -1))
        if k == len(free):
            rows.append([int(i)])
            bisect.insort(free, (block - n, len(rows) - 1))
        else:
            space, r = free.pop(k)
            rows[r].append(int(i))
            bisect.insort(free, (space - n, r))
    members = np.fromiter((i for r in rows for i in r), dtype=np.int64, count=len(order))
    ptr = np.zeros(len(rows) + 1, dtype=np.int64)
    ptr[1:] = np.cumsum([len(r) for r in rows])
    seg = np.stack([starts[members], lengths[members]], axis=1).astype(np.int64)
    return seg.reshape(-1, 2), ptr


def collate(rows: list, pad_id: int, length: int | None = None) -> dict:
    """Rows of segments -> input_ids, labels (and position_ids or attention_mask) as int64 tensors.

    Labels are -100 on masked (prompt) tokens, on padding, and at the first token of every segment, which
    must not be predicted from the previous example. A batch with a packed row passes position ids that
    restart per segment, with any padding as one more segment; a batch of single segments with padding
    passes a plain attention mask, which every model understands. A packed batch also carries its cut
    points as transformers' varlen attention kwargs (packed_attention.varlen_kwargs), over the batch's
    tokens laid end to end: where each segment starts, then b x T."""
    import torch

    from zero_recipes.modeling.packed_attention import varlen_kwargs

    lens = [sum(len(t) for t, _ in r) for r in rows]
    T = length or max(lens)
    b = len(rows)
    ids = np.full((b, T), pad_id, dtype=np.int64)
    labels = np.full((b, T), -100, dtype=np.int64)
    packed = any(len(r) > 1 for r in rows)
    pos = np.zeros((b, T), dtype=np.int64) if packed else None
    cuts = []
    for i, r in enumerate(rows):
        at = 0
        for toks, mask in r:
            n = len(toks)
            if n:
                cuts.append(i * T + at)
            ids[i, at : at + n] = toks
            lab = np.asarray(toks, dtype=np.int64) if mask is None else np.where(np.asarray(mask) > 0, toks, -100)
            labels[i, at : at + n] = lab
            labels[i, at] = -100
            if packed:
                pos[i, at : at + n] = np.arange(n)
            at += n
        if packed and at < T:
            pos[i, at:] = np.arange(T - at)
            cuts.append(i * T + at)  # the padding tail: one more segment, as its restarting positions say
    batch = {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels)}
    if packed:
        batch["position_ids"] = torch.from_numpy(pos)
        batch.update(varlen_kwargs([*cuts, b * T]))
    elif min(lens) < T:
        batch["attention_mask"] = torch.from_numpy((np.arange(T)[None, :] < np.asarray(lens)[:, None]).astype(np.int64))
    return batch


def utilisation(samples: Samples, order_batches) -> float:
    """Real tokens / tokens computed, over the given batches of row indices (each padded to its longest)."""
    lens = samples.row_lengths()
    real = computed = 0
    for idx in order_batches:
        lb = lens[idx]
        real += int(lb.sum())
        computed += int(lb.max()) * len(idx)
    return real / computed if computed else 0.0
