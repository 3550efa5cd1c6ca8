"""Preference pairs from a file: which format its columns are (`detect`), each row in TRL's form (`as_trl`), and
its tokens exactly as TRL 1.16's `DPOTrainer._prepare_dataset` makes them (`TokenizePairs`), so a file gives the
same ids here as in TRL and a recipe can be checked against it.

Formats: TRL's explicit prompt (`prompt`, `chosen`, `rejected`, as text or as message lists); TRL's implicit
prompt (`chosen`, `rejected` only: the prompt is what the two share, as TRL's `extract_prompt` takes it); and
LLaMA-Factory's ranking sets (alpaca: `instruction`/`input`/`chosen`/`rejected`, optional `system`/`history`;
sharegpt: `conversations` + `chosen`/`rejected` messages in `from`/`value`), read into TRL's conversational form.

Where this parts from TRL, on purpose: what TRL warns about or lets through and then trains wrongly is refused in
one line (a chat template that renders the prompt alone differently from the start of the conversation; chosen
identical to rejected; implicit prompts that differ between the two sides); `keep_end` is refused (one prompt is
shared by both answers here); a BOS the text already starts with is not doubled; a pair with an empty prompt or
answer is dropped (counted, not trained). Truncation is TRL's `keep_start`, applied here instead of in the
collator, so the stored ids are exactly what trains.
"""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import numpy as np

from ..errors import ConfigError

# the columns that name each format, tried in this order (LLaMA-Factory's before TRL's, which they contain)
FORMATS = {
    "sharegpt_ranking": ("conversations", "chosen", "rejected"),
    "alpaca_ranking": ("instruction", "chosen", "rejected"),
    "explicit": ("prompt", "chosen", "rejected"),
    "implicit": ("chosen", "rejected"),
}
HOW = {
    "sharegpt_ranking": "LLaMA-Factory's sharegpt ranking format, read as TRL's conversational pairs",
    "alpaca_ranking": "LLaMA-Factory's alpaca ranking format, read as TRL's conversational pairs",
    "explicit": "TRL's preference format with an explicit prompt",
    "implicit": "TRL's preference format with an implicit prompt (what chosen and rejected share)",
}
TRUNCATION_MODES = ("keep_start",)
CHAT_ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant", "observation": "tool"}
SAMPLE_ROWS = 16


def detect(columns: list[str], name: str) -> tuple[str, str]:
    """(format, the line the log gives it) from a dataset's columns."""
    for fmt, needed in FORMATS.items():
        if all(c in columns for c in needed):
            return fmt, f"detected {HOW[fmt]} from columns {', '.join(columns)}"
    missing = "chosen" if "chosen" not in columns else "rejected"
    raise ConfigError(
        f"dataset '{name}' has no '{missing}' column (columns: {', '.join(columns)}); a preference set needs "
        "prompt/chosen/rejected (TRL's format; without prompt, chosen and rejected are whole conversations that "
        "share it; or LLaMA-Factory's instruction or conversations with chosen/rejected): rename its columns"
    )


def check_truncation(max_length, truncation_mode: str) -> None:
    if truncation_mode == "keep_end":
        raise ConfigError(
            "--truncation_mode keep_end: each pair shares one prompt between its two answers, and cutting "
            "prompt+answer from the left would cut the prompt differently per answer; use keep_start (the answers "
            "lose their ends) and raise --max_length"
        )
    if truncation_mode not in TRUNCATION_MODES:
        raise ConfigError(f"--truncation_mode {truncation_mode!r} is not one of {', '.join(TRUNCATION_MODES)}")
    if max_length is not None and max_length < 2:
        raise ConfigError(f"--max_length {max_length} leaves no room for a prompt and an answer; give >= 2 or none")


# ---- a row in TRL's form ---------------------------------------------------------------------------------


