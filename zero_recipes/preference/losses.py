"""The preference losses, per pair, with TRL 1.16's names and formulas. Written here because TRL's are lines
inside its trainers' loss methods (DPOTrainer._compute_loss, CPOTrainer.cpo_loss, ORPOTrainer.odds_ratio_loss),
not functions another engine can call; tests/unit/preference/ compares each with TRL's own code.

Each type gives a loss per pair (TRL averages it over the batch) and some add a token-mean term over the chosen
answers' tokens (TRL's `sft` type, ORPO's NLL, CPO's `cpo_alpha` NLL). `Terms` keeps the two apart, so the runner
averages the first over the global batch's pairs and the second over its chosen tokens.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zero_recipes.errors import ConfigError

DPO_TYPES = ("sigmoid", "ipo", "hinge", "robust", "exo_pair", "nca_pair", "bco_pair", "sppo_hard", "apo_zero",
             "apo_down", "sigmoid_norm", "sft")  # fmt: skip
"""DPOTrainer's loss types this module computes (TRL also has aot, aot_unpaired and discopop: batch-sorted or
tuned, not taken here)."""
REFERENCE_FREE = ("simpo", "orpo")
"""CPOTrainer's SimPO and ORPOTrainer's odds ratio: no reference model; log-probs averaged over answer tokens."""
LOSS_TYPES = DPO_TYPES + REFERENCE_FREE


@dataclass
class PairLogps:
    """Per pair (1-D, length n): summed answer log-probs of the policy and the reference, and answer token counts."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    ref_chosen: torch.Tensor | None = None
    ref_rejected: torch.Tensor | None = None


@dataclass
class Terms:
    per_pair: torch.Tensor  # [n]: the weighted loss of each pair (the runner divides their sum by the pairs)
    chosen_nll_sum: torch.Tensor  # scalar: weighted summed NLL of the chosen tokens (divided by their count)
    chosen_rewards: torch.Tensor  # [n], detached, as TRL logs rewards/chosen
    rejected_rewards: torch.Tensor


def check_options(loss_type, loss_weights, beta, label_smoothing, simpo_gamma, cpo_alpha) -> None:
    for name in loss_type:
        if name not in LOSS_TYPES:
            close = difflib.get_close_matches(name, LOSS_TYPES, n=2, cutoff=0.5)
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise ConfigError(f"--loss_type '{name}' is not one TRL knows here ({', '.join(LOSS_TYPES)}){hint}")
    if loss_weights is not None and len(loss_weights) != len(loss_type):
        raise ConfigError(
            f"--loss_weights has {len(loss_weights)} value(s) for {len(loss_type)} --loss_type(s); give one per type"
        )
    if beta <= 0:
        raise ConfigError(f"--beta must be > 0 (DPO's pull towards the reference; TRL's default 0.1), got {beta}")
    if not 0 <= label_smoothing < 0.5:
        raise ConfigError(f"--label_smoothing must be in [0, 0.5) (the share of flipped labels), got {label_smoothing}")
    free = [t for t in loss_type if t in REFERENCE_FREE]
    if free and len(loss_type) > 1:
        raise ConfigError(
            f"--loss_type {' '.join(loss_type)}: {free[0]} averages the answers' log-probs and needs no reference, "
            "the others sum them against one; train one of them"
        )


