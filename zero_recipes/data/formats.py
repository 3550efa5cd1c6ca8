"""Turn one example of any supported format into token ids and a label mask.

Formats: `text` (pretraining), `prompt_completion`, `alpaca` (instruction/input/output) and `messages`
(chat with roles, through the tokenizer's chat template). SFT formats train only on the completion or
the assistant turns unless `train_on_prompt`. The mask is computed on characters and mapped to tokens
with the fast tokenizer's offsets, so the prompt/answer boundary is exact whatever the tokenizer merges.
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from ..errors import ConfigError
from . import cleaning
from .options import TokenizeOptions

REQUIRED_COLUMNS = {
    "text": None,
    "prompt_completion": ("prompt", "completion"),
    "alpaca": ("instruction", "output"),
    "messages": ("messages",),
}
# the columns whose words an SFT example is made of (what cleaning judges and compares)
CONTENT_COLUMNS = {"prompt_completion": ("prompt", "completion"), "alpaca": ("instruction", "input", "output")}
CONTENT_COLUMNS["messages"] = REQUIRED_COLUMNS["messages"]


def content_text(fmt: str, row: dict) -> str:
    return cleaning.example_text({c: row[c] for c in CONTENT_COLUMNS[fmt] if c in row})


CHAT_ROLES = ("system", "user", "assistant", "tool")

# Used when the tokenizer has no chat template (the embedded one has none). ChatML layout, in plain text
# so it needs no new special tokens; it is saved with the exported tokenizer, so generation uses it too.
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The Stanford Alpaca prompt, which alpaca-format datasets were written for.
ALPACA_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes "
    "the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)


def detect_format(requested: str, columns: list[str], text_column: str, name: str) -> tuple[str, str]:
    """Return (format, message). An explicit format is checked against the columns."""
    if requested != "auto":
        needed = REQUIRED_COLUMNS[requested] or (text_column,)
        missing = [c for c in needed if c not in columns]
        if missing:
            flag = " (or pass --text_column NAME)" if requested == "text" else ""
            raise ConfigError(
                f"dataset '{name}' has no column '{missing[0]}' needed by --dataset_format {requested} "
                f"(columns: {', '.join(columns)}){flag}"
            )
        return requested, f"format '{requested}' (as configured)"
    for fmt in ("messages", "prompt_completion", "alpaca"):
        if all(c in columns for c in REQUIRED_COLUMNS[fmt]):
            return fmt, f"detected format '{fmt}' from columns {', '.join(columns)}; set --dataset_format to choose"
    if text_column in columns:
        return "text", f"detected format 'text' (column '{text_column}'); set --dataset_format to choose"
    raise ConfigError(
        f"dataset '{name}' has no column '{text_column}' (columns: {', '.join(columns)}) and matches no "
        "SFT format (messages | prompt+completion | instruction+output); pass --text_column NAME or "
        "--dataset_format"
    )


def ensure_chat_template(tok, log) -> None:
    if not getattr(tok, "chat_template", None):
        tok.chat_template = DEFAULT_CHAT_TEMPLATE
        log("data: the tokenizer has no chat template; using the default ChatML-style template (see docs/data.md)")


# ---- rendering SFT examples to text and trainable character spans --------------------------------------


def render(fmt: str, row: dict, tok, index: int) -> tuple[str, list[tuple[int, int]]]:
    if fmt == "prompt_completion":
        prompt, completion = _str(row["prompt"]), _str(row["completion"])
        return prompt + completion, [(len(prompt), len(prompt) + len(completion))]
    if fmt == "alpaca":
        extra = _str(row.get("input"))
        prompt = (ALPACA_WITH_INPUT if extra.strip() else ALPACA_NO_INPUT).format(
            instruction=_str(row["instruction"]), input=extra
        )
        output = _str(row["output"])
        return prompt + output, [(len(prompt), len(prompt) + len(output))]
    return render_chat(row["messages"], tok, index)


def _str(value) -> str:
    return "" if value is None else str(value)


def check_example(fmt: str, row: dict, index: int) -> None:
    """What rendering an example refuses that needs no tokenizer (--dry_run reads a sample of rows with it)."""
    if fmt == "messages":
        check_messages(row["messages"], index)


def check_messages(messages, index: int) -> None:
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"example {index}: 'messages' must be a non-empty list of {{role, content}}")
    for m in messages:
        role = m.get("role") if isinstance(m, dict) else None
        if role not in CHAT_ROLES:
            raise ConfigError(
                f"example {index}: unknown chat role {role!r}; roles must be one of "
                f"{', '.join(CHAT_ROLES)} (map others, e.g. 'human' -> 'user', before training)"
            )


def render_chat(messages, tok, index: int) -> tuple[str, list[tuple[int, int]]]:
    """The chat template's text, and the character span of each assistant turn. The span is what the
    template adds for that turn beyond the generation prompt, so it includes the end-of-turn marker the
    model must learn to emit. Templates with `{% generation %}` are not needed for this."""
    check_messages(messages, index)
    text = tok.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        upto = tok.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (upto.startswith(before) and text.startswith(upto)):
            raise ConfigError(
                f"example {index}: the tokenizer's chat template does not render a conversation as a "
                "growing prefix, so assistant turns cannot be located; use --train_on_prompt true or a "
                "template without history rewriting"
            )
        spans.append((len(before), len(upto)))
    return text, spans


def token_mask(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for each token whose characters overlap a trainable span."""
    mask = np.zeros(len(offsets), dtype=np.uint8)
    if len(offsets) == 0:
        return mask
    start, end = offsets[:, 0], offsets[:, 1]
    for s, e in spans:
        mask |= ((end > s) & (start < e) & (end > start)).astype(np.uint8)
    return mask