def is_chat(value) -> bool:
    """TRL's test (data_utils.is_conversational): a list whose first item is a message with a role."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


def as_trl(fmt: str, row: dict, index: int) -> dict:
    """One row as TRL's {prompt, chosen, rejected}: three strings or three message lists (plus the row's
    `tools` / `chat_template_kwargs`, which TRL hands to the chat template). `index` is 1-based, for messages."""
    if fmt == "alpaca_ranking":
        pair = from_alpaca(row, index)
    elif fmt == "sharegpt_ranking":
        pair = from_sharegpt(row, index)
    elif fmt == "explicit" and not (isinstance(row["prompt"], str) and is_chat(row["chosen"])):
        pair = {"prompt": row["prompt"], "chosen": row["chosen"], "rejected": row["rejected"]}
    else:  # implicit; or a text prompt beside whole conversations (HuggingFaceH4/ultrafeedback_binarized), which
        # TRL's maybe_extract_prompt also reads as implicit
        pair = {"prompt": "", "chosen": row["chosen"], "rejected": row["rejected"]}
        if kind(row["chosen"], "chosen", index) == kind(row["rejected"], "rejected", index):
            pair = split_prompt(row["chosen"], row["rejected"], index)
    kinds = {k: kind(pair[k], k, index) for k in ("prompt", "chosen", "rejected")}
    if len(set(kinds.values())) > 1:
        raise ConfigError(
            f"example {index}: {', '.join(f'{k} is {v}' for k, v in kinds.items())}; give all three as text or "
            "all three as message lists"
        )
    if pair["chosen"] == pair["rejected"] and not empty(pair["chosen"]):
        raise ConfigError(
            f"example {index}: chosen and rejected are identical, so the pair teaches nothing; fix or remove it"
        )
    for key in ("tools", "chat_template_kwargs"):
        if row.get(key) is not None:
            pair[key] = row[key]
    return pair


def kind(value, key: str, index: int) -> str:
    if isinstance(value, str):
        return "text"
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        for m in value:
            if m.get("role") not in CHAT_ROLES:
                raise ConfigError(
                    f"example {index}: unknown chat role {m.get('role')!r} in '{key}'; roles must be one of "
                    f"{', '.join(CHAT_ROLES)}"
                )
        return "messages"
    raise ConfigError(
        f"example {index}: '{key}' is neither text nor a list of {{role, content}} messages: {value!r:.80}"
    )


def empty(value) -> bool:
    if isinstance(value, str):
        return not value.strip()
    return not any(str(m.get("content") or "").strip() or m.get("tool_calls") for m in value)


def split_prompt(chosen, rejected, index: int) -> dict:
    """TRL's `extract_prompt`: the prompt is the longest start chosen and rejected share (characters for text,
    messages for conversations); a space just before the split goes to the answers. Where TRL would return a
    nonsense split (nothing shared, one side the start of the other, conversations that part before an
    assistant turn) this refuses."""
    if chosen == rejected:
        return {"prompt": chosen, "chosen": chosen, "rejected": rejected}  # as_trl refuses it, by name
    at = 0
    for a, b in zip(chosen, rejected):
        if a != b:
            break
        at += 1
    fix = "give the prompt as its own 'prompt' column"
    if at == 0:
        raise ConfigError(
            f"example {index}: chosen and rejected differ from their first {unit(chosen)}, so they share no prompt; {fix}"
        )
    if at == min(len(chosen), len(rejected)):
        raise ConfigError(
            f"example {index}: one of chosen and rejected is the start of the other, so no answer is left for it; {fix}"
        )
    if isinstance(chosen, str):
        at -= chosen[at - 1] == " "
    elif chosen[at].get("role") != "assistant" or rejected[at].get("role") != "assistant":
        raise ConfigError(
            f"example {index}: chosen and rejected part at message {at + 1}, which is not an assistant turn on "
            f"both sides, so their prompts differ; {fix}"
        )
    return {"prompt": chosen[:at], "chosen": chosen[at:], "rejected": rejected[at:]}


def unit(value) -> str:
    return "character" if isinstance(value, str) else "message"


def from_alpaca(row: dict, index: int) -> dict:
    """LLaMA-Factory's AlpacaDatasetConverter for ranking rows: system, history turns, then instruction and input
    joined by a newline as the user turn; chosen and rejected as the assistant's answer."""
    prompt = [{"role": "system", "content": row["system"]}] if row.get("system") else []
    for turn in row.get("history") or []:
        if not (isinstance(turn, (list, tuple)) and len(turn) == 2):
            raise ConfigError(
                f"example {index}: 'history' must be a list of [instruction, answer] pairs, got {turn!r:.80}"
            )
        prompt += [{"role": "user", "content": turn[0]}, {"role": "assistant", "content": turn[1]}]
    query = "\n".join(str(row[k]) for k in ("instruction", "input") if row.get(k))
    prompt.append({"role": "user", "content": query})
    answers = {}
    for key in ("chosen", "rejected"):
        if not isinstance(row[key], str):
            raise ConfigError(f"example {index}: the alpaca ranking format has text '{key}', got {row[key]!r:.80}")
        answers[key] = [{"role": "assistant", "content": row[key]}]
    return {"prompt": prompt, **answers}


