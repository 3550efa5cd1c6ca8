"""Loaders for the shipped tasks' data (lm-eval's `custom_dataset`): the JSONL files next to this module, found
from here so `lm_eval --include_path eval_tasks` works from any directory (a relative `data_files` path would
be read from the current one). The files are built by `python -m zero_recipes.evaluation.shipped_tasks`."""

from pathlib import Path

HERE = Path(__file__).resolve().parent / "data"


def _load(name):
    from datasets import load_dataset

    return load_dataset("json", data_files={"test": str(HERE / f"{name}.jsonl")})


def docstring_cloze(**_):
    return _load("docstring_cloze")


def tiny_instructions(**_):
    return _load("tiny_instructions")
