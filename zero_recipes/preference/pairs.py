"""Preference pairs as rows: each prompt computed once, both answers attending to it.

A pair is laid out as `prompt | chosen | rejected` in one stretch of a row. Position ids run 0..P-1 over the
prompt, then P.. again for each answer, as if each followed the prompt alone; the attention (attention.py) lets
the chosen tokens see the prompt and themselves, and the rejected tokens the prompt and themselves. So the prompt's
layers run once per pair instead of twice (TRL pads prompt+chosen and prompt+rejected as two rows; its DPO
`padding_free` is unavailable in 1.16), and nothing else changes: every answer token gets the logits it would get
in a row of its own.

A micro-batch of N pairs is one row of their stretches end to end (no padding at all). Its answer tokens are
predicted from the positions in `logits_index`, which the forward keeps (transformers' `logits_to_keep` given as
indices): the first answer token of each side from the prompt's last token, the others from the token before them
in their own answer. So the head runs on answer tokens only, never on prompts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zero_recipes.modeling.packed_attention import SHARED_PROMPT as PAIRS  # the batch key, as the attention reads it


@dataclass(frozen=True)
class Pair:
    index: int  # in its PairSamples: what the reference log-probs are stored by
    tokens: np.ndarray  # prompt, chosen, rejected, end to end
    prompt: int
    chosen: int
    rejected: int

    def __len__(self) -> int:
        return self.prompt + self.chosen + self.rejected


class PairSamples:
    """Pairs over one flat token array: pair i is tokens[start : start + P + C + R] with lengths (P, C, R) =
    `lengths[i]`. Read by data.BatchOrder as rows, with this collator."""

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray):
        self.tokens, self.starts, self.lengths = tokens, starts, lengths

    def __len__(self) -> int:
        return len(self.starts)

    def row(self, i: int) -> Pair:
        s, (p, c, r) = int(self.starts[i]), (int(n) for n in self.lengths[i])
        return Pair(i, np.asarray(self.tokens[s : s + p + c + r]), p, c, r)

    def row_lengths(self) -> np.ndarray:
        return self.lengths.sum(axis=1) if len(self) else np.zeros(0, dtype=np.int64)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @staticmethod
    def collate(pairs: list[Pair], pad_id: int = 0) -> dict:
        return collate(pairs)


def collate(pairs: list[Pair]) -> dict:
    """N pairs -> one row: input_ids and position_ids [1, T], the layout for the attention (PAIRS), and what the
    loss needs: which positions' logits to keep, the answer tokens they predict, which answer each belongs to
    (2 j for pair j's chosen, 2 j + 1 for its rejected), each answer's token count, the pairs' indices."""
    import torch

    ids, pos, layout, keep, targets, answer = [], [], [], [], [], []
    at = 0
    for j, pair in enumerate(pairs):
        p, c, r = pair.prompt, pair.chosen, pair.rejected
        ids.append(pair.tokens)
        pos += [np.arange(p + c), np.arange(p, p + r)]
        layout.append((at, p, c, r))
        last_prompt = at + p - 1
        for side, (first, n) in enumerate(((at + p, c), (at + p + c, r))):
            keep += [[last_prompt], np.arange(first, first + n - 1)]
            targets.append(pair.tokens[first - at : first - at + n])
            answer.append(np.full(n, 2 * j + side))
        at += len(pair)
    cat = lambda parts: torch.from_numpy(np.concatenate(parts).astype(np.int64))  # noqa: E731
    return {
        "input_ids": cat(ids)[None],
        "position_ids": cat(pos)[None],
        PAIRS: tuple(layout),
        "logits_index": cat(keep),
        "targets": cat(targets),
        "answer_of_target": cat(answer),
        "answer_tokens": torch.tensor([[p.chosen, p.rejected] for p in pairs], dtype=torch.int64),
        "pair_index": torch.tensor([p.index for p in pairs], dtype=torch.int64),
    }


def answer_logps(model, batch: dict):
    """Summed log-probs of every answer of a collated batch, [pairs, 2] (chosen, rejected), and the model's
    output (for a mixture of experts' balancing loss). `model`: the engine or the HF model. The head runs only
    at the positions that predict answer tokens; their log-softmax is taken in fp32, as TRL's."""
    import torch

    out = model(
        input_ids=batch["input_ids"],
        position_ids=batch["position_ids"],
        logits_to_keep=batch["logits_index"],
        use_cache=False,
        **{PAIRS: batch[PAIRS]},
    )
    logits = out.logits[0]
    logits = logits.float() if logits.element_size() < 4 else logits  # 16-bit logits: the log-softmax in fp32
    token_logps = logits.gather(-1, batch["targets"][:, None])[:, 0] - logits.logsumexp(-1)
    sums = torch.zeros(2 * batch["pair_index"].numel(), dtype=token_logps.dtype, device=token_logps.device)
    return sums.index_add(0, batch["answer_of_target"], token_logps).view(-1, 2), out


def padded(pairs: list[Pair], pad_id: int) -> dict:
    """The same pairs as TRL lays them out (DataCollatorForPreference): 2 N rows, prompt+chosen for every pair
    then prompt+rejected, right-padded, with a completion mask. The reference for the shared layout's tests and
    for a reference pass that must not depend on it."""
    import torch

    seqs = [p.tokens[: p.prompt + p.chosen] for p in pairs] + [
        np.concatenate([p.tokens[: p.prompt], p.tokens[p.prompt + p.chosen :]]) for p in pairs
    ]
    prompts = [p.prompt for p in pairs] * 2
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(seqs), T), dtype=torch.int64)
    completion = torch.zeros((len(seqs), T), dtype=torch.int64)
    for i, (s, p) in enumerate(zip(seqs, prompts)):
        ids[i, : len(s)] = torch.from_numpy(s.astype(np.int64))
        mask[i, : len(s)] = 1
        completion[i, p : len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask, "completion_mask": completion}