def from_sharegpt(row: dict, index: int) -> dict:
    """LLaMA-Factory's SharegptDatasetConverter for ranking rows: `conversations` (a leading system message or the
    `system` column first) ending in the human turn; chosen and rejected are one gpt message each."""
    turns = row["conversations"]
    if not isinstance(turns, list) or not turns:
        raise ConfigError(f"example {index}: 'conversations' must be a non-empty list of {{from, value}} messages")
    prompt = [sharegpt_message(m, "conversations", index) for m in turns]
    if row.get("system") and prompt[0]["role"] != "system":
        prompt.insert(0, {"role": "system", "content": row["system"]})
    if prompt[-1]["role"] == "assistant":
        raise ConfigError(
            f"example {index}: 'conversations' ends with a gpt turn; in the ranking format it ends with the human "
            "turn that chosen and rejected answer"
        )
    answers = {k: [sharegpt_message(row[k], k, index)] for k in ("chosen", "rejected")}
    for key, (message,) in answers.items():
        if message["role"] != "assistant":
            raise ConfigError(f"example {index}: '{key}' is a {message['role']} message; it must be the gpt answer")
    return {"prompt": prompt, **answers}


def sharegpt_message(m, key: str, index: int) -> dict:
    if isinstance(m, dict) and "from" in m:
        role = SHAREGPT_ROLES.get(m["from"])
        if role is None:
            raise ConfigError(
                f"example {index}: unknown sharegpt role {m['from']!r} in '{key}'; the tags are "
                f"{', '.join(SHAREGPT_ROLES)}"
            )
        return {"role": role, "content": m.get("value")}
    if isinstance(m, dict) and m.get("role") in CHAT_ROLES:
        return {"role": m["role"], "content": m.get("content")}
    raise ConfigError(f"example {index}: '{key}' must hold {{from, value}} messages, got {m!r:.80}")


# ---- tokens, as TRL's DPOTrainer makes them ----------------------------------------------------------------


