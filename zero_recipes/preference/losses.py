"""The preference losses, per pair, with TRL 1.16's names and formulas. Written here by hand because TRL's are
lines inside its trainers' loss methods (DPOTrainer._compute_loss, CPOTrainer.cpo_loss, ORPOTrainer.odds_ratio_loss
and their get_batch_loss_metrics), not functions another engine can call; tests/unit/preference/ runs those
methods of TRL's on the same tiny model and batch and compares.

Each type gives a loss per pair (TRL averages it over the batch's pairs) and some add a token mean of the chosen
rows' NLL (DPOTrainer's `sft` type, CPOTrainer's `cpo_alpha` term, ORPOTrainer's NLL). `Terms` keeps the two apart
with the token count the second is divided by, so the runner averages the first over the global batch's pairs and
the second over the global batch's tokens; on one batch holding every pair that is TRL's loss exactly.

How TRL normalises, read from its code: the log-probs are summed over the answer's tokens (DPOTrainer) or averaged
per answer (CPO's simpo, ORPO: log-prob sum / answer tokens); IPO and sigmoid_norm divide each log ratio by its
answer's token count (TRL's comment: the IPO authors' normalised form); every NLL is a mean over the tokens of all
chosen rows together (one cross-entropy over the flattened batch), not a mean of per-row means. DPO's `sft` and
CPO's NLL cover the answer tokens only; ORPO's covers the prompt too ("over the full prompt and response": labels
are the input ids wherever the attention mask is 1, so every token after the row's first), which needs the
prompt's log-probs (`PairLogps.chosen_prompt`); without them ORPO's NLL is over the answers, as the other two.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zero_recipes.errors import ConfigError

DPO_TYPES = ("sigmoid", "ipo", "hinge", "robust", "exo_pair", "nca_pair", "bco_pair", "sppo_hard", "apo_zero",
             "apo_down", "sigmoid_norm", "sft")  # fmt: skip
"""DPOTrainer's loss types computed here; they combine, weighted, as TRL sums a list of them."""
REFERENCE_FREE = ("simpo", "orpo")
"""CPOTrainer's SimPO and ORPOTrainer's odds ratio: no reference, log-probs averaged per answer token, one alone.
(`sft` needs no reference either, but it is a DPOTrainer term: it rides with DPO types and TRL still logs
rewards against the reference.)"""
LOSS_TYPES = DPO_TYPES + REFERENCE_FREE
SORTS = "it sorts the log ratios across the batch, so a pair's loss would depend on how pairs fall into micro-batches"
NOT_TAKEN = {"aot": SORTS, "aot_unpaired": SORTS, "discopop": "it needs TRL's discopop_tau, not an option here"}
"""DPOTrainer's other types, refused with the reason."""
SMOOTHED = ("robust", "exo_pair", "simpo")
"""The types that read --label_smoothing; TRL 1.16's sigmoid, ipo, hinge and the rest ignore it."""


@dataclass
class PairLogps:
    """Per pair (1-D, length n), one entry per pair."""

    chosen: torch.Tensor
    """The policy's summed log-prob of the chosen answer's tokens."""
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    """The answers' token counts (TRL's completion_mask sums)."""
    rejected_tokens: torch.Tensor
    ref_chosen: torch.Tensor | None = None
    """The reference's summed log-probs; None for the reference-free types."""
    ref_rejected: torch.Tensor | None = None
    chosen_prompt: torch.Tensor | None = None
    """ORPO only, optional: the policy's summed log-prob of the chosen row's prompt tokens after the first (what
    TRL's ORPO adds to its NLL)."""
    chosen_prompt_tokens: torch.Tensor | None = None
    """Their count: the prompt's length - 1."""


@dataclass
class Terms:
    per_pair: torch.Tensor
    """[n]: each pair's weighted loss; the runner divides their sum by the global batch's pairs."""
    chosen_nll_sum: torch.Tensor
    """Scalar: the weighted summed NLL of the token-mean terms; divided by the global sum of `nll_tokens`."""
    chosen_rewards: torch.Tensor
    """[n], detached, as TRL logs rewards/chosen: beta x log ratio (DPO), beta x average log-prob (SimPO, ORPO)."""
    rejected_rewards: torch.Tensor
    nll_tokens: torch.Tensor
    """Scalar: the tokens `chosen_nll_sum` covers here (chosen answers', plus the prompts' for ORPO given them)."""


