"""What the objective changes in the estimate: DPO's step (--objective dpo, zero_recipes/preference/), traced as its
runner takes it.

A DPO micro-batch of N pairs is one row of their `prompt | chosen | rejected` stretches (preference/pairs.py),
each at most block_size tokens: at most N x block_size tokens, as an LM micro-batch of N rows. Its attention runs
per pair (two causal sdpa calls, the rejected answer's with a copy of its prompt's and its own q/k/v), and the
head only at the K positions that predict answer tokens: logits [K, V] in the model's dtype, their fp32 copy for
the log-softmax, never tiled. The trace runs train.py's own code for both (pairs.answer_logps with the
shared-prompt attention) on the worst layout a row can hold: every pair block_size tokens with a one-token prompt
and a one-token chosen answer, so that K and the rejected side's q/k/v copies are both at their largest
(block_size - 1 a pair). Shorter pairs, or longer prompts, leave less.

Nothing else changes: the policy's states are any run's, and no reference model is held. The reference
log-probs are computed once before the first step by the same engine, in eval mode without gradients (a forward
per micro-batch, its logits freed as each batch ends), so that pass peaks below a training step and the
estimated peak is the training step's.
"""

from __future__ import annotations

import contextlib

REFERENCE = "DPO: reference log-probs computed once (no reference model held)"
"""What the estimate's summary says of a DPO run's reference: nothing held beside the policy."""


def dpo_batch(pairs: int, tokens: int) -> dict:
    """A collated micro-batch (pairs.collate) of `pairs` worst-case pairs of `tokens` tokens each."""
    import numpy as np

    from zero_recipes.preference.pairs import Pair, collate

    if tokens < 3:
        raise ValueError(f"a pair needs 3 tokens at least (prompt, chosen, rejected); block_size is {tokens}")
    pair = lambda i: Pair(i, np.zeros(tokens, dtype=np.int64), 1, 1, tokens - 2)  # noqa: E731
    return collate([pair(i) for i in range(pairs)])


@contextlib.contextmanager
def shared_prompt_attention():
    """train.py's per-pair attention (modeling/packed_attention.install) in front of sdpa for the trace only: the
    estimating process's other traces keep transformers' own."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from zero_recipes.modeling import packed_attention

    own = ALL_ATTENTION_FUNCTIONS["sdpa"]
    packed_attention.install()
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = own


def dpo_step(model, batch: dict) -> None:
    """One micro-batch's forward and backward as PreferenceRunner.train_step runs it: the model's output (its
    logits) kept alive through the backward, as the runner keeps it. The loss is a function of the [N, 2] summed
    log-probs, whose size does not depend on the row."""
    from zero_recipes.preference.pairs import answer_logps

    with shared_prompt_attention():
        logps, out = answer_logps(model, batch)
        logps.sum().backward()
        del out


def summary(objective: str) -> str | None:
    """The line an estimate's summary adds for this objective (None for the LM objective)."""
    return REFERENCE if objective == "dpo" else None


def note(pairs: int, tokens: int) -> str:
    """The estimate's note on a DPO run: what was traced, and why the reference adds nothing."""
    return (
        f"{REFERENCE}: a forward per micro-batch without gradients before the first step, below this peak. The step "
        f"is traced on a row of {pairs} pair(s) of {tokens} tokens at their worst (one-token prompts): the answers' "
        f"logits whole, {pairs * (tokens - 1):,} tokens x the vocabulary in the model's dtype plus their fp32 copy, "
        "never tiled; shorter pairs leave less"
    )
