"""Side by side for people: the same prompts answered by several models, or by one model at several training
steps, as a JSONL of records and one self-contained HTML page to read them in.

    prompts = read_prompts("prompts.jsonl")                  # {"prompt" | "question" | "messages", "reference"?}
    outs = generate(model, tok, prompts, Decoding())         # greedy, the continuation only
    write_side_by_side("out/samples", prompts, {"base": a, "sft": b}, Decoding(), "base vs sft")
    append_column("run/samples", prompts, "step 200", outs, Decoding(), "tiny-sft")   # one column per eval

A record is one answer: {"prompt", "reference", "column", "output", "decoding"}. The page is rebuilt from
all of them, so a column added later (the next eval step) lands beside the earlier ones.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from pathlib import Path

from zero_recipes.checkpointing.atomic import write_text

from ..data.formats import CHAT_ROLES
from ..errors import ConfigError

# The default ChatML-style template (data/formats.py) writes its end of turn as plain text, not a special
# token, so EOS alone does not end an answer: the text is cut here too.
END_OF_TURN = "<|im_end|>"


@dataclass(frozen=True)
class Decoding:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    chat_template: bool = True  # the tokenizer's chat template, where it has one

    def describe(self, tokenizer=None) -> str:
        """One line for the page: how every answer in a column was produced. Given the column's tokenizer it
        says which prompt the model got, since a base model's tokenizer often has no chat template."""
        how = "greedy" if self.temperature == 0 else f"sampled at temperature {self.temperature:g}"
        if self.temperature > 0:
            how += (f", top-p {self.top_p:g}" if self.top_p < 1 else "") + f", seed {self.seed}"
        prompt = "chat template if the tokenizer has one" if self.chat_template else "raw text"
        if self.chat_template and tokenizer is not None:
            has = getattr(tokenizer, "chat_template", None)
            prompt = "chat template" if has else "raw text (the tokenizer has no chat template)"
        return f"{how}, at most {self.max_new_tokens} new tokens, {prompt}"

    def check(self) -> None:
        if self.max_new_tokens < 1 or self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(
                f"bad decoding (max_new_tokens {self.max_new_tokens}, temperature {self.temperature}, top_p "
                f"{self.top_p}); need max_new_tokens >= 1, temperature >= 0 (0 = greedy) and 0 < top_p <= 1"
            )


# ---- prompts ---------------------------------------------------------------------------------------------

PROMPT_KEYS = ("prompt", "question", "messages")
REFERENCE_KEYS = ("reference", "answer")


def read_prompts(path) -> list[dict]:
    """A JSONL file, one prompt a line, as [{"prompt": str | messages, "reference": str | None}]. A chat that
    ends with an assistant turn is asked without it, and that turn is its reference (unless one is given)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f'{path}: no such file; give a JSONL file with one {{"prompt": ...}} object a line')
    prompts = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            prompts.append(_prompt_of(_json_object(line, f"{path}:{n}"), f"{path}:{n}"))
    if not prompts:
        raise ConfigError(f'{path} holds no prompts; write one {{"prompt": ...}} object a line')
    return prompts


def _json_object(line: str, where: str) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not JSON ({e.msg}); write one JSON object a line") from None
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: a JSON {type(row).__name__}, not an object; write one object a line")
    return row


def _prompt_of(row: dict, where: str) -> dict:
    key = next((k for k in PROMPT_KEYS if k in row), None)
    if key is None:
        raise ConfigError(
            f"{where}: no prompt (keys: {', '.join(row) or 'none'}); give it as 'prompt', 'question' or 'messages'"
        )
    ref_key = next((k for k in REFERENCE_KEYS if row.get(k) is not None), None)
    reference = row[ref_key] if ref_key else None
    if isinstance(reference, (int, float)) and not isinstance(reference, bool):
        reference = str(reference)  # {"answer": 42}: the text a model would write
    if reference is not None and not isinstance(reference, str):
        raise ConfigError(f"{where}: '{ref_key}' must be a string; write the reference answer as text")
    prompt = row[key]
    if key == "messages":
        _check_messages(prompt, where)
        if prompt[-1]["role"] == "assistant":
            prompt, reference = prompt[:-1], reference if reference is not None else prompt[-1]["content"]
        if not prompt:
            raise ConfigError(f"{where}: 'messages' has only the assistant's answer; add the user turn before it")
    elif not isinstance(prompt, str) or not prompt.strip():
        raise ConfigError(f"{where}: '{key}' must be non-empty text; write the question as a string")
    return {"prompt": prompt, "reference": reference}


def _check_messages(messages, where: str) -> None:
    ok = isinstance(messages, list) and bool(messages)
    for m in messages if ok else []:
        ok = ok and isinstance(m, dict) and m.get("role") in CHAT_ROLES and isinstance(m.get("content"), str)
    if not ok:
        raise ConfigError(
            f'{where}: \'messages\' must be a non-empty list of {{"role", "content"}} with roles '
            f"{', '.join(CHAT_ROLES)}"
        )


# ---- generation ------------------------------------------------------------------------------------------


def render_prompt(tok, prompt, use_template: bool) -> tuple[str, bool]:
    """(the text fed to the model, whether the chat template made it). A str is one user message; a chat asks
    for its next assistant turn, so a trailing assistant turn (a reference left on it) is left out."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if messages and messages[-1]["role"] == "assistant":  # a chat passed whole: ask for that last answer
        messages = messages[:-1]
    if use_template and getattr(tok, "chat_template", None):
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), True
    return "\n\n".join(m["content"] for m in messages), False


