"""Packing and order: whole examples per row, examples that cannot see each other (a packed example's
loss is its unpacked loss), high utilisation on skewed lengths, and resumes that continue exactly."""

import json

import numpy as np
import pytest
import torch

from zero_recipes import data
from zero_recipes.config.train_config import TrainConfig
from zero_recipes.data import packing
from zero_recipes.data.streaming import prepare_stream
from zero_recipes.modeling import packed_attention

# max |packed - unpacked| per-example mean loss, fp32: the same math in a different summation order
PACKED_LOSS_TOL = 1e-5


@pytest.fixture(scope="module")
def tok():
    return data.load_tokenizer(TrainConfig())


def test_best_fit_packing_keeps_whole_examples_and_fills_rows():
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.lognormal(4.0, 1.0, 5000).astype(np.int64) + 2, 1024)  # mostly short, a few long
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    seg, ptr = packing.pack(starts, lengths, 1024)
    assert sorted(seg[:, 0].tolist()) == starts.tolist()  # every example exactly once, never split
    row_len = np.add.reduceat(seg[:, 1], ptr[:-1])
    assert row_len.max() <= 1024
    assert row_len.sum() / (len(row_len) * 1024) >= 0.95
    one, _ = packing.one_per_row(starts, lengths)
    assert len(ptr) - 1 < len(one) / 5


def test_collate_restarts_positions_and_masks_segment_starts():
    toks = np.arange(100, 110)
    mask = np.array([0, 0, 1, 1, 0, 0, 1, 1, 1, 1], dtype=np.uint8)
    rows = [[(toks[:4], mask[:4]), (toks[4:], mask[4:])], [(toks[:3], mask[:3])]]
    b = data.collate(rows, pad_id=0)
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, 2, 3, 4, 5, 6]]
    assert b["labels"][0].tolist() == [-100, -100, 102, 103, -100, -100, 106, 107, 108, 109]
    assert b["labels"][1].tolist() == [-100, -100, 102] + [-100] * 7
    assert b["input_ids"][1].tolist() == [100, 101, 102] + [0] * 7
    single = data.collate([[(toks[:3], None)], [(toks[:5], None)]], pad_id=0)
    assert "position_ids" not in single and single["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1] * 5]
    assert not [k for k in single if k.startswith(("cu_seq_lens", "max_length"))]  # no cut points unpacked


def test_the_collator_gives_the_cut_points_the_attention_would_derive():
    """Computed once per batch on the host, they equal what packed_attention and transformers' varlen flash
    path derive from the restarting position ids in every layer (transformers' own function is the check)."""
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    toks = np.arange(1, 11)
    rows = [[(toks[:4], None), (toks[:6], None)], [(toks[:3], None)], [(toks, None)]]  # row 1 has a padding tail
    b = data.collate(rows, pad_id=0)
    rows_n, width = b["input_ids"].shape
    assert b["cu_seq_lens_host"] == (0, 4, 10, 13, 20, 30)  # the batch's tokens end to end: 3 rows of 10
    assert b["cu_seq_lens_q"].dtype == torch.int32 and b["cu_seq_lens_q"].tolist() == list(b["cu_seq_lens_host"])
    (cu_q, cu_k), (longest_q, longest_k) = prepare_fa_kwargs_from_position_ids(b["position_ids"])
    assert torch.equal(b["cu_seq_lens_q"], cu_q) and torch.equal(b["cu_seq_lens_k"], cu_k)
    assert b["max_length_q"] == b["max_length_k"] == int(longest_q) == int(longest_k) == 10
    assert type(b["max_length_q"]) is int  # flash-attn takes an int; a tensor would be read on the host per layer
    per_row = packed_attention.per_row(b["cu_seq_lens_host"], rows_n, width)
    assert per_row == packed_attention.cuts_from_positions(b["position_ids"], rows_n, width)
    assert per_row == [[0, 4, 10], [0, 3, 10], [0, 10]]


def tiny_model(model_type, attn):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    if model_type == "gpt2":
        kw = dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    if model_type == "qwen2":
        kw["num_key_value_heads"] = 2
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw), attn_implementation=attn).eval()


