"""The SFT benchmark's data and token arithmetic (tools/bench/sft/data.py), on the batches the three
runners really feed their models: train.py's packed collate, TRL's padding-free collator and the HF Trainer's
DataCollatorForSeq2Seq; its summary of measured rounds (tools/bench/sft/benchmark.py); and its probe
(sft/probe.py) on the model's device, waiting for it before each stamp."""

import statistics
import time

import numpy as np
import pytest
import torch

from bench import paired
from bench.sft import benchmark as sft, data as sft_data, probe as sft_probe
from zero_recipes.data import packing

PAD = 0


def test_train_py_packed_rows_count_the_tail_segment_of_padding_and_nothing_else():
    a = (np.array([5, 6, 7, 8]), np.array([0, 0, 1, 1]))  # prompt 2 tokens, answer 2
    b = (np.array([9, 10, 11]), np.array([0, 1, 1]))
    c = (np.array([12, 13, 14, 15, 16, 17]), None)  # an unmasked example fills its row
    batch = packing.collate([[a, b], [c]], PAD, length=8)
    computed, trained, real = sft_data.batch_tokens(batch, PAD)
    assert computed == 16 and real == 4 + 3 + 6  # row 1: 7 real + 1 pad; row 2: 6 real + 2 pad
    # the loss's targets: labels[1:], where train.py keeps the answers and drops each segment's first token
    assert trained == int((batch["labels"][:, 1:] != -100).sum()) == 2 + 2 + 5
    assert sft_data.padding_share(computed, real) == pytest.approx(3 / 16)


def test_a_packed_row_that_ends_exactly_at_the_block_has_no_padding():
    a = (np.array([1, 2, 3, 4]), None)
    b = (np.array([PAD, 5, 6, 7]), None)  # a real example may contain the pad id; only an all-pad tail is padding
    batch = packing.collate([[a, b]], PAD, length=8)
    assert sft_data.batch_tokens(batch, PAD)[2] == 8


def test_hf_seq2seq_batches_count_padding_from_the_attention_mask():
    from transformers import DataCollatorForSeq2Seq

    tok = _tokenizer()
    examples = [
        {"input_ids": [5, 6, 7, 8, 9], "labels": [-100, -100, 7, 8, 9]},
        {"input_ids": [5, 6], "labels": [-100, 6]},
    ]
    batch = DataCollatorForSeq2Seq(tok, padding=True, label_pad_token_id=-100)(examples)
    computed, trained, real = sft_data.batch_tokens(dict(batch), tok.pad_token_id)
    assert (computed, trained, real) == (10, 4, 7)


def test_trl_padding_free_batches_have_no_padding():
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    examples = [
        {"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]},
        {"input_ids": [9, 10, 11], "labels": [-100, 10, 11]},
    ]
    batch = DataCollatorForLanguageModeling(pad_token_id=PAD, padding_free=True)(examples)
    computed, trained, real = sft_data.batch_tokens(dict(batch), PAD)
    assert computed == real == 7
    assert trained == int((batch["labels"][:, 1:] != -100).sum()) == 4


def test_the_skewed_set_spreads_like_chat_data():
    lengths = sft_data.skewed_lengths(5000, seed=0)
    assert min(lengths) >= sft_data.LOW and max(lengths) == sft_data.HIGH  # clipped, and the tail reaches it
    median = statistics.median(lengths)
    assert 0.9 * sft_data.MEDIAN < median < 1.1 * sft_data.MEDIAN
    assert sorted(lengths)[int(0.95 * len(lengths))] > 3 * median  # a long tail
    assert sft_data.skewed_lengths(50, seed=3) == sft_data.skewed_lengths(50, seed=3)  # same on every machine


def test_generated_chats_mask_the_prompt_and_train_the_answer_through_the_chat_template():
    tok = _tokenizer()
    rows = sft_data.skewed_chats(20, ["alpha", "beta", "gamma", "delta"], tokens_per_word=1.0, seed=0)
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in rows)
    ex = sft_data.masked_example(rows[0]["messages"], tok, max_length=10_000)
    answer = tok(rows[0]["messages"][1]["content"], add_special_tokens=False)["input_ids"]
    trained = [t for t, label in zip(ex["input_ids"], ex["labels"]) if label != -100]
    assert trained[: len(answer)] == answer and ex["labels"][0] == -100
    pc = sft_data.as_prompt_completion(rows[0])
    assert pc["prompt"] + pc["completion"] == rows[0]["messages"]
    assert len(sft_data.masked_example(rows[0]["messages"], tok, max_length=7)["input_ids"]) == 7


