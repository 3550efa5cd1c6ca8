"""Data sources and formats: every local format and source kind, SFT masking, cleaning and mixtures,
each on files the test writes."""

import json
from dataclasses import fields, is_dataclass, replace

import datasets
import numpy as np
import pandas as pd
import pytest

from zero_recipes import data
from zero_recipes.config.train_config import DEDUPE_MODES, QUALITY_FILTERS, TrainConfig
from zero_recipes.data import options, preparation as pipeline

TEXTS = [f"Document number {i} says: " + " ".join(f"word{j}" for j in range(i % 13 + 3)) for i in range(60)]


def quiet(*_):
    pass


@pytest.fixture(scope="module")
def tok():
    return data.load_tokenizer(TrainConfig())


def prep(tmp_path, tok, log=quiet, **kw):
    kw.setdefault("cache_dir", str(tmp_path / "cache"))
    return data.prepare(TrainConfig(**kw), tok, log)


def rows_of(samples):
    return [np.concatenate([t for t, _ in samples.row(i)]).tolist() for i in range(len(samples))]


def labels_text(tok, batch_row_ids, batch_row_labels):
    return tok.decode([t for t, label in zip(batch_row_ids, batch_row_labels) if label != -100])


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_every_local_format_and_source_kind_gives_the_same_rows(tmp_path, tok):
    files = {"jsonl": write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in TEXTS])}
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
    # a directory laid out like a hub dataset repo: load_dataset(id, config, split=...) reads it exactly
    # as it reads a hub id, so this exercises the hub path offline
    repo = tmp_path / "hub-repo"
    (repo / "data").mkdir(parents=True)
    pd.DataFrame({"text": TEXTS}).to_parquet(repo / "data" / "main.parquet")
    pd.DataFrame({"text": ["unused"] * 5}).to_parquet(repo / "data" / "other.parquet")
    (repo / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: data/main.parquet\n"
        "- config_name: other\n  data_files:\n  - split: train\n    path: data/other.parquet\n---\n"
    )
    results = {}
    for kind, path in files.items():
        p = prep(tmp_path, tok, dataset_name=str(path), block_size=16, validation_split_percentage=10)
        results[kind] = (rows_of(p.train), rows_of(p.eval))
    p = prep(
        tmp_path, tok, dataset_name=str(repo), dataset_config_name="main", block_size=16, validation_split_percentage=10
    )
    results["hub layout, config main"] = (rows_of(p.train), rows_of(p.eval))
    ref = results["jsonl"]
    for kind, got in results.items():
        assert got == ref, kind
    # the whole stream is kept: only the final partial block is dropped, and EOS separates documents
    n_tokens = sum(len(tok(t, add_special_tokens=False).input_ids) + 1 for t in TEXTS)
    assert (len(ref[0]) + len(ref[1])) * 16 > n_tokens - 2 * 16
    assert sum(r.count(tok.eos_token_id) for r in ref[0]) > 0


def test_second_prepare_reads_the_cache(tmp_path, tok):
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in TEXTS])
    logs = []
    first = prep(tmp_path, tok, logs.append, dataset_name=str(path), block_size=16)
    n = len(logs)
    second = prep(tmp_path, tok, logs.append, dataset_name=str(path), block_size=16)
    assert not any("tokenisation skipped" in m for m in logs[:n])
    assert any("tokenisation skipped" in m for m in logs[n:])
    assert rows_of(first.train) == rows_of(second.train)


def option_fields(opts):
    """(name, value, setter) for every field of a DataOptions, nested ones included; setter(v) returns a
    copy of `opts` with that field set to v."""
    for f in fields(opts):
        value = getattr(opts, f.name)
        if is_dataclass(value):
            for name, v, set_inner in option_fields(value):
                yield name, v, lambda new, f=f, s=set_inner: replace(opts, **{f.name: s(new)})
        else:
            yield f.name, value, lambda new, f=f: replace(opts, **{f.name: new})


def another(name, value):
    if name == "format":
        return "text" if value != "text" else "auto"
    if name in ("dedupe", "quality_filter"):  # choices: another one of them
        return next(c for c in (DEDUPE_MODES if name == "dedupe" else QUALITY_FILTERS) if c != value)
    if name == "dedupe_threshold":
        return value / 2
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "_other"
    raise AssertionError(f"DataOptions.{name}: no other value for a {type(value).__name__}; teach this test one")