@pytest.mark.parametrize(
    "model_type,attn", [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa"), ("gpt2", "sdpa")]
)
def test_a_packed_example_has_its_unpacked_loss(model_type, attn):
    model = tiny_model(model_type, attn)
    rng = np.random.default_rng(1)
    examples = [(rng.integers(1, 64, n), (np.arange(n) >= n // 2).astype(np.uint8)) for n in (7, 12, 5, 9)]
    packed = data.collate([examples], pad_id=0, length=40)  # one row: 4 examples and 7 padding tokens

    def per_example_loss(batch):
        with torch.no_grad():
            # use_cache=False as in training: with a KV cache transformers ignores packed position ids
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits[:, :-1]
        target = batch["labels"][:, 1:]
        losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none", ignore_index=-100)
        return losses, target != -100

    losses, valid = per_example_loss(packed)
    at = 0
    for ids, mask in examples:
        alone = data.collate([[(ids, mask)]], pad_id=0)
        l1, v1 = per_example_loss(alone)
        # the packed row's predictions for this example are positions at .. at+n-2 (shifted by one)
        lp, vp = losses[0, at : at + len(ids) - 1], valid[0, at : at + len(ids) - 1]
        assert torch.equal(vp, v1[0])
        assert abs(lp[vp].mean().item() - l1[0][v1[0]].mean().item()) < PACKED_LOSS_TOL
        at += len(ids)
    # the check has teeth: without restarting positions, later examples attend to earlier ones
    leaky = {k: v for k, v in packed.items() if k != "position_ids"}
    l2, v2 = per_example_loss(leaky)
    assert (l2[0, 7:18] - losses[0, 7:18]).abs().max() > 100 * PACKED_LOSS_TOL


def test_packing_utilisation_on_skewed_sft_data(tmp_path, tok):
    rng = np.random.default_rng(0)
    words = rng.lognormal(2.5, 1.0, 1500).astype(int) + 1
    rows = [
        {"prompt": f"Q{i}: " + "ask " * int(rng.integers(1, 8)), "completion": " ans" * min(int(n), 150)}
        for i, n in enumerate(words)
    ]
    path = tmp_path / "skewed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    util = {}
    for pack in (True, False):
        p = data.prepare(
            TrainConfig(
                dataset_name=str(path),
                block_size=256,
                packing=pack,
                validation_split_percentage=0,
                cache_dir=str(tmp_path / "c"),
            ),
            tok,
            lambda *_: None,
        )
        order = data.BatchOrder(p.train, 8, 0, 1, 0, p.pad_id)
        util[pack] = data.utilisation(p.train, [order.next_indices() for _ in range(order.per_rank)])
    assert util[True] >= 0.95 and util[False] < 0.8, util


def test_batch_order_is_sharded_seeded_and_resumes_by_seeking():
    toks = np.arange(40 * 4)
    seg, ptr = packing.windows(len(toks), 4)
    rows = data.Samples(toks, None, seg, ptr)
    ranks = [data.BatchOrder(rows, 2, r, 2, seed=7, pad_id=0) for r in range(2)]
    seen = [[ranks[r].next_batch()["input_ids"][:, 0].tolist() for _ in range(10)] for r in range(2)]
    flat = sorted(x for r in seen for b in r for x in b)
    assert flat == list(range(0, 160, 4))  # one epoch: every row once, no overlap between ranks
    again = data.BatchOrder(rows, 2, 0, 2, seed=7, pad_id=0)
    assert [again.next_batch()["input_ids"][:, 0].tolist() for _ in range(10)] == seen[0]
    a = data.BatchOrder(rows, 2, 1, 2, seed=7, pad_id=0)
    for _ in range(13):  # into epoch 2
        a.next_batch()
    b = data.BatchOrder(rows, 2, 1, 2, seed=7, pad_id=0)
    b.load_state_dict(a.state_dict())
    assert all(torch.equal(a.next_batch()["input_ids"], b.next_batch()["input_ids"]) for _ in range(12))
    other_seed = data.BatchOrder(rows, 2, 0, 2, seed=8, pad_id=0)
    assert other_seed._epoch_order().tolist() != ranks[0]._epoch_order().tolist()


def test_streaming_reads_the_same_stream_and_resumes_mid_document(tmp_path, tok):
    texts = [f"Streamed document {i}: " + "lorem ipsum " * (i % 17 + 1) for i in range(300)]
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    kw = dict(
        dataset_name=str(path),
        block_size=32,
        per_device_train_batch_size=4,
        validation_split_percentage=0,
        max_steps=10,
        cache_dir=str(tmp_path / "c"),
    )
    prepared = data.prepare(TrainConfig(**kw), tok, lambda *_: None)
    stream = prepare_stream(TrainConfig(**kw, streaming=True), tok, 0, 1, lambda *_: None).train
    expected = [np.concatenate([t for t, _ in prepared.train.row(i)]) for i in range(12)]
    got = [row for _ in range(3) for row in stream.next_batch()["input_ids"].numpy()]
    assert all(np.array_equal(a, b) for a, b in zip(got, expected))  # file order, whole-stream windows
    state = stream.state_dict()
    assert state["offset"] > 0  # this test resumes inside a document
    resumed = prepare_stream(TrainConfig(**kw, streaming=True), tok, 0, 1, lambda *_: None).train
    resumed.load_state_dict(state)
    for _ in range(5):
        assert torch.equal(stream.next_batch()["input_ids"], resumed.next_batch()["input_ids"])
    # two ranks read disjoint shards, and each resumes within its own shard
    shards = [prepare_stream(TrainConfig(**kw, streaming=True), tok, r, 2, lambda *_: None).train for r in range(2)]
    first = [s.next_batch()["input_ids"] for s in shards]
    assert not torch.equal(first[0], first[1])
    again = prepare_stream(TrainConfig(**kw, streaming=True), tok, 1, 2, lambda *_: None).train
    again.load_state_dict(shards[1].state_dict())
    assert shards[1].state_dict()["example"] > 0
    for _ in range(3):
        assert torch.equal(shards[1].next_batch()["input_ids"], again.next_batch()["input_ids"])


def test_streaming_sft_packs_whole_examples_in_order(tmp_path, tok):
    rows = [{"prompt": f"Q{i}?", "completion": " answer" * (i % 9 + 1)} for i in range(200)]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = TrainConfig(
        dataset_name=str(path),
        block_size=64,
        per_device_train_batch_size=2,
        max_steps=5,
        validation_split_percentage=0,
        cache_dir=str(tmp_path / "c"),
        streaming=True,
    )
    stream = prepare_stream(cfg, tok, 0, 1, lambda *_: None).train
    b = stream.next_batch()
    pos = b["position_ids"][0]
    starts = (pos == 0).nonzero().flatten().tolist()
    assert len(starts) >= 3  # several examples in the first row
    text = tok.decode(b["input_ids"][0][: starts[2]])
    assert text.startswith("Q0? answer<|endoftext|>Q1? answer answer<|endoftext|>")