def pair_losses(lp: PairLogps, loss_type, loss_weights, beta, label_smoothing, simpo_gamma, cpo_alpha) -> Terms:
    weights = loss_weights or [1.0] * len(loss_type)
    per_pair = torch.zeros_like(lp.chosen)
    nll = lp.chosen.new_zeros(())
    if loss_type[0] in REFERENCE_FREE:
        chosen_avg, rejected_avg = lp.chosen / lp.chosen_tokens, lp.rejected / lp.rejected_tokens
        if loss_type[0] == "simpo":  # CPOTrainer.cpo_loss (alpha 0), SimPO (arXiv 2405.14734) eq. 6
            logits = chosen_avg - rejected_avg - simpo_gamma / beta
            per_pair = (
                -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
            )
            nll = cpo_alpha * -lp.chosen.sum()
        else:  # ORPOTrainer.odds_ratio_loss, ORPO (arXiv 2403.07691) eq. 6-7: NLL - beta * log sigmoid(log odds)
            c, r = chosen_avg.float(), rejected_avg.float()
            log_odds = (c - r) - (log1mexp(c) - log1mexp(r))
            per_pair = -beta * F.logsigmoid(log_odds)
            nll = -lp.chosen.sum()
        per_pair = per_pair * weights[0]
        return Terms(per_pair, nll * weights[0], (beta * chosen_avg).detach(), (beta * rejected_avg).detach())
    chosen_ratio, rejected_ratio = lp.chosen - lp.ref_chosen, lp.rejected - lp.ref_rejected
    delta = chosen_ratio - rejected_ratio
    for name, w in zip(loss_type, weights):
        if name == "sft":  # DPOTrainer: the chosen tokens' mean NLL over the batch
            nll = nll + w * -lp.chosen.sum()
        else:
            per_pair = per_pair + w * dpo_type(name, lp, chosen_ratio, rejected_ratio, delta, beta, label_smoothing)
    return Terms(per_pair, nll, (beta * chosen_ratio).detach(), (beta * rejected_ratio).detach())


def dpo_type(name, lp: PairLogps, chosen_ratio, rejected_ratio, delta, beta, label_smoothing):
    """One of DPOTrainer._compute_loss's per-sequence losses (reverse-KL scores: the log ratios themselves)."""
    if name == "sigmoid":  # DPO (arXiv 2305.18290) eq. 7
        return -F.logsigmoid(beta * delta)
    if name == "hinge":  # SLiC (arXiv 2305.10425)
        return torch.relu(1 - beta * delta)
    if name == "ipo":  # IPO (arXiv 2310.12036) eq. 17, on token-averaged ratios as TRL computes it
        avg = chosen_ratio / lp.chosen_tokens.clamp(min=1) - rejected_ratio / lp.rejected_tokens.clamp(min=1)
        return (avg - 1 / (2 * beta)) ** 2
    if name == "sigmoid_norm":
        avg = chosen_ratio / lp.chosen_tokens.clamp(min=1) - rejected_ratio / lp.rejected_tokens.clamp(min=1)
        return -F.logsigmoid(beta * avg)
    if name == "robust":  # cDPO/rDPO (arXiv 2403.00409)
        clean = -(1 - label_smoothing) * F.logsigmoid(beta * delta)
        flipped = -label_smoothing * F.logsigmoid(-beta * delta)
        return (clean - flipped) / (1 - 2 * label_smoothing)
    if name == "exo_pair":  # EXO (arXiv 2402.00856) eq. 16
        eps = torch.tensor(label_smoothing, dtype=delta.dtype, device=delta.device)
        qw, ql = torch.sigmoid(beta * delta), torch.sigmoid(-beta * delta)
        return qw * (F.logsigmoid(beta * delta) - torch.log1p(-eps)) + ql * (
            F.logsigmoid(-beta * delta) - torch.log(eps)
        )
    if name == "nca_pair":  # NCA (arXiv 2402.05369)
        c, r = beta * chosen_ratio, beta * rejected_ratio
        return -F.logsigmoid(c) - 0.5 * F.logsigmoid(-c) - 0.5 * F.logsigmoid(-r)
    if name == "bco_pair":
        return -F.logsigmoid(beta * chosen_ratio) - F.logsigmoid(-beta * rejected_ratio)
    if name == "sppo_hard":  # SPPO (arXiv 2405.00675), hard labels
        return (chosen_ratio - 0.5 / beta) ** 2 + (rejected_ratio + 0.5 / beta) ** 2
    if name == "apo_zero":  # APO (arXiv 2408.06266) eq. 7
        return 1 - torch.sigmoid(beta * chosen_ratio) + torch.sigmoid(beta * rejected_ratio)
    if name == "apo_down":  # APO eq. 8
        return torch.sigmoid(beta * chosen_ratio) + 1 - torch.sigmoid(beta * delta)
    raise ValueError(name)  # check_options refused it before any run


def log1mexp(x):
    """log(1 - exp(x)) for x < 0, stable (TRL's helper of the same name)."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))
