"""The records behind a side-by-side page, and the page's rows: what both the HTML (page.py) and the judgments
read back from it (judgments.py) agree on, so a judgment's row number means the same prompt in both.

A record is one answer: {"prompt", "reference", "column", "output", "decoding", "ended"}. `ended` says whether
the answer stopped by itself (EOS or end of turn) rather than at max_new_tokens; None in records written before
it was kept.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from ..errors import ConfigError


class Answer(str):
    """A generated answer's text that also says whether it ended by itself. A str, so code and tests that
    compare answers as text keep doing so; records_of reads `ended` off it."""

    ended: bool | None

    def __new__(cls, text: str, ended: bool | None):
        answer = super().__new__(cls, text)
        answer.ended = ended
        return answer


def json_object(line: str, where: str) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not JSON ({e.msg}); write one JSON object a line") from None
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: a JSON {type(row).__name__}, not an object; write one object a line")
    return row


def records_of(prompts: list[dict], label: str, outputs: list[str], decoding) -> list[dict]:
    """`decoding`: a Decoding, its description (Decoding.describe(tokenizer), which names the prompt format
    the column's tokenizer gave), or {label: either} when columns differ. `outputs`: strings, or Answers that
    say whether they ended."""
    if len(outputs) != len(prompts):
        raise ValueError(f"column {label!r} has {len(outputs)} outputs for {len(prompts)} prompts")
    how = decoding.get(label, "") if isinstance(decoding, dict) else decoding
    how = how if isinstance(how, str) else how.describe()
    asked = [p if isinstance(p, dict) else {"prompt": p} for p in prompts]
    return [
        {
            "prompt": p["prompt"],
            "reference": p.get("reference"),
            "column": label,
            "output": str(o),
            "decoding": how,
            "ended": getattr(o, "ended", None),
        }
        for p, o in zip(asked, outputs)
    ]


def read_records(path) -> list[dict]:
    path = Path(path)
    records = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            r = json_object(line, f"{path}:{n}")
            missing = [k for k in ("prompt", "column", "output") if k not in r]
            if missing:
                raise ConfigError(f"{path}:{n}: a record without {', '.join(missing)}; delete {path} to start over")
            records.append(r)
    return records


def exact_match(output: str, reference: str | None) -> bool:
    return reference is not None and output.strip() == reference.strip()


def rows_of(records: list[dict]) -> tuple[list[dict], dict[str, str]]:
    """Rows (one per prompt, in order of first appearance) and columns (label -> decoding, the same order).
    A prompt asked twice is two rows: each column's k-th answer to it goes in the k-th such row. A row is
    {"prompt", "reference", "outputs": {label: text}, "ended": {label: bool | None}}; row numbers count from 1."""
    rows: dict[tuple[str, int], dict] = {}
    columns: dict[str, str] = {}
    asked: dict[tuple[str, str], int] = {}
    for r in records:
        label, key = str(r["column"]), json.dumps(r["prompt"], sort_keys=True)
        columns.setdefault(label, str(r.get("decoding") or ""))
        k = asked[label, key] = asked.get((label, key), -1) + 1
        row = rows.setdefault((key, k), {"prompt": r["prompt"], "reference": None, "outputs": {}, "ended": {}})
        row["reference"] = row["reference"] if row["reference"] is not None else r.get("reference")
        row["outputs"][label] = str(r["output"])
        row["ended"][label] = r.get("ended")
    return list(rows.values()), columns


def page_id(records: list[dict]) -> str:
    """The page's identity: its prompts, columns and answers. A judgment carries it, so one made on another
    page (other prompts, other models, or the same models' answers regenerated) is told apart."""
    content = [[r["prompt"], str(r["column"]), str(r["output"])] for r in records]
    return hashlib.sha256(json.dumps(content, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]


def blind_order(page: str, row: int, labels: list[str]) -> tuple[str, str]:
    """(left, right): the two columns of row `row` in the order a judge sees them, shuffled per row by a seed
    drawn from the page's identity, so the order is the same every time the page is rebuilt and neither model
    sits on one side throughout."""
    first, second = labels
    return (first, second) if random.Random(f"{page}:{row}").random() < 0.5 else (second, first)