class Tokenize:
    """A picklable batched map function (for `num_proc`). Each batch of examples becomes ONE output row of
    flat arrays: ids, per-example lengths, the label mask (SFT), and what cleaning needs. Returning a few
    large numpy arrays instead of a Python list per example is what makes the Arrow write cheap."""

    def __init__(self, tok, opts: TokenizeOptions):
        if opts.format not in REQUIRED_COLUMNS:  # "auto" is not a format to tokenise with
            raise ValueError(f"Tokenize needs a detected format, got {opts.format!r}; see DataOptions.resolved")
        self.tok, self.opts, self.fmt = tok, opts, opts.format
        self.cleaner = cleaning.Cleaner(opts)

    def _encode(self, texts) -> list[list[int]]:
        # encode_batch_fast skips the character offsets that only SFT masking needs (about 1.8x faster here)
        backend = getattr(self.tok, "backend_tokenizer", None)
        if backend is not None and hasattr(backend, "encode_batch_fast"):
            return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
        return self.tok(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]

    def __call__(self, batch, indices):
        out = self.text(batch) if self.fmt == "text" else self.sft(batch, indices)
        return {k: [v] for k, v in out.items()}

    def text(self, batch) -> dict:
        eos = self.tok.eos_token_id
        out = {}
        texts, steps = self.cleaner.edit([_str(t) for t in batch[self.opts.text_column]])
        for step, before, after, changed in steps:
            removed = np.zeros(len(texts), dtype=np.int64)
            if changed:
                removed[changed] = [
                    len(a) - len(b)
                    for a, b in zip(
                        self._encode([before[i] for i in changed]), self._encode([after[i] for i in changed])
                    )
                ]
            out[f"removed_{step}"] = removed
        ids = self._encode(texts)
        lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(
            chain.from_iterable(chain.from_iterable((x, (eos,)) for x in ids)), dtype=np.int32, count=int(lengths.sum())
        )
        out.update(ids=flat, lengths=lengths)
        out.update(self.flat_judgements(texts, texts))
        return out

    def flat_judgements(self, texts, contents) -> dict:
        out = self.cleaner.judge(texts, contents)
        if "minhash" in out:  # one flat array per batch, like the ids
            out["minhash"] = out["minhash"].reshape(-1)
        return out

    def sft(self, batch, indices) -> dict:
        eos = self.tok.eos_token_id
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        if self.opts.fix_text:
            rows = [cleaning.fix_strings(row) for row in rows]
        rendered = [render(self.fmt, row, self.tok, i + 1) for row, i in zip(rows, indices)]
        special = self.fmt != "messages"  # chat templates write their own BOS; plain prompts get the tokenizer's
        enc = self.tok(
            [t for t, _ in rendered],
            add_special_tokens=special,
            return_offsets_mapping=True,
            return_attention_mask=False,
        )
        all_ids, masks = [], []
        for ids, offsets, (text, spans) in zip(enc["input_ids"], enc["offset_mapping"], rendered):
            mask = token_mask(np.asarray(offsets, dtype=np.int64).reshape(-1, 2), spans)
            if self.opts.train_on_prompt:
                mask[:] = 1
            if not ids or ids[-1] != eos:  # every example ends in EOS, trained when the answer ends the text
                last_trained = bool(spans) and spans[-1][1] >= len(text.rstrip())
                ids = ids + [eos]
                mask = np.append(mask, np.uint8(1 if (self.opts.train_on_prompt or last_trained) else 0))
            all_ids.append(ids)
            masks.append(mask)
        out = {
            "ids": np.fromiter(chain.from_iterable(all_ids), dtype=np.int32),
            "lengths": np.array([len(x) for x in all_ids], dtype=np.int64),
            "mask": np.concatenate(masks) if masks else np.zeros(0, dtype=np.uint8),
        }
        out.update(self.flat_judgements([content_text(self.fmt, row) for row in rows], rows))
        return out


def split_examples(out: dict):
    """Undo the flat layout of one Tokenize row: yields (ids, mask or None, drop reason or '') per example."""
    ids, lengths, mask = out["ids"], out["lengths"], out.get("mask")
    drop = out.get("drop") or [""] * len(lengths)
    at = 0
    for n, why in zip(lengths, drop):
        yield ids[at : at + n], (None if mask is None else mask[at : at + n]), why
        at += n
