"""The per-pair losses (zero_recipes/preference/losses.py) against TRL's own code: CPOTrainer.cpo_loss for
SimPO and ORPOTrainer.odds_ratio_loss for ORPO, called on a stand-in that carries only the attributes those
methods read (their lines run as TRL wrote them). DPOTrainer's types are inside `_compute_loss`, which needs a
model: tests/integration/preference/test_dpo_matches_trl.py compares them through whole training steps."""

from types import SimpleNamespace

import pytest
import torch

from zero_recipes.errors import ConfigError
from zero_recipes.preference import losses


def pairs(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens_c = torch.randint(3, 40, (n,), generator=g).double()
    tokens_r = torch.randint(3, 40, (n,), generator=g).double()
    chosen = -torch.rand(n, generator=g, dtype=torch.float64) * 2 * tokens_c
    rejected = -torch.rand(n, generator=g, dtype=torch.float64) * 2 * tokens_r
    return losses.PairLogps(chosen, rejected, tokens_c, tokens_r)


def stand_in(**attrs):
    return SimpleNamespace(accelerator=SimpleNamespace(device="cpu"), **attrs)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_simpo_is_trls_cpo_simpo(smoothing):
    from trl.experimental.cpo import CPOTrainer

    lp = pairs()
    t = losses.pair_losses(lp, ["simpo"], None, beta=2.0, label_smoothing=smoothing, simpo_gamma=0.5, cpo_alpha=0.0)
    trl = stand_in(alpha=0.0, loss_type="simpo", simpo_gamma=0.5, beta=2.0, label_smoothing=smoothing)
    theirs, chosen_r, rejected_r = CPOTrainer.cpo_loss(
        trl, lp.chosen / lp.chosen_tokens, lp.rejected / lp.rejected_tokens
    )
    torch.testing.assert_close(t.per_pair, theirs, rtol=1e-12, atol=0)
    torch.testing.assert_close(t.chosen_rewards, chosen_r, rtol=1e-12, atol=0)
    torch.testing.assert_close(t.rejected_rewards, rejected_r, rtol=1e-12, atol=0)
    assert t.chosen_nll_sum == 0  # cpo_alpha 0: SimPO as its paper


def test_orpo_is_trls_odds_ratio_loss_and_its_nll():
    from trl.experimental.orpo import ORPOTrainer

    lp = pairs()
    t = losses.pair_losses(lp, ["orpo"], None, beta=0.1, label_smoothing=0.0, simpo_gamma=0.5, cpo_alpha=0.0)
    theirs, chosen_r, rejected_r, _, _ = ORPOTrainer.odds_ratio_loss(
        stand_in(beta=0.1), lp.chosen / lp.chosen_tokens, lp.rejected / lp.rejected_tokens
    )
    # TRL: loss = nll - mean(beta * log sigmoid(log odds)); ours per pair: -(that), averaged by the runner
    torch.testing.assert_close(t.per_pair.float(), -theirs, rtol=1e-6, atol=0)  # TRL takes it in fp32
    torch.testing.assert_close(t.chosen_rewards, chosen_r.double(), rtol=1e-6, atol=0)
    torch.testing.assert_close(t.rejected_rewards, rejected_r.double(), rtol=1e-6, atol=0)
    # its NLL: the chosen tokens' mean over the batch, as TRL's cross-entropy over the chosen labels
    assert t.chosen_nll_sum / lp.chosen_tokens.sum() == pytest.approx(
        (-lp.chosen.sum() / lp.chosen_tokens.sum()).item()
    )


def test_dpo_sigmoid_with_a_zero_margin_is_log_2_and_rewards_are_beta_ratios():
    lp = pairs()
    lp.ref_chosen, lp.ref_rejected = lp.chosen.clone(), lp.rejected.clone()  # the first step: policy = reference
    t = losses.pair_losses(lp, ["sigmoid"], None, beta=0.1, label_smoothing=0.0, simpo_gamma=0.5, cpo_alpha=0.0)
    assert torch.allclose(t.per_pair, torch.full_like(t.per_pair, 0.6931471805599453))
    assert t.chosen_rewards.abs().max() == 0 and t.rejected_rewards.abs().max() == 0


@pytest.mark.parametrize(
    "options, words",
    [
        ({"loss_type": ["sigmod"]}, "did you mean 'sigmoid'"),
        ({"loss_type": ["sigmoid", "ipo"], "loss_weights": [1.0]}, "give one per type"),
        ({"beta": 0.0}, "--beta must be > 0"),
        ({"label_smoothing": 0.5}, "--label_smoothing must be in [0, 0.5)"),
        ({"loss_type": ["simpo", "sigmoid"]}, "needs no reference"),
    ],
)
def test_bad_options_are_one_line(options, words):
    kw = {"loss_type": ["sigmoid"], "loss_weights": None, "beta": 0.1, "label_smoothing": 0.0, "simpo_gamma": 0.5,
          "cpo_alpha": 0.0} | options  # fmt: skip
    with pytest.raises(ConfigError, match=None) as e:
        losses.check_options(**kw)
    assert words in str(e.value) and "\n" not in str(e.value)
