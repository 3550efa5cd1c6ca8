"""Packed rows attend per example (zero_recipes/modeling/packed_attention.py): the same logits and gradients as
transformers' block-diagonal mask and as each example alone, while eval, padded batches and decoding keep
transformers' own sdpa path; with the collator's cut points no attention layer reads a device value."""

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from zero_recipes.data import packing
from zero_recipes.modeling import packed_attention
from zero_recipes.modeling.model import TINY_LLAMA, enable_checkpointing

LENGTHS = [30, 50, 20]


@pytest.fixture
def model():
    fields = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    config = AutoConfig.for_model("llama", **fields)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(config)
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    yield m
    ALL_ATTENTION_FUNCTIONS["sdpa"] = original


def _row():
    torch.manual_seed(1)
    ids = torch.randint(0, 4096, (2, sum(LENGTHS)))
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None].repeat(2, 1)
    return ids, pos


def _forward_backward(m, ids=None, pos=None, **batch):
    m.zero_grad()
    batch = batch or {"input_ids": ids, "labels": ids, "position_ids": pos}
    out = m(**batch, use_cache=False)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}


def test_per_example_attention_equals_the_block_mask_and_each_example_alone(model):
    ids, pos = _row()
    model.train()
    masked_logits, masked_grads = _forward_backward(model, ids, pos)  # transformers' block-diagonal mask
    packed_attention.install()
    wrapped = ALL_ATTENTION_FUNCTIONS["sdpa"]
    packed_attention.install()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is wrapped  # idempotent: one wrapper, not two
    logits, grads = _forward_backward(model, ids, pos)
    assert torch.allclose(logits, masked_logits, atol=1e-5)
    for name, g in grads.items():
        assert torch.allclose(g, masked_grads[name], atol=1e-5, rtol=1e-4), name
    starts = [0, 30, 80]
    alone = torch.cat(
        [model(input_ids=ids[:, a : a + n], use_cache=False).logits for a, n in zip(starts, LENGTHS)], dim=1
    )
    assert torch.allclose(logits, alone.detach(), atol=1e-5)
    leaked = model(input_ids=ids, use_cache=False).logits  # one causal sequence: examples see each other
    assert not torch.allclose(leaked[:, 30:], alone[:, 30:], atol=1e-3)


def test_eval_padding_and_decoding_keep_transformers_own_path(model):
    ids, pos = _row()
    model.eval()
    with torch.no_grad():
        before = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        mask = torch.ones_like(ids)
        mask[1, -7:] = 0
        padded_before = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        generated_before = model.generate(ids[:1, :10], max_new_tokens=5, do_sample=False)
        packed_attention.install()
        assert torch.equal(model(input_ids=ids, position_ids=pos, use_cache=False).logits, before)
        assert torch.equal(model(input_ids=ids, attention_mask=mask, use_cache=False).logits, padded_before)
        assert torch.equal(model.generate(ids[:1, :10], max_new_tokens=5, do_sample=False), generated_before)


HOST_READS = {"aten.nonzero.default", "aten._local_scalar_dense.default", "aten.masked_select.default"}
"""aten ops whose result needs a device tensor's values on the host (a data-dependent shape, or .item()):
each one a host sync on a GPU."""


class HostReads(TorchDispatchMode):
    def __init__(self, seen: list):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in HOST_READS:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def _packed_batch():
    """Row 0: the three examples of _row(); row 1: two examples and a padding tail, as train.py collates them."""
    rng = np.random.default_rng(2)
    rows = [[(rng.integers(1, 4096, n), None) for n in LENGTHS], [(rng.integers(1, 4096, n), None) for n in (40, 35)]]
    return packing.collate(rows, pad_id=0)


def test_with_the_collators_cut_points_no_attention_layer_reads_the_device(model):
    batch = _packed_batch()
    model.train()
    enable_checkpointing(model)  # the recompute runs attention a second time per layer
    packed_attention.install()
    split = ALL_ATTENTION_FUNCTIONS["sdpa"]
    reads: list = []

    def recorded(*args, **kwargs):
        with HostReads(reads):
            return split(*args, **kwargs)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = recorded
    positions_only = {k: batch[k] for k in ("input_ids", "labels", "position_ids")}
    logits, grads = _forward_backward(model, **positions_only)
    layers = model.config.num_hidden_layers
    assert reads.count("aten.nonzero.default") == 2 * 2 * layers  # derived per row, per layer, twice
    reads.clear()
    got_logits, got_grads = _forward_backward(model, **batch)
    assert reads == []
    assert torch.equal(got_logits, logits)  # the same slices, so the same bits
    for name, g in got_grads.items():
        assert torch.equal(g, grads[name]), name
