"""SFT through train.py for real: the tiny-sft recipe, and resumes whose batches are the uninterrupted
run's (prepared and streamed data)."""

import json
import shutil

import pytest

from helpers import FAST, launch


def rewind(run_dir, step):
    """Make a finished run look as if it had stopped right after its step-`step` checkpoint."""
    ckpts = run_dir / "checkpoints"
    for d in ckpts.glob("step-*"):
        if int(d.name.split("-")[1]) > step:
            shutil.rmtree(d)
    (ckpts / "latest").write_text(f"step-{step}")
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records if r["step"] <= step))
    for f in ("model.safetensors", "config.json", "generation_config.json"):
        (run_dir / f).unlink(missing_ok=True)


def step_losses(run):
    return {r["step"]: r["loss"] for r in run.records if "loss" in r}


@pytest.fixture(scope="module")
def pretrained(trained):
    """A quick-start-like model directory (the session's zero3 fp32 run), for the SFT recipe to start from."""
    return trained("zero3", "fp32").check().output_dir


@pytest.mark.parametrize("recipe", ["tiny-sft.yaml", "tiny-lora-sft.yaml"])
def test_tiny_sft_recipe_fine_tunes_and_reports_exact_match(recipe, pretrained, tmp_path):
    run = launch(
        [
            "--recipe",
            f"recipes/{recipe}",
            "--model_name_or_path",
            str(pretrained),
            "--max_steps",
            "40",
            "--eval_steps",
            "40",
            "--max_eval_batches",
            "2",
            "--save_steps",
            "0",
            "--logging_steps",
            "10",
            "--verify_export",
        ],
        tmp_path / "sft",
    ).check()
    evals = [r for r in run.records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 40]  # eval_on_start gives the baseline
    assert all(0.0 <= r["eval_exact_match"] <= 1.0 for r in evals)
    # full fine-tuning halves the eval loss in 40 steps. The adapter (rank 16) moves the session's barely
    # trained 8-step base far less there (measured 7.71 -> 7.34); from the quick start's 200-step model the
    # shipped recipe goes as far as tiny-sft does (docs/lora.md)
    assert evals[1]["eval_loss"] < (
        0.5 * evals[0]["eval_loss"] if recipe == "tiny-sft.yaml" else evals[0]["eval_loss"] - 0.2
    ), evals
    assert "detected format" not in run.log and "default ChatML-style template" in run.log
    assert "no answer tokens" not in run.log
    assert "warning: the loss rose" not in run.log  # a fine-tune, so watched (loss_rise.py), and a healthy one
    # the exported tokenizer carries the chat template the model was trained with
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(run.output_dir)
    assert (run.output_dir / "adapter_config.json").is_file() == (recipe == "tiny-lora-sft.yaml")
    assert "<|im_start|>" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert [r for r in run.records if "export_max_abs_logit_diff" in r][0]["export_max_abs_logit_diff"] < 1e-5


@pytest.mark.parametrize("kind", ["packed-sft", "streamed-text"])
def test_resume_continues_with_the_uninterrupted_batches(kind, tmp_path):
    """zero1 fp32 with torch's AdamW resumes bitwise, so equal losses after the resume mean equal batches."""
    extra = (
        ["--dataset_name", "builtin:tiny-instructions", "--block_size", "128"]
        if kind == "packed-sft"
        else ["--streaming", "--eval_steps", "0", "--validation_split_percentage", "0"]
    )
    args = FAST + ["--deepspeed", "ds_configs/zero1.json", "--max_steps", "6", "--save_steps", "3", *extra]
    full = launch(args, tmp_path / "full", launcher="forked").check()
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(full.output_dir, resumed_dir)
    rewind(resumed_dir, 3)
    resumed = launch(args, resumed_dir, launcher="forked").check()
    assert "resume: loaded" in resumed.log and "step-3" in resumed.log
    want, got = step_losses(full), step_losses(resumed)
    assert sorted(want) == list(range(1, 7)) and sorted(got) == list(range(1, 7))
    assert [got[s] for s in (4, 5, 6)] == [want[s] for s in (4, 5, 6)]  # bit for bit
