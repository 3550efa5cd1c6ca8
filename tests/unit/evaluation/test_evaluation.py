"""The evaluation package's own logic, without a model: task names and YAMLs checked as lm-eval reads them,
lm-eval's results turned into the table and the metrics train.py logs, what a model directory is to lm-eval,
the prompts --eval_samples takes from held-out rows, and the eval log line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from zero_recipes.data.packing import Samples
from zero_recipes.errors import ConfigError
from zero_recipes.evaluation import harness, in_training
from zero_recipes.evaluation.shipped_tasks import TASKS_DIR
from zero_recipes.training.loop import format_eval

GOOD = "task: mine\ndataset_path: json\noutput_type: generate_until\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n"


def test_shipped_names_resolve_from_eval_tasks_without_lm_evals_index():
    selection = harness.select_tasks(["docstring_cloze,tiny_instructions"])
    assert selection.names == ["docstring_cloze", "tiny_instructions"]
    assert selection.include == [str(TASKS_DIR)] and not selection.defaults  # the 15 s index was not needed


def test_a_yaml_joins_the_include_path_under_its_task_name(tmp_path):
    (tmp_path / "t.yaml").write_text(GOOD)
    selection = harness.select_tasks([str(tmp_path / "t.yaml"), "docstring_cloze"])
    assert selection.names == ["docstring_cloze", "mine"]
    assert str(tmp_path) in selection.include


@pytest.mark.parametrize(
    "text, says",
    [
        (GOOD.replace("doc_to_target: '{{a}}'\n", ""), "lacks the key 'doc_to_target'"),
        (GOOD.replace("dataset_path: json\n", ""), "lacks the key 'dataset_path'"),
        (GOOD.replace("generate_until", "multiple_choice"), "lacks the key 'doc_to_choice'"),
        ("task: [mine\n", "does not parse as YAML"),
        ("- a list\n", "is not a YAML mapping"),
    ],
)
def test_a_broken_task_yaml_is_named_with_what_is_wrong(tmp_path, text, says):
    (tmp_path / "t.yaml").write_text(text)
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace("[", r"\[")):
        harness.read_task_yaml(tmp_path / "t.yaml")


def test_no_task_and_a_missing_yaml_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="no task given"):
        harness.select_tasks([" , "])
    with pytest.raises(ConfigError, match="does not exist"):
        harness.select_tasks([str(tmp_path / "nope.yaml")])


RESULTS = {
    "results": {
        "docstring_cloze": {
            "alias": "docstring_cloze",
            "acc,none": 0.25,
            "acc_stderr,none": 0.05,
            "acc_norm,none": 0.5,
            "acc_norm_stderr,none": "N/A",
        },
        "gsm8k": {"exact_match,strict-match": 0.125, "exact_match_stderr,strict-match": 0.01},
    }
}


def test_scores_table_and_metrics_from_lm_evals_results():
    rows = harness.scores(RESULTS)
    assert [(s.task, s.metric, s.value, s.stderr) for s in rows] == [
        ("docstring_cloze", "acc", 0.25, 0.05),
        ("docstring_cloze", "acc_norm", 0.5, None),
        ("gsm8k", "exact_match (strict-match)", 0.125, 0.01),
    ]
    table = harness.table(rows).splitlines()
    assert table[0].split() == ["task", "metric", "value", "stderr"]
    assert table[2].split() == ["docstring_cloze", "acc", "0.2500", "±", "0.0500"]
    assert harness.flat_metrics(rows) == {
        "eval_docstring_cloze_acc": 0.25,
        "eval_docstring_cloze_acc_norm": 0.5,
        "eval_gsm8k_exact_match_strict-match": 0.125,
    }


def test_an_adapter_is_lm_evals_peft_on_its_base_with_the_runs_tokenizer(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/models/base"}))
    assert harness.model_args(tmp_path) == {
        "pretrained": "/models/base",
        "peft": str(tmp_path),
        "tokenizer": str(tmp_path),
    }
    assert harness.model_args(tmp_path.parent) == {"pretrained": str(tmp_path.parent)}


def test_the_chat_template_is_applied_when_the_tokenizer_has_one():
    class Tok:
        chat_template = None

    assert not harness.wants_chat_template("auto", Tok())
    assert harness.wants_chat_template("on", Tok())
    Tok.chat_template = "{{ messages }}"
    assert harness.wants_chat_template("auto", Tok()) and not harness.wants_chat_template("off", Tok())


class CharTokenizer:
    """Decodes ids as characters: enough to see which tokens became the prompt and which the reference."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def rows_of(examples: list[tuple[str, str]], sft: bool) -> Samples:
    tokens, mask, seg = [], [], []
    for prompt, answer in examples:
        seg.append((len(tokens), len(prompt) + len(answer)))
        tokens += [ord(c) for c in prompt + answer]
        mask += [0] * len(prompt) + [1] * len(answer)
    ptr = np.arange(len(seg) + 1)
    return Samples(np.array(tokens), np.array(mask, dtype=np.uint8) if sft else None, np.array(seg), ptr)


class Prepared:
    def __init__(self, eval_rows):
        self.held_out_rows = eval_rows  # data.Prepared's: its eval rows (a preference run's: prompt + chosen)


def test_eval_samples_take_prompt_and_reference_from_held_out_rows():
    examples = [(f"<q{i}>", f"a{i}<|im_end|>\n") for i in range(10)]
    prompts = in_training.held_out_prompts(Prepared(rows_of(examples, sft=True)), CharTokenizer(), 3)
    assert prompts == [  # spread over the set; the answer up to its end of turn
        {"prompt": "<q0>", "reference": "a0"},
        {"prompt": "<q4>", "reference": "a4"},
        {"prompt": "<q9>", "reference": "a9"},
    ]
    text = in_training.held_out_prompts(Prepared(rows_of([("x" * 40 + "y" * 40, "")], sft=False)), CharTokenizer(), 4)
    assert text == [{"prompt": "x" * 32, "reference": "x" * 8 + "y" * 24}]
    assert in_training.held_out_prompts(Prepared(None), CharTokenizer(), 4) == []


def test_the_eval_line_names_each_task_and_what_it_cost():
    line = format_eval(
        {
            "eval_loss": 0.5,
            "eval_perplexity": 1.6487,
            "eval_exact_match": 0.25,
            "eval_docstring_cloze_acc": 0.3125,
            "eval_tasks_seconds": 3.44,
            "eval_samples_seconds": 1.25,
        }
    )
    assert (
        line == "loss 0.5000 perplexity 1.65 exact match 25.0% docstring_cloze_acc 0.3125 (3.4 s tasks) (1.2 s samples)"
    )
