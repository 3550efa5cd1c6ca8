"""Evaluation through lm-evaluation-harness, for real: tools/evaluate.py against the `lm_eval` CLI on a
quick-start-like export, `--eval_tasks` / `--eval_samples` on the live model under ZeRO-3 (2 ranks) and LoRA,
and the shipped tasks' data against the held-out split it claims to be. Everything offline: the shipped tasks
read eval_tasks/data/, the test tasks files these tests write."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import REPO, launch

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def tool(*args, env=None):
    return subprocess.run(
        [sys.executable, "tools/evaluate.py", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **OFFLINE, **(env or {})},
    )


def lm_eval_cli(*args):
    return subprocess.run(
        ["lm_eval", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **OFFLINE},
    )


def task_values(results: dict, task: str) -> dict:
    return {k: v for k, v in results["results"][task].items() if isinstance(v, float)}


@pytest.fixture(scope="module")
def pretrained(trained):
    """A quick-start-like export (the session's zero3 fp32 run: the embedded model and tokenizer)."""
    return trained("zero3", "fp32").check().output_dir


def test_evaluate_tool_gives_the_lm_eval_clis_numbers(pretrained, tmp_path):
    ours = tool(pretrained, "--tasks", "docstring_cloze", "--limit", 40, "--output", tmp_path / "ours.json")
    assert ours.returncode == 0, ours.stderr[-3000:]
    command = next(line for line in ours.stderr.splitlines() if line.startswith("lm-eval: lm_eval "))
    # the command it prints, run as a user would, into lm-eval's own results file
    args = command.split(" ", 2)[2].split()
    cli = lm_eval_cli(*args, "--output_path", tmp_path / "cli")
    assert cli.returncode == 0, cli.stderr[-3000:]
    theirs = json.loads(next((tmp_path / "cli").rglob("results_*.json")).read_text())
    mine = json.loads((tmp_path / "ours.json").read_text())
    assert task_values(mine, "docstring_cloze") == task_values(theirs, "docstring_cloze")
    assert set(task_values(mine, "docstring_cloze")) >= {"acc,none", "acc_norm,none", "acc_stderr,none"}
    assert mine["n-samples"]["docstring_cloze"]["effective"] == 40
    # the table shows the same values
    acc = mine["results"]["docstring_cloze"]["acc,none"]
    assert f"docstring_cloze  acc       {acc:.4f}" in ours.stdout, ours.stdout


def memorise_files(tmp_path):
    """16 checkable chat examples, trained on and evaluated on (an eval split equal to the train split), so a
    few dozen steps move exact match off 0 (the session's base has trained 8 steps); and an lm-eval task over
    the same file, as a user writes one."""
    from zero_recipes.data.builtin import instruction_examples

    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps(e) + "\n" for e in instruction_examples(16, seed=1)))
    task = tmp_path / "qa.yaml"
    task.write_text(
        "task: qa_memorised\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "output_type: generate_until\ntest_split: test\n"
        'doc_to_text: "{{messages[0].content}}"\ndoc_to_target: "{{messages[1].content}}"\n'
        'generation_kwargs:\n  until: ["<|im_end|>", "\\n"]\n  do_sample: false\n  max_gen_toks: 24\n'
        "metric_list:\n  - metric: exact_match\n"
    )
    return data, task


