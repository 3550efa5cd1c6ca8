"""Preference data: the same file gives the same tokens here as in TRL 1.16's DPOTrainer (its own
`_prepare_dataset` and `DataCollatorForPreference` run beside ours), LLaMA-Factory's ranking rows give the ids of
the TRL row they mean, what TRL gets wrong is refused in one line, and the embedded pair set is right."""

import contextlib
import pickle
import re
from types import SimpleNamespace

import datasets
import pytest
import tokenizers
import trl.trainer.dpo_trainer as trl_dpo
from tokenizers import processors
from transformers import PreTrainedTokenizerFast

from zero_recipes import data
from zero_recipes.config.train_config import TrainConfig
from zero_recipes.data import builtin, sources
from zero_recipes.data.formats import DEFAULT_CHAT_TEMPLATE
from zero_recipes.errors import ConfigError
from zero_recipes.preference.data import TokenizePairs, describe_pair, detect, sample_lines

U, A = "user", "assistant"


def msg(role, content):
    return {"role": role, "content": content}


@pytest.fixture(scope="module")
def chatml():
    """The embedded tokenizer with the ChatML-style template train.py gives it: no BOS anywhere."""
    tok = data.load_tokenizer(TrainConfig())
    tok.chat_template = DEFAULT_CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def llama(chatml):
    """Llama-3's layout, offline: the tokenizer puts BOS before text and the chat template writes BOS itself."""
    backend = tokenizers.Tokenizer.from_str(chatml.backend_tokenizer.to_str())
    backend.add_special_tokens(["<|begin|>", "<|start|>", "<|eot|>"])
    bos = backend.token_to_id("<|begin|>")
    backend.post_processor = processors.TemplateProcessing(single="<|begin|> $A", special_tokens=[("<|begin|>", bos)])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|begin|>", eos_token="<|eot|>", pad_token="<|endoftext|>"
    )
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|eot|>{% endfor %}"
        "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
    )
    return tok


@pytest.fixture
def trl_pairs(monkeypatch):
    """TRL's own tokenisation: DPOTrainer._prepare_dataset, unbound. It reads only `self._tokenizer` and the args
    below; its rank-ordering context (accelerate's process state) is the one thing stood in for."""
    monkeypatch.setattr(trl_dpo, "global_then_local_main_first", contextlib.nullcontext)

    def run(tok, rows, max_length=None):
        args = SimpleNamespace(dataset_num_proc=None, max_length=max_length, truncation_mode="keep_start")
        ds = datasets.Dataset.from_list(rows)
        return trl_dpo.DPOTrainer._prepare_dataset(SimpleNamespace(_tokenizer=tok), ds, tok, args, "train")

    return run


def ours(tok, rows, max_length=None, name="pairs.jsonl"):
    ds = datasets.Dataset.from_list(rows)
    fmt, _ = detect(ds.column_names, name)
    fn = TokenizePairs(tok, fmt, max_length, "keep_start", name)
    return ds.map(fn, batched=True, with_indices=True, remove_columns=ds.column_names)


def ids(ds, keep_dropped=True):
    cols = ("prompt_ids", "chosen_ids", "rejected_ids")
    return [tuple(r[k] for k in cols) for r in ds if keep_dropped or not r.get("drop")]


SETS = {
    "text, explicit prompt": [
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
        {"prompt": "Two plus two is", "chosen": " four", "rejected": " five, or so"},
    ],
    "text, implicit prompt": [
        {"chosen": "Q: the sky's colour? A: blue", "rejected": "Q: the sky's colour? A: green"},
        {"chosen": "Name a fish. A shark", "rejected": "Name a fish. A cat"},
    ],
    "conversation, explicit prompt": [
        {"prompt": [msg(U, "What is 2 plus 3?")], "chosen": [msg(A, "5")], "rejected": [msg(A, "6")]},
        {
            "prompt": [msg("system", "Be brief."), msg(U, "Hi"), msg(A, "Hello"), msg(U, "Sort: 3 1 2")],
            "chosen": [msg(A, "1 2 3")],
            "rejected": [msg(A, "3 2 1 and more")],
        },
    ],
    "conversation, implicit prompt": [
        {"chosen": [msg(U, "Larger, 3 or 9?"), msg(A, "9")], "rejected": [msg(U, "Larger, 3 or 9?"), msg(A, "3")]},
        {
            "chosen": [msg(U, "Hi"), msg(A, "Hello"), msg(U, "Reverse: a b"), msg(A, "b a")],
            "rejected": [msg(U, "Hi"), msg(A, "Hello"), msg(U, "Reverse: a b"), msg(A, "a b")],
        },
    ],
}


