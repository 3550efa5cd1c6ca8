"""Cleaning as users run it: train.py's data preparation (prepared and streaming) and tools/clean_data.py, on
one small English + Chinese corpus with planted near-duplicates, garbled documents and mojibake. Both
paths must agree on every document, report what they removed, and keep the clean documents."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from cleaning_samples import CODE, EN, ZH
from helpers import tool_in_process
from zero_recipes import data
from zero_recipes.config.train_config import TrainConfig

CLEANING = dict(fix_text=True, drop_garbled=True, quality_filter="gopher", dedupe="near")
FLAGS = ["--fix_text", "true", "--drop_garbled", "true", "--quality_filter", "gopher", "--dedupe", "near"]


EN2 = (
    "Rain is expected to return on Thursday after a week of dry weather, the forecasters said, and the farmers "
    "in the valley will welcome it. The wheat was planted late this year because of the cold spring, and the "
    "young plants need water now more than at any other time.\n\n"
    "Some roads in the hills may flood if the storm is as strong as the models suggest. Drivers are asked to "
    "check the council’s page before they set out, and to keep away from the ford near the old mill."
)


def corpus() -> list[dict]:
    """Clean documents in two languages, and what cleaning must remove or repair: each row says which."""
    zh2 = ZH.replace("图书馆", "博物馆").replace("地图", "瓷器")  # another document, many shared phrases
    rows = [
        {"text": EN, "id": "en", "expect": "kept"},
        {"text": ZH, "id": "zh", "expect": "kept"},
        {"text": CODE, "id": "code", "expect": "kept"},
        {"text": EN2.encode("utf-8").decode("cp1252"), "id": "en-mojibake"},
        {"text": "Home | News\n\n" + EN.replace("forty", "fifty"), "id": "en-near"},
        {"text": ZH.replace("四十", "五十") + "\n\n分享到微信", "id": "zh-near"},
        {"text": EN.replace("a", "\ufffd"), "id": "garbled", "expect": "garbled: replacement characters"},
        {"text": ZH.encode("utf-8").decode("gbk", errors="ignore"), "id": "zh-gbk", "expect": "garbled: mojibake"},
        {"text": "买 买 买 " * 80, "id": "spam", "expect": "quality"},
        {"text": zh2, "id": "zh2", "expect": "kept"},
    ]
    rows[3]["expect"] = "kept"  # repaired by fix_text, and no longer a copy of anything
    rows[4]["expect"] = rows[5]["expect"] = "near duplicates"
    return rows


def write(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tok():
    return data.load_tokenizer(TrainConfig())


def test_train_py_preparation_drops_each_planted_document_and_logs_why(tmp_path, tok):
    rows = corpus()
    path = write(tmp_path / "raw.jsonl", rows)
    logs = []
    cfg = TrainConfig(
        dataset_name=str(path), cache_dir=str(tmp_path / "c"), validation_split_percentage=0, block_size=16, **CLEANING
    )
    prepared = data.prepare(cfg, tok, logs.append)
    line = next(m for m in logs if "cached at" in m)
    assert f"{len(rows)} documents" in line
    assert "garbled: replacement characters: -1 documents" in line
    assert "garbled: mojibake (rare Han characters): -1 documents" in line
    assert "quality: " in line and "near duplicates (similarity >= 0.7): -2 documents" in line
    stream = tok.decode(np.concatenate([t for i in range(len(prepared.train)) for t, _ in prepared.train.row(i)]))
    for r in rows:
        if r["expect"] != "near duplicates":  # those repeat a kept document but for their edits
            assert (r["text"][20:60] in stream) == (r["expect"] == "kept"), (r["id"], line)
    assert "Home | News" not in stream and "fifty seats" not in stream and "五十个座位" not in stream
    assert "council’s page" in stream and "â€" not in stream  # the mojibake, repaired and kept


def test_the_tool_writes_the_kept_rows_unchanged_and_a_report_with_examples(tmp_path):
    rows = corpus()
    raw, out = write(tmp_path / "raw.jsonl", rows), tmp_path / "clean.jsonl"
    proc = tool_in_process("clean_data", raw, "--output", out, *FLAGS)
    assert proc.returncode == 0, proc.stderr[-2000:]
    kept = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    assert [r["id"] for r in kept] == [r["id"] for r in rows if r["expect"] == "kept"]
    by_id = {r["id"]: r for r in rows}
    for r in kept:  # every field as it was, the text too unless fix_text repaired it
        assert r == by_id[r["id"]] or (r["id"] == "en-mojibake" and r["text"] != by_id[r["id"]]["text"])
    report = json.loads((tmp_path / "clean.report.json").read_text(encoding="utf-8"))
    assert report["documents"] == len(rows) and report["kept"] == len(kept) and report["edited"]["fix_text"] == 1
    near = report["removed"]["near duplicates (similarity >= 0.7)"]
    assert near["documents"] == 2
    pairs = {(e["index"], e["duplicate_of"]["index"]) for e in near["examples"]}
    assert pairs == {(4, 0), (5, 1)} and all(0.7 <= e["similarity"] <= 1 for e in near["examples"])
    assert report["removed"]["garbled: replacement characters"]["examples"][0]["index"] == 6
    assert "clean: 10 documents -> 5 kept" in proc.stdout and "removed, near duplicates" in proc.stdout
    removed = [json.loads(x) for x in (tmp_path / "clean.removed.jsonl").read_text(encoding="utf-8").splitlines()]
    assert {r["id"]: (r["removed_because"].split(":")[0], r["duplicate_of"]) for r in removed} == {
        "en-near": ("near duplicates (similarity >= 0.7)", 0),
        "zh-near": ("near duplicates (similarity >= 0.7)", 1),
        "garbled": ("garbled", -1),
        "zh-gbk": ("garbled", -1),
        "spam": ("quality", -1),
    }


def test_the_tool_and_train_py_agree_on_sft_data(tmp_path, tok):
    chats = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
        for q, a in [
            ("What does the exhibition show?", EN),
            ("展览展示了什么？", ZH),
            ("What does the exhibition show?", EN.replace("forty", "fifty")),  # a near-duplicate
            ("Say something", "\ufffd" * 30 + " ok"),  # garbled
        ]
    ]
    raw, out = write(tmp_path / "chat.jsonl", chats), tmp_path / "clean.jsonl"
    flags = ["--drop_garbled", "true", "--dedupe", "near"]
    assert tool_in_process("clean_data", raw, "--output", out, *flags).returncode == 0
    assert len(out.read_text().splitlines()) == 2
    logs = []
    cfg = TrainConfig(
        dataset_name=str(raw), cache_dir=str(tmp_path / "c"), validation_split_percentage=0, block_size=2048,
        drop_garbled=True, dedupe="near",
    )  # fmt: skip
    data.prepare(cfg, tok, logs.append)
    line = next(m for m in logs if "cached at" in m)
    assert "near duplicates (similarity >= 0.7): -1 documents" in line and "garbled: replacement" in line
    assert "2 train examples" in line, line


def test_streaming_skips_what_cleaning_drops_and_resumes_at_the_same_example(tmp_path, tok):
    rows = [r for r in corpus() if r["id"] not in ("en-near", "zh-near")]  # dedupe cannot stream
    path = write(tmp_path / "raw.jsonl", rows * 3)
    cfg = TrainConfig(
        dataset_name=str(path), cache_dir=str(tmp_path / "c"), streaming=True, max_steps=4, block_size=32,
        validation_split_percentage=0, per_device_train_batch_size=1, fix_text=True, drop_garbled=True,
        quality_filter="gopher",
    )  # fmt: skip
    stream = data.prepare_stream(cfg, tok, 0, 1, lambda *_: None).train
    text = tok.decode(np.concatenate([stream.next_batch()["input_ids"][0].numpy() for _ in range(60)]))
    assert "\ufffd" not in text and "买 买 买" not in text and "council’s page" in text
    assert set(stream.cleaned) == {"garbled: replacement characters", "garbled: mojibake (rare Han characters)"} | {
        k for k in stream.cleaned if k.startswith("quality:")
    }
    state = stream.state_dict()
    after = [stream.next_batch()["input_ids"].tolist() for _ in range(3)]
    again = data.prepare_stream(cfg, tok, 0, 1, lambda *_: None).train
    again.load_state_dict(state)
    assert [again.next_batch()["input_ids"].tolist() for _ in range(3)] == after


@pytest.mark.parametrize(
    "engine, says",
    [
        ("ray", "error: --executor ray needs Ray: pip install ray (or use --executor local)"),
        ("slurm", "error: --executor slurm needs Slurm's sbatch on PATH; run it on a cluster's login node"),
    ],
)
def test_an_executor_whose_engine_is_missing_is_one_line_and_writes_nothing(tmp_path, monkeypatch, engine, says):
    raw = write(tmp_path / "raw.jsonl", corpus())
    monkeypatch.setitem(sys.modules, "ray", None)  # how Python sees a package that is not installed
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    done = tool_in_process("clean_data", raw, "--output", tmp_path / "out", "--executor", engine, "--tasks", "2")
    assert done.returncode == 2 and done.stderr == says + "\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw.jsonl"]