def stop_ids(tok, model) -> list[int]:
    """The tokenizer's EOS, plus the generation config's EOS ids that are special tokens (e.g. an instruct
    model's end-of-turn). A config EOS that is an ordinary token is left out: models exported before train.py
    took bos/eos from the tokenizer say 2, which the embedded tokenizer uses for '"', and stopping there would
    cut answers at the first quote."""
    ids = [tok.eos_token_id] if tok.eos_token_id is not None else []
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for i in config_eos if isinstance(config_eos, list) else [config_eos]:
        if i is not None and i in tok.all_special_ids and i not in ids:
            ids.append(i)
    return ids


def generate(model, tokenizer, prompts, decoding: Decoding, synced: bool = False) -> list[str]:
    """Each prompt's continuation (the prompt itself left out), one prompt at a time so nothing is padded.
    `prompts`: read_prompts' dicts, or str / chat lists. A plain HF causal LM or a peft PeftModel, on whatever
    device it is on. synced=True under ZeRO-3: every rank must pass the same number of prompts, since each
    forward gathers the weights from all ranks. The caller's RNG state and train mode are left as they were,
    so samples taken during training do not change the training that follows."""
    import torch

    decoding.check()
    device = next(model.parameters()).device
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):
            return [_generate_one(model, tokenizer, p, decoding, synced, device) for p in prompts]
    finally:
        model.train(was_training)


def _generate_one(model, tok, prompt, decoding: Decoding, synced: bool, device) -> str:
    import torch

    prompt = prompt["prompt"] if isinstance(prompt, dict) else prompt
    text, templated = render_prompt(tok, prompt, decoding.chat_template)
    # a chat template writes its own BOS if it wants one; raw text gets the tokenizer's usual specials
    enc = tok(text, return_tensors="pt", add_special_tokens=not templated).to(device)
    if enc.input_ids.shape[1] == 0:
        raise ConfigError("a prompt is empty; give every prompt some text")
    # cut at the end of the turn when the prompt is in the ChatML-style template (rendered here, or already
    # rendered: training's held-out rows are decoded with their template)
    stop = [END_OF_TURN] if END_OF_TURN in text else None
    sampling = (
        dict(do_sample=True, temperature=decoding.temperature, top_p=decoding.top_p, top_k=0)
        if decoding.temperature > 0
        else dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    )
    eos = stop_ids(tok, model) or None
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0] if eos else None
    torch.manual_seed(decoding.seed)  # per prompt: an answer does not depend on the prompts before it
    out = model.generate(
        **enc,
        max_new_tokens=decoding.max_new_tokens,
        eos_token_id=eos,
        pad_token_id=pad,
        stop_strings=stop,
        tokenizer=tok if stop else None,
        synced_gpus=synced,
        **sampling,
    )
    new = tok.decode(out[0, enc.input_ids.shape[1] :], skip_special_tokens=True)
    return new.split(END_OF_TURN)[0] if stop else new


# ---- records and the page --------------------------------------------------------------------------------


