"""How one DPO step runs: the policy's log-probs of both answers of every pair (one forward per micro-batch over
the shared-prompt rows, pairs.py), the loss against the reference's log-probs held in memory (reference.py), and
TRL's metrics. The runner `fit()` drives (training/runner.py's calls), so the loop does not change.

The loss is averaged over the pairs of the whole global batch (and TRL's token-mean terms over its chosen
tokens), whatever the micro-batching: each micro-batch's sum is divided by the step's pair count over all ranks,
and DeepSpeed's own division by the accumulation steps and the data-parallel size is undone (as SFT's
num_items_in_batch is). TRL averages per micro-batch, which differs under accumulation when micro-batches hold
different numbers of tokens-mean terms; on a batch that holds everything the two agree (tested).
"""

from __future__ import annotations

import torch

from zero_recipes import data
from zero_recipes.preference import losses
from zero_recipes.preference.pairs import answer_logps
from zero_recipes.training.runner import EagerRunner

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")  # fmt: skip
"""TRL's names, each a mean over pairs."""


class PreferenceRunner(EagerRunner):
    def __init__(self, engine, plan, rank: int, prepared):
        super().__init__(engine, plan, rank, sft=True)
        self.cfg, self.prepared = plan.cfg, prepared
        self.reference: dict = {}
        """'train' and 'eval': the reference's summed log-probs per pair, [n, 2] float64 on the host (reference.py)."""
        self.step_means: dict = {}
        """The last step's TRL metrics: name -> (sum over its pairs, pairs), on the device."""
        self.step_tokens = 0
        """The tokens the last step computed on this rank (pairs vary; the log's tokens/s and MFU count these)."""

    def answer_logps(self, batch: dict):
        """[pairs, 2] summed log-probs of the batch's answers under the engine, and its output (pairs.answer_logps)."""
        return answer_logps(self.engine, batch)

    def terms(self, logps, batch: dict, split: str) -> losses.Terms:
        ref = self.reference[split][batch["pair_index"].cpu()].to(logps.device, logps.dtype)
        tokens = batch["answer_tokens"].to(logps.dtype)
        pair = losses.PairLogps(logps[:, 0], logps[:, 1], tokens[:, 0], tokens[:, 1], ref[:, 0], ref[:, 1])
        cfg = self.cfg
        return losses.pair_losses(
            pair, cfg.loss_type, cfg.loss_weights, cfg.beta, cfg.label_smoothing, cfg.simpo_gamma, cfg.cpo_alpha
        )

    def logged_logps(self, logps, batch: dict):
        """logps/* as TRL logs them: summed (DPOTrainer), or per token for the reference-free types (its CPO and
        ORPO trainers average them)."""
        if self.cfg.loss_type[0] in losses.REFERENCE_FREE:
            return logps / batch["answer_tokens"].to(logps.dtype)
        return logps

    def global_counts(self, batches: list[dict]):
        """The step's pairs and chosen tokens over every rank (each replica's once)."""
        counts = torch.stack(
            [sum(b["pair_index"].numel() for b in batches) * torch.ones((), dtype=torch.float64),
             sum(b["answer_tokens"][:, 0].sum() for b in batches).double()]
        ).to(self.engine.device)  # fmt: skip
        torch.distributed.all_reduce(counts, group=self.count_group)
        return counts.clamp(min=1)

    def train_step(self, micro_batches: list[dict], logging_step: bool) -> tuple[list, object]:
        engine, accumulation = self.engine, len(micro_batches)
        pairs, chosen_tokens = self.global_counts(micro_batches)
        scale = accumulation * self.grad_divisor  # DeepSpeed divides each micro-batch's gradient by this
        grad_norm, step_losses, self.step_aux = None, [], []
        sums = torch.zeros(len(METRICS) + 1, dtype=torch.float64, device=engine.device)
        for micro, batch in enumerate(micro_batches):
            logps, out = self.answer_logps(batch)
            t = self.terms(logps, batch, "train")
            loss = (t.per_pair.sum() / pairs + t.chosen_nll_sum / chosen_tokens) * scale
            if out.get("aux_loss") is not None:  # a mixture of experts' balancing loss, added per micro-batch as
                self.step_aux.append(out["aux_loss"].detach())  # TRL does: DeepSpeed's division makes it a mean
                loss = loss + balancing_coef(engine.module) * out["aux_loss"]
            engine.backward(loss.to(logps.dtype))
            if self.measures_grad_norm and logging_step and micro == accumulation - 1:
                grad_norm = torch.nn.utils.get_total_norm(
                    [p.grad for p in engine.module.parameters() if p.grad is not None]
                )
            engine.step()
            step_losses.append(loss.detach().float())
            sums += metric_sums(t, self.logged_logps(logps.detach(), batch))
        self.step_means = {name: (sums[i], sums[-1]) for i, name in enumerate(METRICS)}
        self.step_tokens = sum(b["input_ids"].numel() for b in micro_batches)  # computed, each prompt once
        return step_losses, grad_norm

    def evaluate(self, prepared, cfg, shard: int, shards: int) -> dict:
        """The held-out pairs: the loss (each pair's, as in training, plus the token-mean terms), TRL's reward
        metrics. Every shard runs the same number of batches (ZeRO-3's gathers are collective); padding pairs
        repeat real ones with weight 0."""
        rows = prepared.eval
        if rows is None:
            return {}
        self.engine.eval()
        device = self.engine.device
        total = torch.zeros(len(METRICS) + 3, dtype=torch.float64, device=device)  # metrics, pairs, loss sum, nll sum
        tokens = torch.zeros((), dtype=torch.float64, device=device)
        micro = cfg.per_device_eval_batch_size
        with torch.no_grad():
            for batch, weight in data.eval_batches(rows, micro, shard, shards, cfg.max_eval_batches, prepared.pad_id):
                batch = self.micro_batch(batch)
                logps, _ = self.answer_logps(batch)
                t = self.terms(logps, batch, "eval")
                w = weight.to(device, torch.float64)
                total[: len(METRICS) + 1] += metric_sums(t, self.logged_logps(logps, batch), w)
                total[-2] += (t.per_pair.double() * w).sum()
                if bool(weight.all()):  # the token-mean terms are per batch: whole batches only
                    total[-1] += t.chosen_nll_sum.double()
                    tokens += batch["answer_tokens"][:, 0].sum()
        stats = torch.cat([total, tokens[None]])
        torch.distributed.all_reduce(stats, group=self.count_group)
        pairs = stats[len(METRICS)].clamp(min=1)
        loss = stats[-3] / pairs + stats[-2] / stats[-1].clamp(min=1)
        out = {"eval_loss": loss.item()}
        out.update({f"eval_{name}": (stats[i] / pairs).item() for i, name in enumerate(METRICS)})
        return out


def metric_sums(t: losses.Terms, logps, weight=None):
    """Sums over pairs of TRL's metrics, then the pair count."""
    c, r = t.chosen_rewards.double(), t.rejected_rewards.double()
    w = torch.ones_like(c) if weight is None else weight
    cols = [c, r, (c > r).double(), c - r, logps[:, 0].double(), logps[:, 1].double(), torch.ones_like(c)]
    return torch.stack([(x * w).sum() for x in cols])


def balancing_coef(module) -> float:
    config = module.config
    return float(getattr(config.get_text_config(), "router_aux_loss_coef", 0.0) or 0.0)
