"""What a packed row's attention costs: one forward+backward of the SFT benchmark's model on two 2048-token rows
packed with the benchmark's conversation lengths, three ways, in this process (1 thread):
- text: the same tokens as one causal sequence per row (what pretraining text costs);
- block mask: transformers' block-diagonal mask from the restarting position ids (sdpa over the whole row);
- per example: zero_recipes/modeling/packed_attention.py, one causal sdpa call per example (what train.py runs), on the
  batch as train.py's collator builds it (data/packing.py `collate`: position ids and the cut points between
  examples, so no layer derives them from the position ids).
The median of 5 timed steps each (after one untimed; `steps`), and the share of the masked step spent in attention
(torch.profiler).
"""

from __future__ import annotations

import statistics
import time


def rows(block: int, high: int) -> list[list[int]]:
    """Two rows filled in order with the benchmark's lengths (plus the chat template's ~12 tokens)."""
    from .data import skewed_lengths

    out, cur = [], []
    for n in skewed_lengths(400, seed=0, high=high):
        if sum(cur) + n + 12 > block:
            out.append(cur)
            cur = []
            if len(out) == 2:
                return out
        cur.append(n + 12)
    raise RuntimeError("not enough lengths for two rows")


def measure(block: int, high: int, steps: int = 5) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from zero_recipes.data import packing
    from zero_recipes.modeling import packed_attention
    from zero_recipes.modeling.model import TINY_LLAMA

    torch.set_num_threads(1)
    fields = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    config = AutoConfig.for_model("llama", **{**fields, "max_position_embeddings": block})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()
    lengths = rows(block, high)
    tokens = torch.randint(1, config.vocab_size, (sum(map(sum, lengths)),)).tolist()
    segments, at = [], 0
    for r in lengths:
        segments.append([])
        for n in r:
            segments[-1].append((tokens[at : at + n], None))
            at += n
    batch = packing.collate(segments, pad_id=0, length=block)  # what train.py feeds: the padding tail included
    ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"]
    cuts = {k: v for k, v in batch.items() if k not in ("input_ids", "labels")}  # position ids and cut points

    def step(**kw) -> float:
        start = time.perf_counter()
        model(input_ids=ids, labels=labels, use_cache=False, **kw).loss.backward()
        model.zero_grad()
        return time.perf_counter() - start

    def timed(**kw) -> float:
        step(**kw)
        return statistics.median(step(**kw) for _ in range(steps))

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    out = {"examples_per_row": [len(r) for r in lengths], "text": timed(), "block_mask": timed(position_ids=pos)}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(position_ids=pos)
    ops = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in ops)
    out["block_mask_attention_share"] = sum(e.self_cpu_time_total for e in ops if "attention" in e.key) / total
    packed_attention.install()
    try:
        out["per_example"] = timed(**cuts)
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
    return out
