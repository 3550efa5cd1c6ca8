"""Data: every local format gives the same blocks; the stream is concatenated, not cut per document;
the batch order is seeded, sharded and resumable."""

import json

import numpy as np
import pytest

from zero_recipes import data
from zero_recipes.config import ConfigError, TrainConfig

TEXTS = [f"Document number {i} says: " + " ".join(f"word{j}" for j in range(i % 13 + 3)) for i in range(60)]


def write_all_formats(tmp_path):
    import datasets
    import pandas as pd

    files = {}
    files["jsonl"] = tmp_path / "c.jsonl"
    files["jsonl"].write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    files["json"] = tmp_path / "c.json"
    files["json"].write_text(json.dumps([{"text": t} for t in TEXTS]))
    files["csv"] = tmp_path / "c.csv"
    pd.DataFrame({"text": TEXTS}).to_csv(files["csv"], index=False)
    files["parquet"] = tmp_path / "c.parquet"
    pd.DataFrame({"text": TEXTS}).to_parquet(files["parquet"])
    files["txt"] = tmp_path / "c.txt"
    files["txt"].write_text("\n".join(TEXTS) + "\n")
    files["saved"] = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(str(files["saved"]))
    return files


@pytest.fixture(scope="module")
def tokenizer():
    return data.load_tokenizer(TrainConfig())


def test_every_local_format_gives_the_same_blocks(tmp_path, tokenizer):
    blocks = {}
    for kind, path in write_all_formats(tmp_path).items():
        cfg = TrainConfig(dataset_name=str(path), block_size=16, validation_split_percentage=10,
                          cache_dir=str(tmp_path / "cache"))
        train, evald = data.prepare_blocks(cfg, tokenizer, log=lambda *_: None)
        blocks[kind] = (np.asarray(train), np.asarray(evald))
    ref = blocks["jsonl"]
    for kind, (train, evald) in blocks.items():
        assert np.array_equal(train, ref[0]) and np.array_equal(evald, ref[1]), kind
    # the whole stream is kept: only the final partial block is dropped
    n_tokens = sum(len(tokenizer(t, add_special_tokens=False).input_ids) + 1 for t in TEXTS)
    assert (len(ref[0]) + len(ref[1])) * 16 > n_tokens - 2 * 16
    assert (ref[0] == tokenizer.eos_token_id).sum() > 0  # documents are separated by EOS


def test_second_prepare_reads_the_cache(tmp_path, tokenizer):
    path = write_all_formats(tmp_path)["jsonl"]
    cfg = TrainConfig(dataset_name=str(path), block_size=16, cache_dir=str(tmp_path / "cache"))
    logs = []
    first = data.prepare_blocks(cfg, tokenizer, log=logs.append)
    second = data.prepare_blocks(cfg, tokenizer, log=logs.append)
    assert "tokenisation skipped" not in logs[0] and "tokenisation skipped" in logs[1]
    assert np.array_equal(first[0], second[0])


def test_missing_column_and_unknown_extension(tmp_path, tokenizer):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"body": "x"}) + "\n")
    cfg = TrainConfig(dataset_name=str(path), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match="no column 'text' \\(columns: body\\); pass --text_column"):
        data.prepare_blocks(cfg, tokenizer, log=print)
    odd = tmp_path / "c.xml"
    odd.write_text("<a/>")
    with pytest.raises(ConfigError, match="unsupported extension"):
        data.dataset_source(TrainConfig(dataset_name=str(odd)))


def test_batch_order_is_sharded_seeded_and_resumes_by_seeking():
    blocks = np.arange(40 * 4).reshape(40, 4)
    ranks = [data.BatchOrder(blocks, 2, r, 2, seed=7) for r in range(2)]
    seen = [[ranks[r].next_batch()[:, 0].tolist() for _ in range(10)] for r in range(2)]
    flat = [x for r in seen for b in r for x in b]
    assert sorted(flat) == list(range(0, 160, 4))  # one epoch: every block once, no overlap between ranks
    again = data.BatchOrder(blocks, 2, 0, 2, seed=7)
    assert [again.next_batch()[:, 0].tolist() for _ in range(10)] == seen[0]
    # resume mid-epoch 2 from a saved position: the same batches follow
    a = data.BatchOrder(blocks, 2, 1, 2, seed=7)
    for _ in range(13):
        a.next_batch()
    b = data.BatchOrder(blocks, 2, 1, 2, seed=7)
    b.load_state_dict(a.state_dict())
    assert all(np.array_equal(a.next_batch(), b.next_batch()) for _ in range(12))
    assert data.BatchOrder(blocks, 2, 0, 2, seed=8)._epoch_order().tolist() != ranks[0]._epoch_order().tolist()