def common_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class TokenizePairs:
    """A picklable, deterministic batched map function: `ds.map(TokenizePairs(...), batched=True,
    with_indices=True, remove_columns=ds.column_names)`. Per row: `prompt_ids`, `chosen_ids`, `rejected_ids`
    (int32 arrays, so a batch whose rows are all dropped still writes typed columns) and `drop` ("" when kept,
    else why, the same words for every pair dropped for one reason, so they can be counted).

    As TRL: a conversation's prompt is the chat template with the generation prompt and each answer is what the
    template adds after it for prompt+answer, end of turn included; text answers get EOS appended if missing;
    the prompt is where the tokens of prompt and prompt+answer part, so prompt+answer is exactly what the
    tokenizer gives for the whole text; where BPE merges the prompt's last characters with an answer's first
    (TRL warns and trains on a mismatched split), each answer is tokenised on its own, as generation writes it.
    With `max_length` each prompt+answer keeps its first max_length tokens
    (TRL's collator does this per sequence), and a prompt that alone fills max_length drops the pair."""

    def __init__(self, tok, fmt: str, max_length: int | None, truncation_mode: str = "keep_start", name: str = ""):
        if fmt not in FORMATS:
            raise ValueError(f"TokenizePairs needs a detected format (preference.data.detect), got {fmt!r}")
        check_truncation(max_length, truncation_mode)
        self.tok, self.fmt, self.max_length, self.name = tok, fmt, max_length, name
        bos = tok.bos_token_id
        # whether the tokenizer puts a BOS before text itself (Llama's post-processor does; ChatML tokenizers do not)
        self.adds_bos = bos is not None and tok("a")["input_ids"][:1] == [bos]

    def __call__(self, batch, indices) -> dict:
        try:
            return self.tokenize([dict(zip(batch, values)) for values in zip(*batch.values())], indices)
        except ConfigError as e:
            raise ConfigError(f"dataset '{self.name}', {e}" if self.name else str(e)) from None

    def tokenize(self, rows: list[dict], indices) -> dict:
        pairs = [as_trl(self.fmt, row, i + 1) for row, i in zip(rows, indices)]
        kept = [n for n, p in enumerate(pairs) if not self.empty_reason(p)]
        texts = {n: self.render(pairs[n], indices[n] + 1) for n in kept}
        ids = {}
        for special in (True, False):  # text is tokenised with the tokenizer's special tokens, templates without
            group = [n for n in kept if isinstance(pairs[n]["prompt"], str) == special]
            flat = [t for n in group for t in texts[n]]
            enc = self.tok(flat, add_special_tokens=special, return_attention_mask=False)["input_ids"] if flat else []
            for j, n in enumerate(group):
                ids[n] = [self.no_double_bos(x) if special else x for x in enc[3 * j : 3 * j + 3]]
        out = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": [], "drop": []}
        for n, pair in enumerate(pairs):
            prompt, chosen, rejected, drop = self.split(pair, ids.get(n), indices[n] + 1, texts.get(n))
            for key, value in zip(out, (prompt, chosen, rejected)):
                out[key].append(np.asarray(value, dtype=np.int32))
            out["drop"].append(drop)
        return out

    @staticmethod
    def empty_reason(pair: dict) -> str:
        for key in ("prompt", "chosen", "rejected"):
            if empty(pair[key]):
                return f"empty {key}"
        return ""

    def render(self, pair: dict, index: int) -> list[str]:
        """Prompt, prompt+chosen and prompt+rejected as the text TRL tokenises (`_prepare_dataset`'s tokenize_fn)."""
        prompt = pair["prompt"]
        if isinstance(prompt, str):
            eos = self.tok.eos_token
            return [prompt] + [prompt + (a if a.endswith(eos) else a + eos) for a in (pair["chosen"], pair["rejected"])]
        tools = pair.get("tools")
        kw = {
            "tools": json.loads(tools) if isinstance(tools, str) else tools,
            **(pair.get("chat_template_kwargs") or {}),
        }
        try:
            return [
                self.tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, **kw),
                self.tok.apply_chat_template(prompt + pair["chosen"], tokenize=False, **kw),
                self.tok.apply_chat_template(prompt + pair["rejected"], tokenize=False, **kw),
            ]
        except Exception as e:  # jinja's errors (a template's raise_exception) mean this conversation, not our code
            if type(e).__module__.startswith("jinja2"):
                raise ConfigError(f"example {index}: the chat template refused it: {str(e).splitlines()[0]}") from None
            raise

    def no_double_bos(self, ids: list[int]) -> list[int]:
        """Text that already starts with BOS (a prompt rendered by a template that writes one) gets a second from a
        tokenizer that adds one; TRL keeps both, which a model never saw in pretraining."""
        bos = self.tok.bos_token_id
        return ids[1:] if self.adds_bos and ids[:2] == [bos, bos] else ids

    def split(self, pair: dict, ids, index: int, texts=None) -> tuple[list, list, list, str]:
        why = self.empty_reason(pair)
        if why:
            return [], [], [], why
        p, pc, pr = ids
        at = min(common_prefix(p, pc), common_prefix(p, pr))
        if at < len(p) and not isinstance(pair["prompt"], str) and all(t.startswith(texts[0]) for t in texts[1:]):
            # The text is a growing prefix but BPE merged the generation prompt's last characters with the answer's
            # first (the embedded tokenizer writes "\n4" for a newline before a digit). TRL trains on those merged
            # tokens, which generation never produces: it writes the answer after the prompt's own tokens. So the
            # answers are tokenised on their own, as a model generating from this prompt writes them.
            pc, pr = (p + self.tok(t[len(texts[0]) :], add_special_tokens=False)["input_ids"] for t in texts[1:])
            at = len(p)
        if at < len(p) and not isinstance(pair["prompt"], str):
            raise ConfigError(
                f"example {index}: the chat template renders the prompt alone (with the generation prompt) as "
                f"{self.tok.decode(p[at:])!r} where the whole conversation has {self.tok.decode(pc[at:][:8])!r}..., "
                "so training would see a context generation never does (TRL only warns); use a chat template that "
                "renders a conversation as a growing prefix"
            )
        prompt, chosen, rejected = p[:at], pc[at:], pr[at:]
        if chosen == rejected:
            raise ConfigError(
                f"example {index}: chosen and rejected give the same tokens, so the pair teaches nothing; fix or remove it"
            )
        if not chosen or not rejected:
            return prompt, chosen, rejected, "an answer with no tokens"
        if self.max_length is None:
            return prompt, chosen, rejected, ""
        if len(prompt) >= self.max_length:
            return prompt, chosen, rejected, f"prompt fills max_length {self.max_length}"
        room = self.max_length - len(prompt)
        chosen, rejected = chosen[:room], rejected[:room]
        if chosen == rejected:  # they differ only past max_length: no signal left, and a zero-margin pair
            return prompt, chosen, rejected, f"chosen and rejected identical within max_length {self.max_length}"
        return prompt, chosen, rejected, ""