def check_options(loss_type, loss_weights, beta, label_smoothing, simpo_gamma, cpo_alpha) -> None:
    """Refuse, in one line, options TRL would refuse, warn about or silently ignore."""
    for name in loss_type:
        if name in NOT_TAKEN:
            raise ConfigError(f"--loss_type {name} (TRL's) is not taken here: {NOT_TAKEN[name]}")
        if name not in LOSS_TYPES:
            close = difflib.get_close_matches(name, LOSS_TYPES, n=2, cutoff=0.5)
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise ConfigError(f"--loss_type '{name}' is not one TRL knows here ({', '.join(LOSS_TYPES)}){hint}")
    if loss_weights is not None and len(loss_weights) != len(loss_type):
        raise ConfigError(
            f"--loss_weights has {len(loss_weights)} value(s) for {len(loss_type)} --loss_type(s); give one per type"
        )
    if not beta > 0:
        raise ConfigError(f"--beta must be > 0 (DPO's pull towards the reference; TRL's default 0.1), got {beta}")
    free = [t for t in loss_type if t in REFERENCE_FREE]
    if free and len(loss_type) > 1:  # a DPO type's log ratios are sums against a reference, these per-token averages
        raise ConfigError(
            f"--loss_type {' '.join(loss_type)}: {free[0]} averages the answers' log-probs and needs no reference, "
            "the others sum them against one (TRL has them in separate trainers); train one of them"
        )
    if not 0 <= label_smoothing < 0.5:  # TRL's rule for robust (1 - 2 eps divides); past 0.5 the labels flip
        raise ConfigError(f"--label_smoothing must be in [0, 0.5) (the share of flipped labels), got {label_smoothing}")
    if "exo_pair" in loss_type and label_smoothing == 0:
        raise ConfigError("--loss_type exo_pair needs --label_smoothing > 0 (log of it; the EXO paper uses 1e-3)")
    if label_smoothing > 0 and not any(t in SMOOTHED for t in loss_type):
        raise ConfigError(
            f"--label_smoothing {label_smoothing} does nothing with --loss_type {' '.join(loss_type)}: only "
            f"{', '.join(SMOOTHED)} read it (TRL 1.16's sigmoid ignores it)"
        )
    if cpo_alpha < 0:
        raise ConfigError(f"--cpo_alpha must be >= 0 (the weight of the chosen answers' NLL), got {cpo_alpha}")
    if cpo_alpha != 0 and "simpo" not in loss_type:
        raise ConfigError(f"--cpo_alpha {cpo_alpha} is read by --loss_type simpo only; for DPO's NLL add sft")


def pair_losses(lp: PairLogps, loss_type, loss_weights, beta, label_smoothing, simpo_gamma, cpo_alpha) -> Terms:
    """TRL's loss on these pairs, split as `Terms` says; `check_options` has passed the options."""
    weights = loss_weights or [1.0] * len(loss_type)
    tokens = lp.chosen_tokens.sum()
    if loss_type[0] in REFERENCE_FREE:
        return reference_free(lp, loss_type[0], weights[0], beta, label_smoothing, simpo_gamma, cpo_alpha, tokens)
    per_pair, nll = torch.zeros_like(lp.chosen), lp.chosen.new_zeros(())
    chosen_ratio, rejected_ratio = lp.chosen - lp.ref_chosen, lp.rejected - lp.ref_rejected
    for name, w in zip(loss_type, weights):
        if name == "sft":  # DPOTrainer: -mean of the chosen answers' per-token log-probs over the batch
            nll = nll + w * -lp.chosen.sum()
        else:
            per_pair = per_pair + w * dpo_type(name, lp, chosen_ratio, rejected_ratio, beta, label_smoothing)
    return Terms(per_pair, nll, (beta * chosen_ratio).detach(), (beta * rejected_ratio).detach(), tokens)