def test_eval_tasks_on_the_live_zero3_model_agree_with_training_and_the_export(pretrained, tmp_path):
    data, task = memorise_files(tmp_path)
    args = ["--recipe", "recipes/tiny-sft.yaml", "--model_name_or_path", pretrained]
    args += ["--deepspeed", "ds_configs/zero3.json", "--dataset_name", data, "--eval_split", "train"]
    args += ["--validation_split_percentage", "0", "--packing", "false", "--per_device_train_batch_size", "8"]
    args += ["--max_steps", "80"]
    args += ["--eval_steps", "40", "--eval_on_start", "false", "--logging_steps", "10", "--save_steps", "0"]
    args += ["--eval_tasks", task, "docstring_cloze", "--eval_tasks_limit", "16", "--eval_samples", "3"]
    run = launch([str(a) for a in args], tmp_path / "run", env=OFFLINE).check()
    evals = [r for r in run.records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [40, 80]
    for r in evals:
        assert {"eval_qa_memorised_exact_match", "eval_docstring_cloze_acc", "eval_docstring_cloze_acc_norm"} <= set(r)
        assert r["eval_tasks_seconds"] > 0 and r["eval_samples_seconds"] > 0
    last = evals[-1]
    # the same 16 questions, greedy: train.py's teacher-forced exact match and lm-eval's generated one
    assert last["eval_exact_match"] > 0.1, last
    assert abs(last["eval_qa_memorised_exact_match"] - last["eval_exact_match"]) <= 1 / 16, last
    assert "qa_memorised_exact_match" in run.log  # the eval line names them
    # the export, through tools/evaluate.py: the live model's lm-eval numbers
    out = tool(run.output_dir, "--tasks", task, "docstring_cloze", "--limit", 16, "--output", tmp_path / "r.json")
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((tmp_path / "r.json").read_text())["results"]
    assert results["qa_memorised"]["exact_match,none"] == last["eval_qa_memorised_exact_match"]
    assert results["docstring_cloze"]["acc,none"] == last["eval_docstring_cloze_acc"]
    # the side-by-side page: a column per evaluation, the held-out prompts with their references
    records = [json.loads(x) for x in (run.output_dir / "eval_samples.jsonl").read_text().splitlines()]
    assert [r["column"] for r in records] == ["step 40"] * 3 + ["step 80"] * 3
    assert all(r["reference"] for r in records)
    page = (run.output_dir / "eval_samples.html").read_text()
    assert "step 40" in page and "step 80" in page and records[0]["reference"] in page
    # the chart: each task's metric, its cost in the legend
    plot = subprocess.run([sys.executable, "tools/plot_metrics.py", run.output_dir, "--out", tmp_path / "plots",
                           "--json"], cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    series = json.loads(plot.stdout.splitlines()[-1])["eval_tasks"]["series"]
    assert any("qa_memorised_exact_match" in s and "s per eval)" in s for s in series), series


def test_eval_tasks_with_lora_equal_the_adapters_export(pretrained, tmp_path):
    args = ["--recipe", "recipes/tiny-lora-sft.yaml", "--model_name_or_path", pretrained, "--max_steps", "4"]
    args += ["--eval_steps", "4", "--eval_on_start", "false", "--save_steps", "0", "--max_eval_batches", "1"]
    args += ["--eval_tasks", "docstring_cloze", "tiny_instructions", "--eval_tasks_limit", "12"]
    run = launch([str(a) for a in args], tmp_path / "run", env=OFFLINE).check()
    assert (run.output_dir / "adapter_config.json").is_file()
    last = [r for r in run.records if "eval_loss" in r][-1]
    assert last["step"] == 4 and last["eval_tasks_seconds"] > 0
    # one call: the tasks, and the adapter's answers beside its base's on a page
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"question": "What is 2 plus 3?", "answer": "5"}\n{"prompt": "Sort the digits: 3 1 2"}\n')
    out = tool(run.output_dir, "--tasks", "docstring_cloze", "tiny_instructions", "--limit", 12, "--output",
               tmp_path / "r.json", "--samples", prompts, "--compare", pretrained, "--samples_output", tmp_path / "page")  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "peft=" in out.stderr  # the adapter on its base, as lm_eval --model_args peft=... loads it
    results = json.loads((tmp_path / "r.json").read_text())["results"]
    assert results["docstring_cloze"]["acc,none"] == last["eval_docstring_cloze_acc"]
    assert results["docstring_cloze"]["acc_norm,none"] == last["eval_docstring_cloze_acc_norm"]
    assert results["tiny_instructions"]["exact_match,none"] == last["eval_tiny_instructions_exact_match"]
    records = [json.loads(x) for x in (tmp_path / "page.jsonl").read_text().splitlines()]
    assert [(r["column"], r["reference"]) for r in records] == [
        (str(run.output_dir), "5"), (str(run.output_dir), None), (str(pretrained), "5"), (str(pretrained), None)
    ]  # fmt: skip
    assert "chat template" in records[0]["decoding"] and "raw text" in records[2]["decoding"]
    html = (tmp_path / "page.html").read_text()
    assert "What is 2 plus 3?" in html and str(pretrained) in html and "greedy" in html


def test_shipped_tasks_hold_the_runs_held_out_examples():
    """eval_tasks/data/ is what data.preparation holds out: the quick start's eval docstrings and tiny-sft's
    held-out questions, rebuilt here and compared line by line."""
    from zero_recipes.evaluation import shipped_tasks

    if sys.version_info[:2] != (3, 11):
        pytest.skip("docstring_cloze was built from Python 3.11's standard library docstrings")
    built = shipped_tasks.build()
    for name, items in built.items():
        shipped = [json.loads(x) for x in (shipped_tasks.DATA / f"{name}.jsonl").read_text().splitlines()]
        assert shipped == items, name
    assert len(built["tiny_instructions"]) == 1000  # 5 % of 20,000
    assert len(built["docstring_cloze"]) > 100
