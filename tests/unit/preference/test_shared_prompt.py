"""Pairs laid out with their prompt once (zero_recipes/preference/pairs.py + the shared-prompt attention) give the
log-probs and gradients of TRL's padded layout (prompt+chosen and prompt+rejected as separate rows), and no answer
sees another pair's tokens or the other answer."""

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from zero_recipes.modeling import packed_attention
from zero_recipes.modeling.model import TINY_LLAMA
from zero_recipes.preference import pairs

SHAPES = [(7, 5, 3), (1, 1, 9), (12, 4, 4)]  # prompt, chosen, rejected


@pytest.fixture
def model():
    fields = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    config = AutoConfig.for_model("llama", **fields)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(config)
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    packed_attention.install()
    yield m.double()
    ALL_ATTENTION_FUNCTIONS["sdpa"] = original


def make_pairs(seed=1, shapes=SHAPES):
    rng = np.random.default_rng(seed)
    return [pairs.Pair(i, rng.integers(5, 4000, sum(s)), *s) for i, s in enumerate(shapes)]


def padded_logps(m, batch_pairs):
    """TRL's computation: each side its own row, log-softmax over the shifted completion tokens, summed."""
    b = pairs.padded(batch_pairs, pad_id=0)
    logits = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1]
    targets = b["input_ids"][:, 1:]
    tok = logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0] * b["completion_mask"][:, 1:]
    sums = tok.sum(1)
    n = len(batch_pairs)
    return torch.stack([sums[:n], sums[n:]], dim=1)


def grads(m, logps):
    m.zero_grad()
    (logps * torch.tensor([1.0, -0.5], dtype=logps.dtype)).sum().backward()
    return torch.cat([p.grad.flatten() for p in m.parameters()])


def test_the_shared_layout_gives_trls_log_probs_and_gradients(model):
    ps = make_pairs()
    shared, _ = pairs.answer_logps(model, pairs.collate(ps))
    g_shared = grads(model, shared)
    reference = padded_logps(model, ps)
    g_padded = grads(model, reference)
    torch.testing.assert_close(shared.double(), reference.double(), rtol=1e-10, atol=1e-10)
    # float64 weights, but Llama's RMSNorm computes in fp32: the prompt's gradient, one sum of both answers' shares
    # here and two separate backwards there, rounds differently at fp32's 6e-8 (a wrong mask would be O(1))
    assert ((g_shared - g_padded).norm() / g_padded.norm()).item() < 1e-7


def test_no_answer_sees_another_pair_or_the_other_answer(model):
    ps = make_pairs()
    base, _ = pairs.answer_logps(model, pairs.collate(ps))
    changed = list(ps)
    p = ps[1]
    tokens = p.tokens.copy()
    tokens[p.prompt + p.chosen :] = (tokens[p.prompt + p.chosen :] + 7) % 4000  # pair 1's rejected answer only
    changed[1] = pairs.Pair(p.index, tokens, p.prompt, p.chosen, p.rejected)
    after, _ = pairs.answer_logps(model, pairs.collate(changed))
    with torch.no_grad():
        assert torch.equal(after[0], base[0]) and torch.equal(after[2], base[2])  # the other pairs
        assert after[1, 0] == base[1, 0]  # its chosen answer
        assert after[1, 1] != base[1, 1]  # the answer that changed


def test_position_ids_restart_each_answer_after_the_prompt():
    b = pairs.collate(make_pairs(shapes=[(3, 2, 2)]))
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4, 3, 4]]
    assert b["logits_index"].tolist() == [2, 3, 2, 5]  # the first token of each answer from the prompt's last
    assert b["answer_of_target"].tolist() == [0, 0, 1, 1]
