"""The per-pair losses (zero_recipes/preference/losses.py) equal TRL's own code on the same tiny model and pairs.

TRL's losses live inside trainer methods, so each is run as TRL wrote it on a trainer object made without its
__init__ (`Trainer.__new__`), given only the attributes those methods read: DPOTrainer._compute_loss on a batch
from TRL's DataCollatorForPreference with precomputed reference log-probs, through the fused LM head TRL's
__init__ adds (add_fused_lm_head, the same outputs); CPOTrainer and ORPOTrainer's get_batch_loss_metrics (their
forward, NLL, log-probs, loss and metrics). Building the trainers whole would tokenise a dataset, write a cache
and start accelerate; the lines compared are the same. Our side recomputes the answers' log-probs from the
model's logits and sums and normalises `Terms` as the runner does: pairs over the pairs, NLL over `nll_tokens`.
"""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from zero_recipes.errors import ConfigError
from zero_recipes.preference import losses

GAP = 1e-6  # relative; measured worst 4.4e-7 (exo_pair's loss: TRL's fused head sums fp32 log-probs, ours the logits')
BATCHES = (1, 4, 9)
DTYPES = (torch.float64, torch.float32)
VOCAB = 97


@pytest.fixture(scope="module")
def models():
    """A tiny random Llama per dtype, with TRL's fused LM head added as DPOTrainer.__init__ adds it."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")  # fmt: skip
    threads, out = torch.get_num_threads(), {}
    torch.set_num_threads(1)  # matrices of 32: threads only cost time
    for dtype in DTYPES:
        torch.manual_seed(0)
        out[dtype] = LlamaForCausalLM(config).to(dtype)
        add_fused_lm_head(out[dtype], outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    yield out
    torch.set_num_threads(threads)


def examples(n, seed):
    g = torch.Generator().manual_seed(seed)
    ids = lambda lo, hi: torch.randint(1, VOCAB, (int(torch.randint(lo, hi, (), generator=g)),), generator=g).tolist()  # noqa: E731
    return [{"prompt_ids": ids(2, 9), "chosen_ids": ids(1, 8), "rejected_ids": ids(1, 8)} for _ in range(n)]


def row_logps(model, rows, split):
    """Per row: summed log-probs of the tokens in [split, len) and of those in [1, split), from the logits."""
    ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(r) for r in rows], batch_first=True)
    mask = (torch.arange(ids.shape[1]) < torch.tensor([len(r) for r in rows])[:, None]).long()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    per_token = F.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0] * mask[:, 1:]
    answer = torch.arange(1, ids.shape[1])[None] >= torch.tensor(split)[:, None]
    return (per_token * answer).sum(1), (per_token * ~answer).sum(1)


def our_pairs(model, ex, ref=None) -> losses.PairLogps:
    split = [len(e["prompt_ids"]) for e in ex]
    chosen, prompt = row_logps(model, [e["prompt_ids"] + e["chosen_ids"] for e in ex], split)
    rejected, _ = row_logps(model, [e["prompt_ids"] + e["rejected_ids"] for e in ex], split)
    count = lambda key: torch.tensor([len(e[key]) for e in ex], dtype=chosen.dtype)  # noqa: E731
    lp = losses.PairLogps(chosen, rejected, count("chosen_ids"), count("rejected_ids"))
    if ref is not None:
        lp.ref_chosen, lp.ref_rejected = (r.to(chosen.dtype) for r in ref)
    lp.chosen_prompt, lp.chosen_prompt_tokens = prompt, count("prompt_ids") - 1
    return lp


def loss_of(t: losses.Terms) -> float:
    """As the runner: the pairs' sum over the pairs, the NLL sum over its tokens."""
    return (t.per_pair.sum() / t.per_pair.numel() + t.chosen_nll_sum / t.nll_tokens).item()


def gap(ours, theirs) -> float:
    return abs(ours - theirs) / max(abs(theirs), 1e-12)