def records_of(prompts: list[dict], label: str, outputs: list[str], decoding) -> list[dict]:
    """`decoding`: a Decoding, its description (Decoding.describe(tokenizer), which names the prompt format
    the column's tokenizer gave), or {label: either} when columns differ."""
    if len(outputs) != len(prompts):
        raise ValueError(f"column {label!r} has {len(outputs)} outputs for {len(prompts)} prompts")
    how = decoding.get(label, "") if isinstance(decoding, dict) else decoding
    how = how if isinstance(how, str) else how.describe()
    asked = [p if isinstance(p, dict) else {"prompt": p} for p in prompts]
    return [
        {"prompt": p["prompt"], "reference": p.get("reference"), "column": label, "output": o, "decoding": how}
        for p, o in zip(asked, outputs)
    ]


def read_records(path) -> list[dict]:
    path = Path(path)
    records = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            r = _json_object(line, f"{path}:{n}")
            missing = [k for k in ("prompt", "column", "output") if k not in r]
            if missing:
                raise ConfigError(f"{path}:{n}: a record without {', '.join(missing)}; delete {path} to start over")
            records.append(r)
    return records


def write_side_by_side(out_stem, prompts: list[dict], columns: dict, decoding, title: str) -> Path:
    """OUT.jsonl and OUT.html from scratch, one column per entry of `columns` (label -> outputs). The page."""
    records = [r for label, outs in columns.items() for r in records_of(prompts, label, outs, decoding)]
    jsonl, page = _paths(out_stem)
    write_text(jsonl, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    write_page(page, records, title)
    return page


def append_column(out_stem, prompts: list[dict], label: str, outputs: list[str], decoding, title: str) -> Path:
    """Add one column to OUT.jsonl (made if absent) and rebuild OUT.html from all of it. A column of the same
    label is replaced: a resumed run that evaluates step 200 again gets one step 200, the new one."""
    jsonl, page = _paths(out_stem)
    kept = [r for r in read_records(jsonl) if r["column"] != label] if jsonl.exists() else []
    records = kept + records_of(prompts, label, outputs, decoding)
    # rewritten whole through a temporary file, not appended: a run killed mid-write leaves the old file
    write_text(jsonl, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    write_page(page, records, title)
    return page


def _paths(out_stem) -> tuple[Path, Path]:
    stem = str(out_stem)  # not with_suffix: a stem may hold dots ("samples.v2")
    return Path(stem + ".jsonl"), Path(stem + ".html")


def exact_match(output: str, reference: str | None) -> bool:
    return reference is not None and output.strip() == reference.strip()


def _table(records: list[dict]) -> tuple[list[dict], dict[str, str]]:
    """Rows (one per prompt, in order of first appearance) and columns (label -> decoding, the same order).
    A prompt asked twice is two rows: each column's k-th answer to it goes in the k-th such row."""
    rows: dict[tuple[str, int], dict] = {}
    columns: dict[str, str] = {}
    asked: dict[tuple[str, str], int] = {}
    for r in records:
        label, key = str(r["column"]), json.dumps(r["prompt"], sort_keys=True)
        columns.setdefault(label, str(r.get("decoding") or ""))
        k = asked[label, key] = asked.get((label, key), -1) + 1
        row = rows.setdefault((key, k), {"prompt": r["prompt"], "reference": None, "outputs": {}})
        row["reference"] = row["reference"] if row["reference"] is not None else r.get("reference")
        row["outputs"][label] = str(r["output"])
    return list(rows.values()), columns


def write_page(html_path, records: list[dict], title: str) -> None:
    """The page: a header (the title, each column's decoding and exact matches), then one row per prompt with
    its reference and each column's answer. Everything escaped, no scripts and nothing fetched: it opens
    from a copied file or a CI artifact as it is."""
    rows, columns = _table(records)
    with_ref = any(row["reference"] is not None for row in rows)
    counts = {}
    for label in columns:
        judged = [row for row in rows if row["reference"] is not None and label in row["outputs"]]
        counts[label] = (sum(exact_match(row["outputs"][label], row["reference"]) for row in judged), len(judged))
    e = html.escape
    legend = "".join(
        f"<tr><th>{e(label)}</th><td>{e(how)}</td>"
        + (f"<td>{counts[label][0]} / {counts[label][1]} exact</td>" if with_ref else "")
        + "</tr>"
        for label, how in columns.items()
    )
    head = "<th class=n>#</th><th>Prompt</th>" + ("<th>Reference</th>" if with_ref else "")
    for label in columns:
        hit, of = counts[label]
        head += (
            f"<th>{e(label)}" + (f"<span class=count><b>✓</b> {hit} / {of} exact</span>" if with_ref else "") + "</th>"
        )
    body = "".join(_row(i, row, columns, with_ref) for i, row in enumerate(rows, 1))
    share = "auto" if not columns else f"{(100 - PROMPT_PCT - (REF_PCT if with_ref else 0)) / len(columns):.2f}%"
    cols = f"<col style='width:3em'><col style='width:{PROMPT_PCT}%'>"
    cols += (f"<col style='width:{REF_PCT}%'>" if with_ref else "") + f"<col style='width:{share}'>" * len(columns)
    # past a few columns the table scrolls sideways rather than squeezing each answer into a sliver
    wide = 360 + 160 * with_ref + 220 * len(columns)
    what = f"{len(rows)} prompts, {len(columns)} column{'s' * (len(columns) != 1)}"
    mark = "; ✓ marks an answer equal to the reference (surrounding whitespace ignored)" if with_ref else ""
    write_text(
        Path(html_path),
        f"<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8><title>{e(title)}</title>"
        f"<style>{CSS}</style></head><body><header><h1>{e(title)}</h1><p class=meta>{what}{mark}</p>"
        f"<table class=legend>{legend}</table></header><table class=samples style='min-width:{wide}px'><colgroup>{cols}</colgroup>"
        f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></body></html>\n",
    )


PROMPT_PCT, REF_PCT = 24, 12


def _row(i: int, row: dict, columns: dict, with_ref: bool) -> str:
    ref = row["reference"]
    cells = f"<td class=n>{i}</td><td>{_prompt_html(row['prompt'])}</td>"
    if with_ref:
        cells += f"<td class=ref>{_text(ref) if ref is not None else '<span class=none>none</span>'}</td>"
    for label in columns:
        out = row["outputs"].get(label)
        if out is None:
            cells += "<td class=out><span class=none>not asked</span></td>"
        elif exact_match(out, ref):
            cells += f"<td class='out match'>{_text(out)}<span class=mark>✓ exact match</span></td>"
        else:
            cells += f"<td class=out>{_text(out) if out.strip() else '<span class=none>(empty)</span>'}</td>"
    return f"<tr>{cells}</tr>"


def _text(s: str) -> str:
    return f"<div class=text>{html.escape(s)}</div>"


def _prompt_html(prompt) -> str:
    if isinstance(prompt, str):
        return _text(prompt)
    if len(prompt) == 1 and prompt[0].get("role") == "user":  # a one-message chat reads as a plain question
        return _text(str(prompt[0].get("content", "")))
    return "".join(
        f"<div class=msg><span class=role>{html.escape(str(m.get('role', '')))}</span>"
        f"{_text(str(m.get('content', '')))}</div>"
        for m in prompt
    )


CSS = """
body{margin:28px 32px;font:14px/1.5 "DejaVu Sans","Segoe UI",system-ui,sans-serif;color:#1f2328;background:#fff}
h1{font-size:21px;margin:0 0 2px}.meta{color:#59636e;margin:0 0 12px}table{border-collapse:collapse}
.legend{margin:0 0 20px;font-size:13px}
.legend th,.legend td{padding:2px 18px 2px 0;text-align:left;vertical-align:top}.legend td{color:#59636e}
.samples{width:100%;table-layout:fixed}
.samples th,.samples td{padding:9px 12px;text-align:left;vertical-align:top;border-bottom:1px solid #d8dee4}
.samples th{position:sticky;top:0;background:#f6f8fa;border-bottom:2px solid #d0d7de;font-weight:600}
.samples tbody tr:nth-child(even) td{background:#fafbfc}
.n{color:#8c959f;text-align:right!important;font-variant-numeric:tabular-nums}
.count{display:block;font-weight:400;font-size:12px;color:#59636e}.count b{color:#1a7f37}
.text{white-space:pre-wrap;overflow-wrap:anywhere}
.out .text,.ref .text{font:13px/1.5 "DejaVu Sans Mono",ui-monospace,monospace}.ref .text{color:#0a3069}
.samples td.match{box-shadow:inset 4px 0 0 #1a7f37;background:#eefbf1!important}
.mark{display:inline-block;margin-top:4px;font-size:12px;font-weight:600;color:#1a7f37}.msg+.msg{margin-top:6px}
.role{display:block;font-size:11px;text-transform:uppercase;letter-spacing:.04em;color:#6e7781}
.none{color:#8c959f;font-style:italic}
"""