def _tokenizer():
    from transformers import AutoTokenizer

    from zero_recipes.config.train_config import TrainConfig
    from zero_recipes.data import formats
    from zero_recipes.data.builtin import builtin_tokenizer_dir

    tok = AutoTokenizer.from_pretrained(str(builtin_tokenizer_dir(TrainConfig())))
    formats.ensure_chat_template(tok, lambda *a: None)
    tok.pad_token = tok.pad_token or tok.eos_token
    return tok


# ---- the report's summary of measured rounds ---------------------------------------------------------


def _run(speed: float, first_step: float, loss=2.0) -> dict:
    return {
        "label_rates": [speed * x for x in (1.0, 1.1, 0.9)],
        "real_rates": [3 * speed * x for x in (1.0, 1.1, 0.9)],
        "padding_share": 0.25,
        "steps": 10,
        "trained": 1000,
        "real": 3000,
        "train_seconds": 5.0,
        "time_to_first_step": first_step,
        "max_rss_gib": [1.0, 1.5],
        "eval_loss": loss,
    }


def test_the_summary_pairs_rounds_and_reports_what_each_goal_compares():
    rounds = []
    for load in (1.0, 0.8, 1.2):  # the machine's speed changes between rounds; each round's runs share it
        rounds.append(
            {
                "train.py": _run(200 * load, 4.0),
                "TRL SFTTrainer": _run(100 * load, 10.0),
                "HF Trainer": _run(160 * load, 6.0),
                "train.py, text": _run(250 * load, 8.0, loss=None),
            }
        )
    settings = dict(sft.QUICK, rounds=3, eval=8)
    data = {"length_percentiles": {5: 20, 50: 180, 100: 460}, "mean_length": 250.0, "tokens": 30_000}
    r = sft.summarise({"work": data, "rounds": rounds}, settings)
    q = r["ratios"]
    assert q["vs_trl"]["median"] == pytest.approx(2.0) and q["vs_trl"]["half_width"] == pytest.approx(0)
    assert q["vs_hf"]["median"] == pytest.approx(1.25)
    assert q["sft_vs_text"]["median"] == pytest.approx(0.8)  # real tokens/s: 600 vs 750
    assert q["first_step_vs_trl"]["median"] == pytest.approx(0.4) and q["first_step_vs_trl"]["pairs"] == 2
    t = r["runners"]["train.py"]
    assert t["first_step_cold"] == 4.0 and t["first_step_cached"] == 4.0 and t["max_rss_gib"] == [1.0, 1.5]
    assert r["runners"]["train.py, text"]["eval_loss"] is None
    report = sft.markdown({**r, "date": "2026-12-01", "command": "python tools/benchmark.py sft", **_env()})
    # each ratio with both runners' median rates beside it (a slow host shows in the rates, not in the ratio)
    row = "| train.py / TRL SFTTrainer, label tokens/s (200 / 100) | 2.000 (2.000–2.000, ±0.0%) | >= 1.0 | yes | yes |"
    assert row in report
    assert "| train.py SFT / train.py text, real tokens/s (600 / 750) | 0.800" in report and "| **no** |" in report
    assert "| cached time to first step, train.py / TRL | 0.400" in report


