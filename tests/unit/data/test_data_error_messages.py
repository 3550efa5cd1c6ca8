"""Bad data gets one line naming the problem and the fix, and a non-zero exit with nothing written."""

import json

import pytest

from zero_recipes import data
from zero_recipes.config.train_config import ConfigError, TrainConfig


@pytest.fixture(scope="module")
def tok():
    return data.load_tokenizer(TrainConfig())


def write(path, text):
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


def prepare(tmp_path, tok, **kw):
    return data.prepare(
        TrainConfig(cache_dir=str(tmp_path / "cache"), validation_split_percentage=0, **kw), tok, lambda *_: None
    )


def test_each_bad_input_names_the_problem(tmp_path, tok):
    long_answer = " ".join(["word"] * 300)
    cases = [
        (
            dict(dataset_name=write(tmp_path / "cols.jsonl", '{"body": "x"}\n')),
            r"has no column 'text' \(columns: body\).*--text_column",
        ),
        (
            dict(dataset_name=write(tmp_path / "pc.jsonl", '{"prompt": "x"}\n'), dataset_format="prompt_completion"),
            r"has no column 'completion' needed by --dataset_format prompt_completion",
        ),
        (dict(dataset_name=write(tmp_path / "empty.jsonl", "")), r"empty"),
        (
            dict(dataset_name=write(tmp_path / "short.jsonl", '{"text": "a"}\n{"text": "b"}\n'), min_document_tokens=5),
            r"empty after filtering: 2 documents, shorter than 5 tokens: -2 documents",
        ),
        (
            dict(
                dataset_name=write(
                    tmp_path / "long.jsonl", json.dumps({"prompt": "q", "completion": long_answer}) + "\n"
                ),
                block_size=64,
            ),
            r"all 1 examples are longer than block_size 64 tokens \(longest \d+\); raise --block_size",
        ),
        (
            dict(dataset_name=write(tmp_path / "latin1.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n')),
            r"latin1.jsonl:2: not UTF-8 .*re-encode",
        ),
        (
            dict(dataset_name=write(tmp_path / "bad.jsonl", '{"text": "a"}\n{"text": "b"}\n{"text": "c"\n')),
            r"bad.jsonl:3:\d+: not valid JSON lines",
        ),
        (
            dict(
                dataset_name=write(
                    tmp_path / "role.jsonl",
                    json.dumps(
                        {"messages": [{"role": "human", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
                    )
                    + "\n",
                )
            ),
            r"example 1: unknown chat role 'human'; roles must be one of system, user, assistant, tool",
        ),
        (
            dict(
                dataset_mixture=[
                    {"name": "builtin:tiny-instructions", "weight": 0.5},
                    {"name": "builtin:python-docstrings", "weight": 0.4},
                ]
            ),
            r"weights add up to 0.9, not 1",
        ),
        (
            dict(dataset_mixture=[{"name": "builtin:tiny-instructions", "wieght": 1.0}]),
            r"must be a mapping with at least name and weight",
        ),
        (dict(dataset_name="builtin:nothing"), r"unknown embedded dataset"),
    ]
    for kwargs, pattern in cases:
        with pytest.raises(ConfigError, match=pattern):
            prepare(tmp_path, tok, **kwargs)