@pytest.mark.parametrize("tokenizer", ["chatml", "llama"])
@pytest.mark.parametrize("kind", list(SETS))
def test_the_same_file_gives_trls_tokens_and_its_collators_sequences(kind, tokenizer, request, trl_pairs):
    tok = request.getfixturevalue(tokenizer)
    rows = SETS[kind]
    theirs, mine = trl_pairs(tok, rows), ours(tok, rows)
    assert ids(mine) == ids(theirs) and set(mine["drop"]) == {""}
    batch = trl_dpo.DataCollatorForPreference(pad_token_id=tok.pad_token_id)(list(theirs))
    seqs = [row[mask.bool()].tolist() for row, mask in zip(batch["input_ids"], batch["attention_mask"])]
    assert seqs == [p + c for p, c, _ in ids(mine)] + [p + r for p, _, r in ids(mine)]


@pytest.mark.parametrize("kind, max_length", [("conversation, explicit prompt", 40), ("text, explicit prompt", 5)])
def test_max_length_keeps_the_start_as_trls_collator_and_drops_what_trl_drops(chatml, trl_pairs, kind, max_length):
    rows = SETS[kind]
    theirs, mine = trl_pairs(chatml, rows, max_length), ours(chatml, rows, max_length)
    # the second prompt fills max_length: TRL filters that pair out, ours names why; the first pair's answers are cut
    assert [d for d in mine["drop"] if d] == [f"prompt fills max_length {max_length}"]
    collate = trl_dpo.DataCollatorForPreference(pad_token_id=chatml.pad_token_id, max_length=max_length)
    batch = collate(list(theirs))
    seqs = [row[mask.bool()].tolist() for row, mask in zip(batch["input_ids"], batch["attention_mask"])]
    kept = ids(mine, keep_dropped=False)
    assert seqs == [p + c for p, c, _ in kept] + [p + r for p, _, r in kept]
    assert [(len(p + c), len(p + r)) for p, c, r in kept] == [(max_length, max_length)]


def test_one_bos_and_the_end_of_turn_is_in_both_answers(chatml, llama, trl_pairs):
    rows = SETS["conversation, explicit prompt"][:1]
    (p, c, r), *_ = ids(ours(chatml, rows))
    assert chatml.decode(p).endswith("<|im_start|>assistant\n")
    assert chatml.decode(c) == "5<|im_end|>\n" and chatml.decode(r) == "6<|im_end|>\n"
    (p, c, r), *_ = ids(ours(llama, rows))
    bos = llama.bos_token_id
    assert p[0] == bos and p.count(bos) == 1  # the template's BOS; apply_chat_template adds none
    assert llama.decode(c) == "5<|eot|>" and llama.decode(r) == "6<|eot|>"
    # text: the tokenizer's BOS once, EOS appended to each answer
    (p, c, r), *_ = ids(ours(llama, SETS["text, explicit prompt"][:1]))
    assert p[:2] == [bos, p[1]] and p[1] != bos and c[-1] == r[-1] == llama.eos_token_id
    # a text prompt already rendered by the template starts with BOS: TRL adds a second one, we do not
    rendered = [
        {"prompt": "<|begin|><|start|>user\nHi<|eot|><|start|>assistant\n", "chosen": "Hello", "rejected": "Go"}
    ]
    assert ids(trl_pairs(llama, rendered))[0][0][:2] == [bos, bos]
    (p, c, r), *_ = ids(ours(llama, rendered))
    assert p[:2] == [bos, llama.convert_tokens_to_ids("<|start|>")]
    assert ids(trl_pairs(llama, rendered))[0][1:] == (c, r)  # the rest is TRL's