def stand_in(cls, **attrs):
    """TRL's trainer class without its __init__: its methods run as written, on these attributes."""
    trainer = cls.__new__(cls)
    accelerator = SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x)
    for k, v in dict(accelerator=accelerator, aux_loss_enabled=False, **attrs).items():
        setattr(trainer, k, v)
    return trainer


DPO_CASES = [([t], None) for t in losses.DPO_TYPES] + [
    (["sigmoid", "sft"], [1.0, 0.5]),
    (["ipo", "hinge", "robust", "sigmoid_norm"], [1.0, 0.5, 0.25, 2.0]),
]


def fused_pairs(model, batch, lp) -> losses.PairLogps:
    """`lp` with the policy's log-probs as TRL's fused LM head gives them: fp32 whatever the model's dtype (its
    accumulators are), so TRL's DPO loss of a float64 model is computed in fp32."""
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels,
                    fused_lm_head=True)  # fmt: skip
    chosen, rejected = out.log_probs.sum(1).chunk(2)
    f = lambda x: x.to(chosen.dtype)  # noqa: E731
    return losses.PairLogps(chosen, rejected, f(lp.chosen_tokens), f(lp.rejected_tokens), f(lp.ref_chosen),
                            f(lp.ref_rejected))  # fmt: skip


def dpo_gaps(model, loss_type, weights, n, beta=0.1, smoothing=0.2) -> dict:
    """Relative gaps to DPOTrainer._compute_loss's loss and metrics, ours from the logits ("logits") and from TRL's
    fused head ("fused"); rewards relative to beta x the log-probs they are a difference of."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer

    ex = examples(n, seed=n)
    lp = our_pairs(model, ex)
    noise = torch.randn(2, n, generator=torch.Generator().manual_seed(n + 100))
    ref = ((lp.chosen + 3 * noise[0]).float(), (lp.rejected + 3 * noise[1]).float())  # fp32, as the collator makes
    for e, rc, rr in zip(ex, *ref):
        e["ref_chosen_logps"], e["ref_rejected_logps"] = rc.item(), rr.item()
    batch = DataCollatorForPreference(pad_token_id=0)(ex)
    trl = stand_in(DPOTrainer, model=model, ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
                   loss_types=loss_type, loss_weights=weights or [1.0] * len(loss_type), beta=beta,
                   label_smoothing=smoothing, use_weighting=False,
                   _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0,
                   _tp_size=1)  # fmt: skip
    with torch.no_grad():
        theirs = trl._compute_loss(model, batch, False).item()
    metrics = {k: v[0] for k, v in trl._metrics["train"].items()}
    lp = our_pairs(model, ex, ref)
    gaps = {}
    for source, pair in (("logits", lp), ("fused", fused_pairs(model, batch, lp))):
        t = losses.pair_losses(pair, loss_type, weights, beta, smoothing, simpo_gamma=0.5, cpo_alpha=0.0)
        for k, v in metric_gaps(t, pair.chosen, pair.rejected, beta, theirs, metrics).items():
            gaps[source, k] = v
    return gaps


@pytest.mark.parametrize("loss_type, weights", DPO_CASES, ids=["+".join(c[0]) for c in DPO_CASES])
def test_dpo_types_equal_dpotrainer_compute_loss(models, loss_type, weights):
    """exo_pair and robust read the label smoothing (0.2); the others ignore it, as TRL's do."""
    for dtype in DTYPES:
        for n in BATCHES:
            gaps = dpo_gaps(models[dtype], loss_type, weights, n)
            assert max(gaps.values()) <= GAP, (dtype, n, gaps)


