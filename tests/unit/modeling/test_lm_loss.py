"""The tiled loss equals transformers' untiled one: loss and gradients, with SFT masks, in fp32."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.loss.loss_utils import ForCausalLMLoss

from zero_recipes.modeling import lm_loss

V, H = 512, 32


def sft_labels(ids):
    """Prompt tokens masked (-100) the way packed SFT rows are: a masked prefix per example."""
    labels = ids.clone()
    labels[:, :7] = -100
    labels[:, 40:46] = -100
    return labels


def head_and_inputs(seed=0):
    torch.manual_seed(seed)
    head = torch.nn.Linear(H, V, bias=False)
    hidden = torch.randn(2, 64, H, requires_grad=True)
    targets = torch.randint(0, V, (2, 64))
    targets[:, :5] = -100
    targets[1, 30:] = -100
    return head, hidden, targets


def grads_of(head, hidden, targets, tiles, upstream):
    head.zero_grad()
    hidden.grad = None
    loss = lm_loss.summed_loss(head, hidden, targets, tiles)
    (loss * upstream).backward()  # DeepSpeed scales the loss by 1/gradient_accumulation_steps
    return loss.detach(), hidden.grad.clone(), head.weight.grad.clone()


@pytest.mark.parametrize("tiles", [2, 3, 7, 128])
def test_tiled_sum_and_gradients_equal_the_untiled_in_fp32(tiles):
    """The loss within 1e-6 relative; each gradient within 4e-6 of its largest entry. A tile's gradient is
    the same 512-term dot products computed with another matmul blocking, so they round differently: measured
    up to 1.16e-6 (one-token tiles, the input gradient) on an AMD EPYC, 3.9e-7 for the head's. A missing
    scale or a misplaced tile boundary is off by orders of magnitude more."""
    head, hidden, targets = head_and_inputs()
    ref = grads_of(head, hidden, targets, 1, 0.5)
    got = grads_of(head, hidden, targets, tiles, 0.5)
    assert torch.allclose(got[0], ref[0], rtol=1e-6, atol=0)
    for g, r in zip(got[1:], ref[1:]):
        assert (g - r).abs().max().item() <= 4e-6 * r.abs().max().item()


def test_untiled_sum_is_transformers_loss():
    head, hidden, targets = head_and_inputs()
    targets[:, -1] = -100  # transformers' shift leaves the last position without a target
    ours = lm_loss.summed_loss(head, hidden, targets, 1) / (targets != -100).sum()
    labels = torch.nn.functional.pad(targets, (1, 0), value=-100)[:, :-1]  # unshifted, as a model gets them
    theirs = ForCausalLMLoss(head(hidden), labels, V)
    assert torch.allclose(ours, theirs, rtol=1e-6)


def test_deepspeed_tiled_fused_logits_loss_misses_the_upstream_scale_on_the_head():
    """Why lm_loss recomputes its tiles in backward: TiledFusedLogitsLoss backpropagates inside its forward
    with a gradient of 1, so DeepSpeed's 1/gradient_accumulation_steps never reaches the head's weight. If
    this starts failing, DeepSpeed fixed it (a tied head would still need a once-only gradient)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    head, hidden, targets = head_and_inputs()
    _, _, ref_head_grad = grads_of(head, hidden, targets, 1, 0.5)

    def fn(module, x, y):
        logits = module(x).float()
        return torch.nn.functional.cross_entropy(logits.view(-1, V), y.view(-1), ignore_index=-100, reduction="sum")

    head.zero_grad()
    loss = TiledFusedLogitsLoss.apply(fn, head, hidden, targets, None, 4, [head.weight], "sum")
    (loss * 0.5).backward()
    ratio = (head.weight.grad.norm() / ref_head_grad.norm()).item()
    assert ratio == pytest.approx(2.0, rel=1e-5)


def tiny_llama(tie=False):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg).float()


def loss_and_grads(model, **batch):
    model.zero_grad()
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tie", [False, True])
def test_installed_forward_matches_the_models_own_loss_and_gradients(tie):
    model = tiny_llama(tie)
    ids = torch.randint(0, V, (2, 48))
    labels = sft_labels(ids)
    n_items = torch.tensor(37.0)
    ref_loss, ref = loss_and_grads(model, input_ids=ids, labels=labels, num_items_in_batch=n_items)
    lm_loss.install(model, tokens_per_tile=20, tiled=True, zero3=False)
    got_loss, got = loss_and_grads(model, input_ids=ids, labels=labels, num_items_in_batch=n_items)
    assert abs(got_loss - ref_loss) <= 1e-6 * abs(ref_loss)
    assert got.keys() == ref.keys()
    for name in ref:
        assert (got[name] - ref[name]).abs().max() <= 1e-6 * max(ref[name].abs().max(), 1e-3), name
    # without labels it is the model's own forward: logits for generation, eval and the export check
    assert model(input_ids=ids).logits.shape == (2, 48, V)


