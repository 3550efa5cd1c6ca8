"""How one optimizer step runs under pipeline parallelism: DeepSpeed's `train_batch`, which pulls the step's
micro-batches itself and runs the 1F1B schedule (forward, backward, the gradient all-reduce and the optimizer
step inside; the engine's forward/backward/step raise). The same four calls as runner.EagerRunner, so
`fit()` does not change.

Two things DeepSpeed does differently from every other runner here, and what this one does about them:

* **The loss.** `train_batch` averages the per-micro-batch losses (a mean of means). SFT micro-batches hold
  different numbers of label tokens, so the step is normalised here by all of them, over every replica, as
  HF's `num_items_in_batch` does (pipeline_model.StepLoss).
* **Gradient clipping at ZeRO-0** (DeepSpeed 0.19.8, a bug: docs/dev/deepspeed-bugs.md#clipping). The engine's
  `clip_fp32_gradients` calls `runtime.utils.clip_grad_norm_(mpu=grid)`, which counts only the gradients of
  ranks whose model-parallel rank is 0, and for the pipeline grid that rank is the stage index: the norm is
  the first stage's alone, and every stage's gradients are scaled by it. Here the engine's method is replaced
  (on this engine only) by one that takes the norm over every stage, the tied head's copy counted once, and
  records it as the step's grad norm. ZeRO-1 and bf16 clip through DeepSpeed's optimizers, which count every
  stage (measured: equal to one rank's norm); they are left alone.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from zero_recipes.training.runner import label_tokens


class PipelineRunner:
    step_aux: list = []  # the pipeline splits dense families only: no balancing loss

    def __init__(self, engine, plan, rank: int, sft: bool):
        self.engine, self.rank = engine, rank
        self.loss = engine.module.loss_fn
        grid = engine.grid
        self.count_group = grid.get_data_parallel_group()
        """One stage's replicas: each holds a different pipeline's rows, so their sum counts every row once."""
        self.pipe_group = grid.get_pipe_parallel_group()
        self.last_stage = grid.stage_to_global(stage_id=engine.num_stages - 1, data=grid.get_data_parallel_rank())
        self.dp = plan.mesh.dp
        if plan.zero_stage == 0 and plan.precision == "fp32":
            engine.clip_fp32_gradients = types.MethodType(clip_over_every_stage, engine)

    def micro_batch(self, batch: dict):
        """((token ids, position ids), targets) on the device: what the first stage and the loss read. The
        targets are shifted here (the target of token t is token t+1), as transformers shifts labels."""
        device = self.engine.device
        ids = batch["input_ids"]
        positions = batch.get("position_ids")
        if positions is None:
            positions = torch.arange(ids.shape[1]).expand_as(ids).contiguous()
        targets = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
        return (ids.to(device), positions.to(device)), targets.to(device)

    def train_step(self, micro_batches: list, logging_step: bool) -> tuple[list, object]:
        """One optimizer step. Returns the step's loss once per micro-batch (train_batch gives the mean, the
        same on every rank) and None: the grad norm is the engine's (get_global_grad_norm)."""
        n_items = sum(label_tokens({"shift_labels": t}) for _, t in micro_batches).float()
        torch.distributed.all_reduce(n_items, group=self.count_group)
        # DeepSpeed divides each micro-batch's loss by the accumulation steps, then averages the replicas
        self.loss.normaliser = n_items.clamp(min=1) / (len(micro_batches) * self.dp)
        loss = self.engine.train_batch(iter(micro_batches))
        return [loss] * len(micro_batches), None

    def eval_rows(self, batch: dict):
        """Per row of an eval batch: (loss sum, label tokens, wrong argmax tokens), computed by the last stage
        and sent to the pipeline's other stages, so every rank holds what loop.evaluate sums."""
        inputs, targets = self.micro_batch(batch)
        self.loss.rows = True
        self.engine.total_loss = None  # eval_batch adds to the last train_batch's sum (train_batch resets it)
        try:
            out = self.engine.eval_batch(
                iter([(inputs, targets)]), num_micro_batches=1, reduce_output=None, bcast_loss=False
            )
        finally:
            self.loss.rows = False
        stats = out[0] if self.engine.is_last_stage() else torch.zeros(targets.shape[0], 3, dtype=torch.float64)
        stats = stats.to(self.engine.device)
        torch.distributed.broadcast(stats, src=self.last_stage, group=self.pipe_group)
        return stats.unbind(1)

    def logits(self, input_ids):
        """The engine's logits for `input_ids` on rank 0 (None elsewhere): the last stage computes them and
        sends them to its pipeline's first stage. Collective over every rank."""
        engine = self.engine
        vocab = engine.module.config.get_text_config().vocab_size
        targets = torch.full_like(input_ids, -100)
        engine.total_loss = None
        _, logits = engine.eval_batch(
            iter([self.micro_batch({"input_ids": input_ids, "labels": targets})]),
            return_logits=True,
            compute_loss=False,
            bcast_loss=False,
            num_micro_batches=1,
        )
        if not engine.is_last_stage():
            logits = torch.zeros(*input_ids.shape, vocab, dtype=torch.float32, device=engine.device)
        logits = logits.float().contiguous()
        torch.distributed.broadcast(logits, src=self.last_stage, group=self.pipe_group)
        return logits if self.rank == 0 else None


def clip_over_every_stage(engine):
    """The engine's clip_fp32_gradients, with the norm over every stage's gradients (see the module
    docstring): each stage's sum of squares, all-reduced over its pipeline, a tied weight's second copy left
    out. Replicas hold the same (all-reduced) gradients, so one pipeline's sum is the global norm."""
    module = engine.module
    duplicates = {
        id(p)
        for key, comm in module.tied_comms.items()
        if engine.global_rank != min(comm["ranks"])
        for p in module.tied_modules[key].parameters()
    }
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    counted = [p.grad for p in module.parameters() if p.grad is not None and id(p) not in duplicates]
    squares = torch.zeros((), dtype=torch.float32, device=engine.device)
    for g in counted:
        squares += g.detach().float().pow(2).sum()
    torch.distributed.all_reduce(squares, group=engine.grid.get_pipe_parallel_group())
    norm = squares.sqrt()
    coef = engine.gradient_clipping() / (norm + 1e-6)  # DeepSpeed's own clip_grad_norm_ formula
    if coef < 1:
        for g in grads:
            g.detach().mul_(coef)
    engine._global_grad_norm = norm.item()
    return norm