def run_cpo_or_orpo(cls, model, ex, **attrs):
    """get_batch_loss_metrics on the batch CPO's and ORPO's tokenize_row and collator give: prompt + answer rows,
    labels -100 on the prompt and the padding."""
    batch = {}
    for side in ("chosen", "rejected"):
        rows = [e["prompt_ids"] + e[f"{side}_ids"] for e in ex]
        labels = [[-100] * len(e["prompt_ids"]) + e[f"{side}_ids"] for e in ex]
        pad = lambda rs, v: torch.nn.utils.rnn.pad_sequence([torch.tensor(r) for r in rs], True, v)  # noqa: E731
        batch[f"{side}_input_ids"] = pad(rows, 0)
        batch[f"{side}_attention_mask"] = pad([[1] * len(r) for r in rows], 0)
        batch[f"{side}_labels"] = pad(labels, -100)
    trl = stand_in(cls, is_encoder_decoder=False, pad_token_id=0, padding_value=0, **attrs)
    with torch.no_grad():
        return trl.get_batch_loss_metrics(model, batch)


def metric_gaps(t: losses.Terms, chosen, rejected, beta, theirs: float, metrics: dict) -> dict:
    """Relative gaps of the loss (normalised as the runner does) and of TRL's logged means; a reward is beta x a
    difference of log-probs, so its gap is relative to beta x the log-probs' size. Accuracies: equal."""
    c, r = t.chosen_rewards, t.rejected_rewards
    assert (c > r).double().mean().item() == pytest.approx(metrics["rewards/accuracies"], abs=1e-6)  # TRL's fp32
    scale = beta * chosen.abs().mean().item()
    gaps = {"loss": gap(loss_of(t), theirs)}
    for name, ours in (("chosen", c), ("rejected", r), ("margins", c - r)):
        gaps[f"rewards/{name}"] = abs(ours.mean().item() - metrics[f"rewards/{name}"]) / scale
    for name, ours in (("chosen", chosen), ("rejected", rejected)):
        gaps[f"logps/{name}"] = gap(ours.mean().item(), metrics[f"logps/{name}"])
    return gaps


def simpo_gaps(model, n, cpo_alpha, smoothing, beta=2.0, gamma=0.5) -> dict:
    from trl.experimental.cpo import CPOTrainer

    ex = examples(n, seed=10 + n)
    theirs, metrics = run_cpo_or_orpo(CPOTrainer, model, ex, beta=beta, label_smoothing=smoothing,
                                      loss_type="simpo", simpo_gamma=gamma, cpo_alpha=cpo_alpha, alpha=0.0)  # fmt: skip
    lp = our_pairs(model, ex)
    t = losses.pair_losses(lp, ["simpo"], None, beta, smoothing, simpo_gamma=gamma, cpo_alpha=cpo_alpha)
    # logps/*: CPO logs per-token averages, as the runner does for these types
    gaps = metric_gaps(t, lp.chosen / lp.chosen_tokens, lp.rejected / lp.rejected_tokens, beta, theirs.item(), metrics)
    if cpo_alpha:  # CPO's NLL: the chosen answers' tokens only, one mean over the batch
        gaps["nll_loss"] = gap(t.chosen_nll_sum.item() / cpo_alpha / t.nll_tokens.item(), metrics["nll_loss"])
    return gaps


def orpo_gaps(model, n, beta=0.1) -> dict:
    from trl.experimental.orpo import ORPOTrainer

    ex = examples(n, seed=20 + n)
    theirs, metrics = run_cpo_or_orpo(ORPOTrainer, model, ex, beta=beta)
    lp = our_pairs(model, ex)
    t = losses.pair_losses(lp, ["orpo"], None, beta, 0.0, simpo_gamma=0.5, cpo_alpha=0.0)
    gaps = metric_gaps(t, lp.chosen / lp.chosen_tokens, lp.rejected / lp.rejected_tokens, beta, theirs.item(), metrics)
    gaps["nll_loss"] = gap(t.chosen_nll_sum.item() / t.nll_tokens.item(), metrics["nll_loss"])
    return gaps


@pytest.mark.parametrize("cpo_alpha, smoothing", [(0.0, 0.0), (0.0, 0.15), (1.0, 0.0), (0.3, 0.1)])
def test_simpo_equals_cpotrainer(models, cpo_alpha, smoothing):
    for dtype in DTYPES:
        for n in BATCHES:
            gaps = simpo_gaps(models[dtype], n, cpo_alpha, smoothing)
            # CPO computes in the model's dtype: in float64 the formulas agree to its rounding
            assert max(gaps.values()) <= (1e-12 if dtype == torch.float64 else GAP), (dtype, n, gaps)