def test_cache_key_changes_with_every_data_option_and_nothing_else(tmp_path, tok):
    """Each DataOptions field is read from its TrainConfig option and changes the prepared-data cache key;
    options that do not shape the rows leave the key alone, so they reuse the cache."""
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in TEXTS])
    base = TrainConfig(dataset_name=str(path), cache_dir=str(tmp_path / "cache"))
    spec = data.dataset_specs(base)[0]
    source = data.describe(spec, base)
    opts = data.DataOptions.from_config(base, spec)

    def key_of(cfg):
        s = data.dataset_specs(cfg)[0]
        return pipeline.cache_key(s, data.describe(s, cfg), data.DataOptions.from_config(cfg, s), tok)

    ref = pipeline.cache_key(spec, source, opts, tok)
    assert key_of(base) == ref
    found = list(option_fields(opts))
    assert len({name for name, _, _ in found}) == len(found) >= 11  # one TrainConfig field per name
    for name, value, with_value in found:
        new = another(name, value)
        # the key hashes the option itself (spec and source held fixed) ...
        assert pipeline.cache_key(spec, source, with_value(new), tok) != ref, name
        # ... and from_config reads it from the TrainConfig field of its name
        cfg = replace(base, **{options.PER_DATASET.get(name, name): new})
        assert data.DataOptions.from_config(cfg, data.dataset_specs(cfg)[0]) == with_value(new), name
        assert key_of(cfg) != ref, name
    for unrelated in (
        {"learning_rate": 1e-4},
        {"max_steps": 7},
        {"per_device_train_batch_size": 3},
        {"preprocessing_num_workers": 1},
        {"streaming": True},
    ):
        assert key_of(replace(base, **unrelated)) == ref, unrelated
    assert pipeline.cache_key(replace(spec, weight=0.5), source, opts, tok) == ref  # a mixture weight
    # a mixture entry's own format and text column win over the run's
    entry = replace(spec, format="text", text_column="body")
    assert data.DataOptions.from_config(base, entry).tokenize == replace(
        opts.tokenize, format="text", text_column="body"
    )


def test_format_detection_says_what_it_found(tmp_path, tok):
    cases = {
        "messages": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        "prompt_completion": {"prompt": "2+2=", "completion": " 4"},
        "alpaca": {"instruction": "Add", "input": "2 and 2", "output": "4"},
        "text": {"text": "plain"},
    }
    for fmt, row in cases.items():
        logs = []
        p = prep(
            tmp_path,
            tok,
            logs.append,
            dataset_name=str(write_jsonl(tmp_path / f"{fmt}.jsonl", [row] * 4)),
            block_size=8 if fmt == "text" else 256,
            validation_split_percentage=0,
        )
        assert p.formats == [fmt]
        assert any(f"detected format '{fmt}'" in m for m in logs), logs


def batch_of(p, i=0):
    return data.collate([p.train.row(i)], p.pad_id)


def test_prompt_completion_and_alpaca_train_only_on_the_answer(tmp_path, tok):
    p = prep(
        tmp_path,
        tok,
        dataset_name=str(
            write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "Question: two plus two?", "completion": " Answer: four"}])
        ),
        validation_split_percentage=0,
        packing=False,
    )
    b = batch_of(p)
    assert labels_text(tok, b["input_ids"][0].tolist(), b["labels"][0].tolist()) == " Answer: four<|endoftext|>"
    assert tok.decode(b["input_ids"][0]) == "Question: two plus two? Answer: four<|endoftext|>"
    rows = [
        {"instruction": "Name a colour.", "input": "", "output": "Blue."},
        {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
    ]
    p = prep(
        tmp_path,
        tok,
        dataset_name=str(write_jsonl(tmp_path / "al.jsonl", rows)),
        validation_split_percentage=0,
        packing=False,
    )
    texts = {tok.decode(batch_of(p, i)["input_ids"][0]): batch_of(p, i) for i in range(2)}
    with_input = next(b for t, b in texts.items() if "### Input:\n2 and 3" in t)
    assert labels_text(tok, with_input["input_ids"][0].tolist(), with_input["labels"][0].tolist()) == "5<|endoftext|>"
    assert any("### Input" not in t and "Blue." in t for t in texts)
    # train_on_prompt: every token but the first (which nothing precedes) is a label
    p = prep(
        tmp_path,
        tok,
        dataset_name=str(tmp_path / "pc.jsonl"),
        validation_split_percentage=0,
        packing=False,
        train_on_prompt=True,
    )
    b = batch_of(p)
    assert (b["labels"][0, 1:] == b["input_ids"][0, 1:]).all() and b["labels"][0, 0] == -100


def test_multi_turn_chat_trains_every_assistant_turn_and_nothing_else(tmp_path, tok):
    conv = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say A."},
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "Say B."},
        {"role": "assistant", "content": "B"},
    ]
    logs = []
    tok = data.load_tokenizer(TrainConfig())  # fresh: earlier tests gave the shared one the default template
    p = prep(
        tmp_path,
        tok,
        logs.append,
        dataset_name=str(write_jsonl(tmp_path / "chat.jsonl", [{"messages": conv}])),
        validation_split_percentage=0,
        packing=False,
    )
    assert any("default ChatML-style template" in m for m in logs)
    b = batch_of(p)
    ids, labels = b["input_ids"][0].tolist(), b["labels"][0].tolist()
    assert tok.decode(ids).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSay A.")
    assert labels_text(tok, ids, labels) == "A<|im_end|>\nB<|im_end|>\n<|endoftext|>"
    # a tokenizer with its own template is used as it is
    tok2 = data.load_tokenizer(TrainConfig())
    tok2.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    p = data.prepare(
        TrainConfig(
            dataset_name=str(tmp_path / "chat.jsonl"),
            validation_split_percentage=0,
            packing=False,
            cache_dir=str(tmp_path / "cache"),
        ),
        tok2,
        quiet,
    )
    b = batch_of(p)
    ids, labels = b["input_ids"][0].tolist(), b["labels"][0].tolist()
    # byte-level BPE merges the template's space into the answer's first token; a token that overlaps
    # the answer is trained, since predicting it means predicting the answer
    assert labels_text(tok2, ids, labels) == " A\n B\n<|endoftext|>"