def test_one_round_reports_no_cached_first_step():
    rounds = [{name: _run(100.0, 5.0, None if "text" in name else 2.0) for name in sft.RUNNERS}]
    r = sft.summarise({"work": {}, "rounds": rounds}, dict(sft.QUICK))
    assert "first_step_vs_trl" not in r["ratios"] and r["runners"]["train.py"]["first_step_cached"] is None
    assert r["ratios"]["vs_trl"] == paired.ratio(
        [{k: v["label_rates"] for k, v in rounds[0].items()}], "train.py", "TRL SFTTrainer"
    )


def _env():
    return {
        "versions": {"torch": "x"},
        "machine": {"cpu": "cpu", "cores": 2, "cores_usable": 2, "ram_gib": 1.0, "gpus": []},
    }


def test_batch_tokens_reads_shift_labels_as_given():
    ids = torch.tensor([[1, 2, 3, 4]])
    shift = torch.tensor([[2, -100, 4, -100]])
    assert sft_data.batch_tokens({"input_ids": ids, "shift_labels": shift}, PAD) == (4, 2, 4)


# ---- on the device the model is on: a GPU's batches and weights are on the GPU --------------------------------
# Without a GPU, the 'meta' device stands in for one: an op that mixes a CPU tensor with a meta one fails as it
# would with a CUDA one ("Tensor on device cpu is not on the expected device meta").


class _Bigram(torch.nn.Module):
    """A language model small enough to build anywhere: each token's logits are a row of one table."""

    def __init__(self, vocab: int):
        super().__init__()
        self.table = torch.nn.Embedding(vocab, vocab)

    def forward(self, input_ids, use_cache=False):
        from types import SimpleNamespace

        self.fed = input_ids.device  # an embedding on 'meta' takes CPU ids without a word: what came is kept
        return SimpleNamespace(logits=self.table(input_ids))


def test_packed_rows_padding_is_counted_where_the_batch_is():
    a = (np.array([1, 2, 3]), None)
    batch = packing.collate([[a], [a, a]], PAD, length=8)
    ids, pos = batch["input_ids"], batch["position_ids"]
    assert int(sft_data.tail_padding(ids, pos, PAD)) == 16 - 9  # row 1: 5 pad, row 2: 2
    assert sft_data.tail_padding(ids.to("meta"), pos.to("meta"), PAD).device.type == "meta"


def test_the_held_out_loss_feeds_the_model_on_its_device():
    tok = _tokenizer()
    rows = sft_data.skewed_chats(3, ["alpha", "beta", "gamma"], tokens_per_word=1.0, seed=0)
    targets = sum(sum(x != -100 for x in sft_data.masked_example(r["messages"], tok, 4096)["labels"][1:]) for r in rows)
    with torch.device("meta"):
        model = _Bigram(len(tok)).train()
    total, count = sft_probe.held_out_sums(model, [r["messages"] for r in rows], tok, max_length=4096)
    assert model.fed.type == total.device.type == "meta" and count == targets > 0 and model.training
    cpu_total, cpu_count = sft_probe.held_out_sums(_Bigram(len(tok)), [r["messages"] for r in rows], tok, 4096)
    assert cpu_count == targets and 0 < float(cpu_total) / cpu_count < 2 * np.log(len(tok)) + 10


def test_the_step_probe_waits_for_the_device_before_each_stamp():
    waits = []
    probe = sft_probe.StepProbe(wait=lambda device: waits.append((device, time.perf_counter())))
    model = _Bigram(16).train()
    probe.attach(model, PAD)
    ids = torch.tensor([[1, 2, 3]])
    for _ in range(3):
        model(input_ids=ids)
    with torch.no_grad():
        model(input_ids=ids)  # an eval forward: neither waited for nor stamped
    assert [d.type for d, _ in waits] == ["cpu"] * 3 and len(probe.starts) == 3
    assert all(start >= waited for (_, waited), start in zip(waits, probe.starts))  # the clock read after the wait
    sft_probe.wait_for(torch.device("cpu"))  # the CPU runs as it goes: nothing to wait for