def test_orpo_equals_orpotrainer_with_the_prompt_in_its_nll(models):
    for dtype in DTYPES:
        for n in BATCHES:
            gaps = orpo_gaps(models[dtype], n)
            assert max(gaps.values()) <= GAP, (dtype, n, gaps)


def test_orpo_without_the_prompt_has_cpos_nll_not_orpos(models):
    """Without the prompt's log-probs ORPO's NLL is the chosen answers' alone: CPO's, short of TRL's ORPO."""
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    ex = examples(4, seed=30)
    lp = our_pairs(models[torch.float64], ex)
    lp.chosen_prompt = lp.chosen_prompt_tokens = None
    t = losses.pair_losses(lp, ["orpo"], None, 0.1, 0.0, simpo_gamma=0.5, cpo_alpha=0.0)
    _, orpo = run_cpo_or_orpo(ORPOTrainer, models[torch.float64], ex, beta=0.1)
    _, cpo = run_cpo_or_orpo(CPOTrainer, models[torch.float64], ex, beta=0.1, label_smoothing=0.0,
                             loss_type="simpo", simpo_gamma=0.5, cpo_alpha=1.0, alpha=0.0)  # fmt: skip
    nll = t.chosen_nll_sum.item() / t.nll_tokens.item()
    assert gap(nll, cpo["nll_loss"]) <= 1e-12 and gap(nll, orpo["nll_loss"]) > 1e-3


OK = {"loss_type": ["sigmoid"], "loss_weights": None, "beta": 0.1, "label_smoothing": 0.0, "simpo_gamma": 0.5,
      "cpo_alpha": 0.0}  # fmt: skip


@pytest.mark.parametrize(
    "options, words",
    [
        ({"loss_type": ["sigmod"]}, "--loss_type 'sigmod' is not one TRL knows here"),
        ({"loss_type": ["sigmod"]}, "did you mean 'sigmoid'"),
        ({"loss_type": ["aot"]}, "--loss_type aot (TRL's) is not taken here: it sorts"),
        ({"loss_type": ["discopop"]}, "discopop_tau"),
        ({"loss_type": ["sigmoid", "ipo"], "loss_weights": [1.0]}, "give one per type"),
        ({"beta": 0.0}, "--beta must be > 0"),
        ({"beta": float("nan")}, "--beta must be > 0"),
        ({"loss_type": ["robust"], "label_smoothing": 0.5}, "--label_smoothing must be in [0, 0.5)"),
        ({"loss_type": ["robust"], "label_smoothing": -0.1}, "--label_smoothing must be in [0, 0.5)"),
        ({"loss_type": ["exo_pair"]}, "exo_pair needs --label_smoothing > 0"),
        ({"label_smoothing": 0.1}, "does nothing with --loss_type sigmoid"),
        ({"loss_type": ["simpo", "sigmoid"]}, "needs no reference"),
        ({"loss_type": ["orpo", "simpo"]}, "needs no reference"),
        ({"loss_type": ["simpo"], "cpo_alpha": -1.0}, "--cpo_alpha must be >= 0"),
        ({"cpo_alpha": 1.0}, "read by --loss_type simpo only"),
    ],
)
def test_bad_options_are_one_line(options, words):
    with pytest.raises(ConfigError) as e:
        losses.check_options(**(OK | options))
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "options",
    [{}, {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.2]}, {"loss_type": ["robust", "ipo"],
     "label_smoothing": 0.1}, {"loss_type": ["exo_pair"], "label_smoothing": 1e-3}, {"loss_type": ["simpo"],
     "cpo_alpha": 1.0, "label_smoothing": 0.1}, {"loss_type": ["orpo"]}] + [{"loss_type": [t]} for t in
     losses.LOSS_TYPES if t != "exo_pair"],
)  # fmt: skip
def test_good_options_pass(options):
    losses.check_options(**(OK | options))
