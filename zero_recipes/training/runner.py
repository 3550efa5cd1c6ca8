"""How one optimizer step runs: the runner `fit()` drives, chosen once in setup.

`EagerRunner` drives DeepSpeed's engine API (forward, backward, step per micro-batch) for every mode but the
pipeline; what differs between the modes is asked of the run's parallel axes (axis.Parallelism: a
micro-batch sharded, the tokens counted over the right group) and decided here once. The pipeline's runner
(parallel/pipeline/runner.py: DeepSpeed's `train_batch()` / `eval_batch()` over the whole step), or another
objective's, implements the same calls, and `fit()` (loop.py) does not change:

    micro_batch(batch)                       one micro-batch of the data order, on the device, this rank's part
    train_step(micro_batches, logging_step) -> (each micro-batch's loss, the grad norm or None)
    step_aux                                 the last step's balancing losses (a mixture of experts; else [])
    eval_rows(batch) -> (loss sum, label tokens, wrong tokens) per row
    count_group                              what per-rank sums are all-reduced over
    logits(input_ids)                        the engine's logits on rank 0, for the export check
"""

from __future__ import annotations

import torch

from zero_recipes.modeling import lm_loss


class EagerRunner:
    def __init__(self, engine, plan, rank: int, sft: bool):
        parallelism = plan.parallelism
        self.engine, self.rank, self.parallelism = engine, rank, parallelism
        self.count_group = parallelism.count_group()
        """The process group over which per-rank counts add up to the global batch's, each token once (None:
        the world): under TP one rank per TP group, since its ranks share rows."""
        self.count_label_tokens = sft or parallelism.counts_tokens
        # ZeRO-0 in fp32 runs without the DeepSpeed optimizer wrapper that records the grad norm: measure it
        self.measures_grad_norm = plan.zero_stage == 0 and plan.precision == "fp32"
        self.step_aux: list = []
        self.grad_divisor = plan.mesh.gradient_divisor(plan.zero_stage)
        """What DeepSpeed divides the sum of all ranks' gradients by (mesh.Mesh.gradient_divisor)."""

    def micro_batch(self, batch: dict) -> dict:
        batch = self.parallelism.shard(batch, self.rank)
        # a packed batch's cut points also come as host ints (packed_attention.varlen_kwargs): they stay here
        return {k: v.to(self.engine.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}

    def train_step(self, micro_batches: list[dict], logging_step: bool) -> tuple[list, object]:
        """One optimizer step over its micro-batches. Returns each micro-batch's loss (as the engine scaled
        it) and the grad norm when this runner measures it itself and the step logs, else None."""
        engine, accumulation = self.engine, len(micro_batches)
        # no KV cache in training: with one, transformers would ignore the restarting position ids of packed rows
        extra = {"use_cache": False}
        if self.count_label_tokens:
            # SFT rows hold different numbers of trained tokens: normalise each step by the tokens of all its
            # micro-batches on all ranks (HF's num_items_in_batch), not by a mean of per-micro-batch means.
            # Counted once per token: over one rank per tensor-parallel group (it shares its rows), over every
            # rank of a sequence-parallel group (each holds its slice, targets pre-shifted).
            n_items = sum(label_tokens(b) for b in micro_batches).float()
            torch.distributed.all_reduce(n_items, group=self.count_group)
            # DeepSpeed divides by the accumulation steps and by grad_divisor; undo both here
            extra["num_items_in_batch"] = n_items.clamp(min=1) / (accumulation * self.grad_divisor)
        grad_norm, losses, self.step_aux = None, [], []
        for micro, batch in enumerate(micro_batches):
            out = engine(**batch, **extra)
            loss = out.loss
            if out.get("aux_loss") is not None:
                self.step_aux.append(out["aux_loss"].detach())
            engine.backward(loss)
            if self.measures_grad_norm and logging_step and micro == accumulation - 1:
                grad_norm = torch.nn.utils.get_total_norm(
                    [p.grad for p in engine.module.parameters() if p.grad is not None]
                )
            engine.step()
            losses.append(loss)
        return losses, grad_norm

    def eval_rows(self, batch: dict):
        """Per row of an eval batch (on the device, labels included): loss sum, label tokens, wrong argmax tokens."""
        labels = batch.pop("labels")
        return lm_loss.eval_row_stats(self.engine, self.engine.module, batch, labels)

    def logits(self, input_ids):
        """The engine's logits for `input_ids` (every rank runs the forward: ZeRO-3 gathers are collective)."""
        return self.engine(input_ids=input_ids).logits


def label_tokens(batch: dict):
    """Trained tokens in a batch: targets that are not -100 (a sequence-parallel slice carries its targets
    pre-shifted in `shift_labels`)."""
    if "shift_labels" in batch:
        return (batch["shift_labels"] != -100).sum()
    return (batch["labels"][:, 1:] != -100).sum()