def test_cleaning_steps_report_what_they_removed(tmp_path, tok):
    docs = [
        "<p>Hello <b>world</b> &amp; friends</p>",
        "spaced    out\n\n\n\ntext  ",
        "dup text here",
        "dup text here",
        "x",
        "A normal document with enough words in it.",
    ]
    path = write_jsonl(tmp_path / "noisy.jsonl", [{"text": t} for t in docs])
    logs = []
    p = prep(
        tmp_path,
        tok,
        logs.append,
        dataset_name=str(path),
        block_size=4,
        validation_split_percentage=0,
        strip_html=True,
        normalize_whitespace=True,
        dedupe=True,
        min_document_tokens=2,
    )
    line = next(m for m in logs if "documents" in m and "cached at" in m)
    assert "6 documents" in line
    assert "cleaning html: -" in line and "cleaning whitespace: -" in line
    assert "shorter than 2 tokens: -1 documents" in line
    assert "exact duplicates: -1 documents" in line
    stream = tok.decode(np.concatenate([t for i in range(len(p.train)) for t, _ in p.train.row(i)]))
    assert "<b>" not in stream and "Hello world & friends" in stream and "    " not in stream


def test_mixture_draws_each_dataset_by_weight(tmp_path, tok):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}?", "completion": " yes"} for i in range(90)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": f"b document {i} " * 5} for i in range(30)])
    mix = json.dumps([{"name": str(a), "weight": 0.25}, {"name": str(b), "weight": 0.75}])
    p = prep(tmp_path, tok, dataset_mixture=mix, block_size=8, validation_split_percentage=0, packing=False)
    shares = np.bincount(p.train.refs[:, 0]) / len(p.train)
    assert abs(shares[0] - 0.25) < 0.01 and abs(shares[1] - 0.75) < 0.01
    assert p.formats == ["prompt_completion", "text"]
    # a batch mixing SFT rows and text windows: padding of short rows is masked out
    batch = data.collate(
        [p.train.row(int(i)) for i in np.flatnonzero(p.train.refs[:, 0] == 0)[:2]]
        + [p.train.row(int(np.flatnonzero(p.train.refs[:, 0] == 1)[0]))],
        p.pad_id,
    )
    assert "attention_mask" in batch and batch["attention_mask"][2].all()


def test_eval_comes_from_its_own_split(tmp_path, tok):
    saved = tmp_path / "dd"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": TEXTS}),
            "validation": datasets.Dataset.from_dict({"text": TEXTS[:10]}),
        }
    ).save_to_disk(str(saved))
    p = prep(tmp_path, tok, dataset_name=str(saved), eval_split="validation", block_size=8)
    n_eval_tokens = sum(len(tok(t, add_special_tokens=False).input_ids) + 1 for t in TEXTS[:10])
    assert len(p.eval) == n_eval_tokens // 8
    n_train_tokens = sum(len(tok(t, add_special_tokens=False).input_ids) + 1 for t in TEXTS)
    assert len(p.train) == n_train_tokens // 8  # nothing held out of train