@pytest.mark.parametrize("tie", [False, True])
def test_each_parameter_is_handed_to_zero_once_per_backward(tie):
    """ZeRO-1/2 take a parameter's gradient from its post-accumulate-grad hook, skip it while DeepSpeed marks it
    not ready (`ds_grad_is_ready`), and assert it comes once a backward (stage_1_and_2.py
    `params_already_reduced`). Untied, DeepSpeed's sequence_tiled_compute fires the head's hook once per tile
    and marks all but the last not ready; tied, that last one came before the embedding's share (5 tiles, then
    the embedding: ZeRO-2 refused it on a GPU at a 128k vocabulary). The checkpointed tiles add up in autograd."""
    model = tiny_llama(tie)
    ready = {}

    def hook(p, name):
        ready[name] = ready.get(name, 0) + int(getattr(p, "ds_grad_is_ready", True))

    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: hook(p, name))
    lm_loss.install(model, tokens_per_tile=20, tiled=True, zero3=False)
    ids = torch.randint(0, V, (2, 48))  # 96 tokens: 5 tiles
    model(input_ids=ids, labels=ids).loss.backward()
    assert ready == {name: 1 for name, _ in model.named_parameters()}


def test_shift_labels_give_the_same_loss_as_labels():
    """Under sequence parallelism each rank gets its targets pre-shifted; the sum over slices is the whole."""
    model = tiny_llama()
    lm_loss.install(model, tokens_per_tile=16, tiled=True, zero3=False)
    ids = torch.randint(0, V, (1, 32))
    labels = sft_labels(ids)
    whole = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(1.0)).loss
    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    again = model(input_ids=ids, shift_labels=shifted, num_items_in_batch=torch.tensor(1.0)).loss
    assert torch.allclose(whole, again, rtol=1e-6)


def test_tiled_mlp_equals_the_plain_mlp():
    model = tiny_llama()
    ids = torch.randint(0, V, (2, 100))  # 100 tokens at hidden 32: 4 tiles per MLP
    ref_loss, ref = loss_and_grads(model, input_ids=ids, labels=ids)
    assert lm_loss.install_tiled_mlp(model, zero3=False) == 2
    got_loss, got = loss_and_grads(model, input_ids=ids, labels=ids)
    assert abs(got_loss - ref_loss) <= 1e-6 * abs(ref_loss)
    for name in ref:
        assert (got[name] - ref[name]).abs().max() <= 1e-5 * max(ref[name].abs().max(), 1e-3), name


def test_auto_tile_keeps_fp32_logits_under_256_mib_and_engages_only_when_needed():
    from types import SimpleNamespace

    big_vocab = LlamaConfig(vocab_size=131072)
    cfg = SimpleNamespace(loss_tile_tokens=0, tiled_loss=True, per_device_train_batch_size=1, block_size=512)
    assert lm_loss.tile_tokens(cfg, big_vocab) == 512
    assert not lm_loss.applies(cfg, big_vocab, sp=1)  # one tile: the model's own loss, unchanged
    assert lm_loss.applies(SimpleNamespace(**{**vars(cfg), "block_size": 4096}), big_vocab, sp=1)
    assert lm_loss.applies(cfg, big_vocab, sp=2)  # SP always computes its loss here
    gemma2 = LlamaConfig(vocab_size=V)
    gemma2.final_logit_softcapping = 30.0
    assert not lm_loss.knows_head(gemma2)


def test_eval_row_sums_equal_the_logits_path():
    """Eval under the installed forward sums loss, targets and wrong argmaxes per row, tile by tile, without
    keeping the logits; the figures equal those read from the whole logits."""
    model = tiny_llama().eval()
    ids = torch.randint(0, V, (3, 40))
    targets = torch.nn.functional.pad(sft_labels(ids)[:, 1:], (0, 1), value=-100)
    targets[2] = -100  # a row without an answer
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100, reduction="none")
    valid = targets != -100
    want = torch.stack([ce.sum(1), valid.sum(1), ((logits.argmax(-1) != targets) & valid).sum(1)], 1).double()
    lm_loss.install(model, tokens_per_tile=16, tiled=True, zero3=False)
    with torch.no_grad():
        got = model(input_ids=ids, eval_targets=targets)["row_stats"]
    assert torch.allclose(got, want, rtol=1e-6)
    assert got[2].tolist() == [0.0, 0.0, 0.0]


def test_installed_forward_under_a_peft_lora_wrapper_matches_the_models_own():
    """LoRA recipes at long blocks tile their loss too: peft calls the inner model's forward, the replaced one."""
    from peft import LoraConfig, get_peft_model

    ids = torch.randint(0, V, (2, 48))
    labels = sft_labels(ids)
    results = []
    for install in (False, True):
        model = tiny_llama()
        if install:
            lm_loss.install(model, tokens_per_tile=20, tiled=True, zero3=False)
        torch.manual_seed(1)
        peft = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        results.append(loss_and_grads(peft, input_ids=ids, labels=labels))
    (ref_loss, ref), (got_loss, got) = results
    assert abs(got_loss - ref_loss) <= 1e-6 * abs(ref_loss)
    assert got.keys() == ref.keys() and any("lora_A" in n for n in got)
    for name in ref:
        assert (got[name] - ref[name]).abs().max() <= 1e-6 * max(ref[name].abs().max(), 1e-3), name
