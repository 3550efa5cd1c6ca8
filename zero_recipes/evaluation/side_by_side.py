"""Side by side for people: the same prompts answered by several models, or by one model at several training
steps, as a JSONL of records and one self-contained HTML page to read them in.

    prompts = read_prompts("prompts.jsonl")                  # {"prompt" | "question" | "messages", "reference"?}
    outs = generate(model, tok, prompts, Decoding())         # greedy, the continuation only
    write_side_by_side("out/samples", prompts, {"base": a, "sft": b}, Decoding(), "base vs sft")
    append_column("run/samples", prompts, "step 200", outs, Decoding(), "tiny-sft")   # one column per eval

A record is one answer (sample_records.py). The page (page.py) is rebuilt from all of them, so a column added
later (the next eval step) lands beside the earlier ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from zero_recipes.checkpointing.atomic import write_text

from ..data.formats import CHAT_ROLES
from ..errors import ConfigError
from .page import write_page
from .sample_records import Answer, json_object, read_records, records_of

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
            prompts.append(_prompt_of(json_object(line, f"{path}:{n}"), f"{path}:{n}"))
    if not prompts:
        raise ConfigError(f'{path} holds no prompts; write one {{"prompt": ...}} object a line')
    return prompts


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


def generate(model, tokenizer, prompts, decoding: Decoding, synced: bool = False) -> list[Answer]:
    """Each prompt's continuation (the prompt itself left out), one prompt at a time so nothing is padded, as
    Answers: text that says whether it ended by itself or was cut at max_new_tokens.
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


def _generate_one(model, tok, prompt, decoding: Decoding, synced: bool, device) -> Answer:
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
    new_ids = out[0, enc.input_ids.shape[1] :]
    new = tok.decode(new_ids, skip_special_tokens=True)
    # ended: stopped before the limit, or on the limit's last token by EOS or the end of turn
    ended = len(new_ids) < decoding.max_new_tokens or int(new_ids[-1]) in (eos or []) or bool(stop and stop[0] in new)
    return Answer(new.split(END_OF_TURN)[0] if stop else new, ended)


# ---- the records and the page ----------------------------------------------------------------------------


def write_side_by_side(out_stem, prompts: list[dict], columns: dict, decoding, title: str, judging=False) -> Path:
    """OUT.jsonl and OUT.html from scratch, one column per entry of `columns` (label -> outputs). The page;
    `judging`: two models a person judges blind on it (page.py)."""
    records = [r for label, outs in columns.items() for r in records_of(prompts, label, outs, decoding)]
    jsonl, page = _paths(out_stem)
    write_text(jsonl, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    write_page(page, records, title, judging)
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