LLAMA_FACTORY = {
    "alpaca": {
        "instruction": "Add",
        "input": "2 and 3",
        "chosen": "5",
        "rejected": "6",
        "system": "Be brief.",
        "history": [["Hi", "Hello"]],
    },  # fmt: skip
    "sharegpt": {
        "conversations": [
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello"},
            {"from": "human", "value": "Add\n2 and 3"},
        ],
        "system": "Be brief.",
        "chosen": {"from": "gpt", "value": "5"},
        "rejected": {"from": "gpt", "value": "6"},
    },
}
TRL_EQUIVALENT = {
    "prompt": [msg("system", "Be brief."), msg(U, "Hi"), msg(A, "Hello"), msg(U, "Add\n2 and 3")],
    "chosen": [msg(A, "5")],
    "rejected": [msg(A, "6")],
}


@pytest.mark.parametrize("fmt", list(LLAMA_FACTORY))
def test_llama_factory_ranking_rows_give_the_ids_of_the_trl_row(chatml, llama, fmt):
    row = LLAMA_FACTORY[fmt]
    assert detect(list(row), "lf.json")[0] == f"{fmt}_ranking"
    for tok in (chatml, llama):
        assert ids(ours(tok, [row])) == ids(ours(tok, [TRL_EQUIVALENT]))


def refusal(tok, rows, **kw) -> str:
    with pytest.raises(ConfigError) as e:
        ours(tok, rows, **kw)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_each_refusal_is_one_line_naming_the_example_and_the_fix(chatml):
    no_rejected = r"^dataset 'sft.jsonl' has no 'rejected' column \(columns: prompt, chosen\); a preference set needs "
    with pytest.raises(ConfigError, match=no_rejected + r"prompt/chosen/rejected \(TRL's format.*rename its columns$"):
        detect(["prompt", "chosen"], "sft.jsonl")
    same = [{"prompt": "Hi", "chosen": "Yo", "rejected": "Ho"}, {"prompt": "Hi", "chosen": "Yo", "rejected": "Yo"}]
    assert re.search(
        r"^dataset 'pairs.jsonl', example 2: chosen and rejected are identical.*remove", refusal(chatml, same)
    )
    apart = [{"chosen": [msg(U, "Hi"), msg(A, "Yo")], "rejected": [msg(U, "Hey"), msg(A, "Yo")]}]
    assert re.search(
        r"example 1: .*share no prompt; give the prompt as its own 'prompt' column", refusal(chatml, apart)
    )
    later = SETS["conversation, implicit prompt"][1:] * 2
    later[1] = {**later[1], "rejected": later[1]["rejected"][:2] + [msg(U, "Other"), msg(A, "b a")]}
    assert re.search(r"example 2: .* part at message 3, which is not an assistant turn", refusal(chatml, later))
    # a template that renders the prompt alone otherwise (an empty thought block only the generation prompt gets)
    thinks = PreTrainedTokenizerFast(tokenizer_object=chatml.backend_tokenizer, eos_token="<|endoftext|>")
    thinks.chat_template = DEFAULT_CHAT_TEMPLATE.replace(
        "assistant\n{% endif %}", "assistant\n<think></think>{% endif %}"
    )
    why = refusal(thinks, SETS["conversation, explicit prompt"])
    assert re.search(r"example 1: the chat template renders the prompt alone .*TRL only warns.*growing prefix", why)
    with pytest.raises(ConfigError, match=r"^--truncation_mode keep_end: .*use keep_start .*--max_length$"):
        TokenizePairs(chatml, "explicit", 512, "keep_end")