# ---- what --dry_run shows ----------------------------------------------------------------------------------


def describe_pair(tok, prompt_ids, chosen_ids, rejected_ids, width: int = 400) -> list[str]:
    """One pair as --dry_run shows it: each sequence as the model reads it, its trained span in [...] (the
    answer, end of turn included; the prompt is context only), and the token counts."""
    text = lambda ids: shown(tok.decode(list(ids)), width)  # noqa: E731
    return [
        f"pair: prompt {len(prompt_ids)} tokens (context, not trained), chosen {len(chosen_ids)} and rejected "
        f"{len(rejected_ids)} tokens (trained, in [...])",
        f"  chosen:   {text(prompt_ids)}[{text(chosen_ids)}]",
        f"  rejected: {text(prompt_ids)}[{text(rejected_ids)}]",
    ]


def shown(text: str, width: int) -> str:
    """On one line (newlines escaped), the middle of a long text elided."""
    text = text.encode("unicode_escape").decode("ascii", "replace")
    if len(text) <= width:
        return text
    keep = (width - 20) // 2
    return f"{text[:keep]} ...({len(text) - 2 * keep} chars)... {text[-keep:]}"


def sample_lines(cfg, load_tokenizer) -> list[str]:
    """--dry_run: the first SAMPLE_ROWS rows of the training split read (streamed, no cache written), checked and
    tokenised as preparing would (`load_tokenizer()` is asked only then: a hub dataset offline needs none), and the
    first pair kept shown with what it trains."""
    from zero_recipes.data import sources
    from zero_recipes.modeling.hub import unreachable

    spec = sources.dataset_specs(cfg)[0]
    source = sources.describe(spec, cfg)
    if source["kind"] == "hub" and not Path(source["name"]).is_dir() and (why := unreachable()):
        return [f"{spec.name}: a hub dataset, not read (hub offline: {why})"]
    ds = sources.load(spec, source, spec.split, streaming=True, trust_remote_code=cfg.trust_remote_code)
    try:
        rows = list(islice(ds, SAMPLE_ROWS))
    except ConfigError:
        raise
    except Exception as e:  # as sources.read_sample: the stream reads the file only now
        raise sources.as_config_error(e, spec, source) from None
    if not rows:
        raise ConfigError(f"dataset '{spec.name}' (split {spec.split}) is empty")
    columns = list(dict.fromkeys(k for row in rows for k in row))
    fmt, how = detect(columns, spec.name)
    try:
        tok = load_tokenizer()
    except ConfigError as e:  # a hub model's tokenizer, the hub offline: the rows were read and checked all the same
        return [f"{spec.name}: the first {len(rows)} rows read; {how}; no pair rendered ({e})"]
    if is_chat(as_trl(fmt, rows[0], 1)["chosen"]):  # as preparing gives it: the model's template, or the embedded one
        from zero_recipes.data.formats import ensure_chat_template

        ensure_chat_template(tok, lambda *a, **k: None)
    max_length, mode = cfg.max_length, cfg.truncation_mode
    out = TokenizePairs(tok, fmt, max_length, mode, spec.name)(
        {k: [r.get(k) for r in rows] for k in columns}, range(len(rows))
    )
    lines = [f"{spec.name}: the first {len(rows)} rows read; {how}"]
    kept = [n for n, why in enumerate(out["drop"]) if not why]
    if not kept:
        return lines + [f"  all {len(rows)} dropped: {', '.join(sorted(set(out['drop'])))}"]
    n = kept[0]
    return lines + describe_pair(tok, out["prompt_ids"][n], out["chosen_ids"][n], out["rejected_ids"][n])
