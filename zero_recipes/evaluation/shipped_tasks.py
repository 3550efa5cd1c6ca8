"""The data of the lm-eval tasks shipped in eval_tasks/, built from what the project makes offline, so the quick
start's model and tiny-sft's can be evaluated with no hub:

- `docstring_cloze` (multiple choice): the start of a docstring the quick start held out of its training,
  and four continuations, one its own and three taken from other held-out docstrings. A pretrained model
  that learned its corpus picks its own above chance (25 %).
- `tiny_instructions` (generation, exact match): the questions recipes/tiny-sft.yaml holds out of
  builtin:tiny-instructions, answered greedily until the end of the assistant's turn.

Both come from `data.preparation.held_out_examples`, the same split a run's eval loss and exact match use:

    python -m zero_recipes.evaluation.shipped_tasks     # rewrites eval_tasks/data/*.jsonl

A test rebuilds them and compares (tests/integration/evaluation/test_evaluate.py).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TASKS_DIR = REPO / "eval_tasks"
"""Shipped task YAMLs; tools/evaluate.py and --eval_tasks always include it (lm_eval's --include_path)."""
DATA = TASKS_DIR / "data"

CLOZE_CONTEXT_WORDS = 16
CLOZE_CHOICE_WORDS = 8
CLOZE_ITEMS = 200


def quick_start_config():
    """The quick start's data settings (train.py with no recipe): the embedded corpus, its split and seed."""
    from zero_recipes.config.cli import parse_args

    return parse_args(["--deepspeed", str(REPO / "ds_configs" / "zero3.json")])[0]


def tiny_sft_config():
    import dataclasses

    from zero_recipes.config.cli import parse_args

    # the recipe's model is the quick start's export; its tokenizer is the embedded one, saved there unchanged
    cfg = parse_args(["--recipe", str(REPO / "recipes" / "tiny-sft.yaml")])[0]
    return dataclasses.replace(cfg, model_name_or_path=None)


def docstring_cloze(docs: list[str], seed: int = 0) -> list[dict]:
    """Items from held-out docstrings: the first CLOZE_CONTEXT_WORDS words, then CLOZE_CHOICE_WORDS words of
    each choice. Docstrings too short for both are skipped; distractors come from other items, seeded."""
    pieces = []
    for doc in docs:
        words = doc.split()
        if len(words) >= CLOZE_CONTEXT_WORDS + CLOZE_CHOICE_WORDS:
            end = CLOZE_CONTEXT_WORDS + CLOZE_CHOICE_WORDS
            pieces.append((" ".join(words[:CLOZE_CONTEXT_WORDS]), " ".join(words[CLOZE_CONTEXT_WORDS:end])))
    rng = random.Random(seed)
    items = []
    for k, (context, own) in enumerate(pieces[:CLOZE_ITEMS]):
        others = [pieces[j][1] for j in rng.sample(range(len(pieces)), 4) if j != k][:3]
        choices = others + [own]
        rng.shuffle(choices)
        items.append({"context": context, "choices": choices, "gold": choices.index(own)})
    return items


def tiny_instructions(rows) -> list[dict]:
    """One item per held-out chat example: the question, and the answer exact match compares against."""
    items = []
    for row in rows:
        user = next(m["content"] for m in row["messages"] if m["role"] == "user")
        answer = next(m["content"] for m in row["messages"] if m["role"] == "assistant")
        items.append({"question": user, "answer": answer})
    return items


def build() -> dict[str, list[dict]]:
    from zero_recipes.data.preparation import held_out_examples

    from ..data import load_tokenizer

    cfg = quick_start_config()
    docs = held_out_examples(cfg, load_tokenizer(cfg))[0]["text"]
    sft = tiny_sft_config()
    rows = held_out_examples(sft, load_tokenizer(sft))[0]
    return {"docstring_cloze": docstring_cloze(docs), "tiny_instructions": tiny_instructions(rows)}


def write(items: dict[str, list[dict]], where: Path = DATA) -> None:
    where.mkdir(parents=True, exist_ok=True)
    for name, rows in items.items():
        (where / f"{name}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


if __name__ == "__main__":
    built = build()
    write(built)
    print(", ".join(f"{name}: {len(rows)} items" for name, rows in built.items()), file=sys.stderr)