def reference_free(lp: PairLogps, name, weight, beta, label_smoothing, simpo_gamma, cpo_alpha, tokens) -> Terms:
    """SimPO (CPOTrainer's loss_type simpo, AlphaPO's alpha 0) and ORPO, on per-token average log-probs."""
    chosen_avg, rejected_avg = lp.chosen / lp.chosen_tokens, lp.rejected / lp.rejected_tokens
    if name == "simpo":  # trl/experimental/cpo/cpo_trainer.py cpo_loss; SimPO (arXiv 2405.14734) eq. 6
        logits = chosen_avg - rejected_avg - simpo_gamma / beta
        per_pair = -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
        nll = cpo_alpha * -lp.chosen.sum()  # CPO (arXiv 2401.08417) eq. 3's NLL: the answers' token mean
    else:  # trl/experimental/orpo/orpo_trainer.py odds_ratio_loss; ORPO (arXiv 2403.07691) eq. 6-7
        c, r = upcast(chosen_avg), upcast(rejected_avg)  # TRL computes the odds in fp32
        log_odds = (c - r) - (log1mexp(c) - log1mexp(r))
        per_pair = -beta * F.logsigmoid(log_odds)  # kept in fp32 as TRL's
        nll = -lp.chosen.sum()
        if lp.chosen_prompt is not None:  # TRL's ORPO NLL covers the prompt tokens too
            nll, tokens = nll - lp.chosen_prompt.sum(), tokens + lp.chosen_prompt_tokens.sum()
    rewards = (beta * chosen_avg).detach(), (beta * rejected_avg).detach()
    return Terms(per_pair * weight, nll * weight, *rewards, tokens)


def dpo_type(name, lp: PairLogps, chosen_ratio, rejected_ratio, beta, label_smoothing):
    """One of DPOTrainer._compute_loss's per-pair losses (trl/trainer/dpo_trainer.py), on reverse-KL scores (the
    log ratios themselves, TRL's default f_divergence_type)."""
    delta = chosen_ratio - rejected_ratio
    if name == "sigmoid":  # DPO (arXiv 2305.18290) eq. 7
        return -F.logsigmoid(beta * delta)
    if name == "hinge":  # SLiC (arXiv 2305.10425) eq. 3
        return torch.relu(1 - beta * delta)
    if name in ("ipo", "sigmoid_norm"):  # IPO (arXiv 2310.12036) eq. 17; each log ratio per answer token
        avg = chosen_ratio / lp.chosen_tokens.clamp(min=1) - rejected_ratio / lp.rejected_tokens.clamp(min=1)
        return (avg - 1 / (2 * beta)) ** 2 if name == "ipo" else -F.logsigmoid(beta * avg)
    if name == "robust":  # robust DPO (arXiv 2403.00409) eq. 6
        clean = -(1 - label_smoothing) * F.logsigmoid(beta * delta)
        flipped = -label_smoothing * F.logsigmoid(-beta * delta)
        return (clean - flipped) / (1 - 2 * label_smoothing)
    if name == "exo_pair":  # EXO (arXiv 2402.00856) eq. 16
        eps = torch.tensor(label_smoothing, dtype=delta.dtype, device=delta.device)
        qw, ql = torch.sigmoid(beta * delta), torch.sigmoid(-beta * delta)
        chosen_kl = qw * (F.logsigmoid(beta * delta) - torch.log1p(-eps))
        return chosen_kl + ql * (F.logsigmoid(-beta * delta) - torch.log(eps))
    if name == "nca_pair":  # NCA (arXiv 2402.05369)
        c, r = beta * chosen_ratio, beta * rejected_ratio
        return -F.logsigmoid(c) - 0.5 * F.logsigmoid(-c) - 0.5 * F.logsigmoid(-r)
    if name == "bco_pair":  # BCO (arXiv 2404.04656), paired
        return -F.logsigmoid(beta * chosen_ratio) - F.logsigmoid(-beta * rejected_ratio)
    if name == "sppo_hard":  # SPPO (arXiv 2405.00675) eq. 4.7, hard labels
        return (chosen_ratio - 0.5 / beta) ** 2 + (rejected_ratio + 0.5 / beta) ** 2
    if name == "apo_zero":  # APO (arXiv 2408.06266) eq. 7
        return 1 - torch.sigmoid(beta * chosen_ratio) + torch.sigmoid(beta * rejected_ratio)
    if name == "apo_down":  # APO eq. 8
        return torch.sigmoid(beta * chosen_ratio) + 1 - torch.sigmoid(beta * delta)
    raise ValueError(name)  # check_options refused it before any run


def upcast(x):
    """At least fp32 (TRL's `.float()`), float64 kept."""
    return x if x.dtype == torch.float64 else x.float()


def log1mexp(x):
    """log(1 - exp(x)) for x < 0, stable: TRL's ORPO helper of the same name, branch for branch."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))