def test_an_answer_bpe_merges_into_the_prompts_end_is_tokenised_as_generation_writes_it(chatml):
    """The embedded tokenizer writes newlines in a row as one token, so "assistant\\n" + "\\n\\n>>>" is not the
    prompt's tokens plus more: a model's own answer (judged pairs, tools/evaluate.py --preferences_out) hits this.
    The prompt keeps its tokens and each answer is its own text tokenised, as the model generated it."""
    prompt = [msg(U, "What is 25 plus 19?")]
    pair = {"prompt": prompt, "chosen": [msg(A, "46")], "rejected": [msg(A, "\n\n>>> c.0")]}
    rendered = chatml.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    p_ids = chatml(rendered, add_special_tokens=False)["input_ids"]
    whole = chatml(rendered + "\n\n>>> c.0<|im_end|>\n", add_special_tokens=False)["input_ids"]
    assert whole[: len(p_ids)] != p_ids  # the merge this test is about
    cols = TokenizePairs(chatml, "explicit", None).tokenize([pair], [0])
    assert cols["drop"] == [""] and cols["prompt_ids"][0].tolist() == p_ids
    for key, text in (("chosen_ids", "46<|im_end|>\n"), ("rejected_ids", "\n\n>>> c.0<|im_end|>\n")):
        assert cols[key][0].tolist() == chatml(text, add_special_tokens=False)["input_ids"]


def test_empty_answers_are_dropped_and_named_and_a_batch_of_drops_still_writes(chatml):
    rows = [{"prompt": "Hi", "chosen": "", "rejected": "No"}, {"prompt": " ", "chosen": "a", "rejected": "b"}]
    out = ours(chatml, rows)
    assert out["drop"] == ["empty chosen", "empty prompt"] and out["chosen_ids"] == [[], []]
    fn = TokenizePairs(chatml, "explicit", None, "keep_start", "x")
    batch = {k: [r[k] for r in SETS["text, explicit prompt"]] for k in ("prompt", "chosen", "rejected")}
    again = pickle.loads(pickle.dumps(fn))  # datasets.map with num_proc pickles it
    assert [v.tolist() for v in again(batch, [0, 1])["chosen_ids"]] == [
        v.tolist() for v in fn(batch, [0, 1])["chosen_ids"]
    ]


def test_dry_run_shows_one_pair_with_its_trained_spans(chatml):
    (p, c, r), *_ = ids(ours(chatml, SETS["conversation, explicit prompt"][:1]))
    head, chosen, rejected = describe_pair(chatml, p, c, r)
    assert f"prompt {len(p)} tokens (context, not trained), chosen {len(c)} and rejected {len(r)}" in head
    assert chosen.endswith(r"<|im_start|>assistant\n[5<|im_end|>\n]")
    assert rejected.endswith(r"<|im_start|>assistant\n[6<|im_end|>\n]")
    lines = sample_lines(TrainConfig(dataset_name=builtin.BUILTIN_PREFERENCES), lambda: chatml)
    assert (
        "builtin:tiny-preferences: the first 16 rows read; detected TRL's preference format with an explicit"
        in lines[0]
    )
    assert lines[2].startswith("  chosen:   <|im_start|>user\\n") and "[" in lines[3]


def checked_answer(question: str) -> str:
    nums = [int(x) for x in re.findall(r"\d+", question)]
    if question.startswith("Which is larger"):
        return str(max(nums))
    if question.startswith("What is"):
        return str(sum(nums))
    items = question.split(": ", 1)[1].split()
    return " ".join(reversed(items) if question.startswith("Reverse") else sorted(items))


def test_the_embedded_pairs_prefer_the_checkable_answer(chatml):
    pairs = builtin.preference_examples(4000, seed=1)
    assert pairs[:50] == builtin.preference_examples(50, seed=1)  # deterministic
    for ex in pairs:
        question, chosen, rejected = (ex[k][0]["content"] for k in ("prompt", "chosen", "rejected"))
        assert chosen == checked_answer(question) != rejected
    tasks = {ex["prompt"][0]["content"].split()[0] for ex in pairs}
    assert tasks == {"Which", "What", "Reverse", "Sort"}
    # another seed than tiny-instructions' (20,000 SFT examples, seed 0): half the questions were never trained on
    sft = {ex["messages"][0]["content"] for ex in builtin.instruction_examples(20000, seed=0)}
    assert len({ex["prompt"][0]["content"] for ex in pairs} - sft) > 1500
    assert builtin.BUILTIN_PREFERENCES in sources.BUILTINS
    out = ours(chatml, pairs[:200])
    assert set(out["drop"]) == {""}
