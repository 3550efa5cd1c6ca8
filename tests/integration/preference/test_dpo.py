"""What DPO owes beyond the contract table's rows (tests/contract.py's dpo-* rows: parity, resume, export): the
reference log-probs each layout's engine computed equal a fresh forward of the initial model in TRL's padded
layout; the modes without a row (bf16 with everything offloaded, an expert-parallel mixture, QLoRA) train;
bad input is one line, exit 2, nothing written."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from contract import BY_NAME, DPO_PAIRS, LORA, LORA_BASE, MOE_MODEL, QLORA_BASE, dpo, mode_args
from helpers import CONFIGS, FAST, dry_run_in_process, launch, refusal, train_args


def reference_file(run) -> Path:
    args = train_args(run)
    return Path(args[args.index("--reference_cache") + 1])


def stored(run):
    with np.load(reference_file(run)) as f:
        return json.loads(str(f["meta"])), np.array(f["train"])


@pytest.fixture(scope="module")
def lora_runs(mode_run, baseline_run):
    return baseline_run(BY_NAME["dpo-lora-zero2"]).check(), mode_run(BY_NAME["dpo-lora-zero2"]).check()


def test_the_stored_reference_is_a_fresh_forward_of_the_base_in_trls_layout(lora_runs, bases):
    """LoRA's reference is its base (the adapter starts at zero): recomputed here with plain transformers, each
    answer its own padded row as TRL's collator lays them out, it equals what ZeRO-0's and ZeRO-2's engines stored
    from the shared-prompt rows."""
    import torch
    from transformers import AutoModelForCausalLM

    from zero_recipes.preference import pairs as pairs_mod
    from zero_recipes.preference.prepare import load_pairs

    meta, zero0 = stored(lora_runs[0])
    _, zero2 = stored(lora_runs[1])
    entry = Path(os.environ["ZERO_RECIPES_CACHE"]) / "prepared" / f"pairs-{meta['pairs']}"
    rows = load_pairs(entry, "train")
    base = AutoModelForCausalLM.from_pretrained(bases((LORA_BASE,))[LORA_BASE], attn_implementation="sdpa").eval()
    picks = [0, len(rows) // 2, len(rows) - 1]
    batch = pairs_mod.padded([rows.row(i) for i in picks], pad_id=0)
    with torch.no_grad():
        logits = base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    tok = logits.log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0] * batch["completion_mask"][:, 1:]
    fresh = tok.sum(1).double().view(2, -1).T.numpy()  # [pairs, (chosen, rejected)]
    assert np.allclose(zero0[picks], fresh, rtol=1e-6, atol=0) and np.allclose(zero2[picks], fresh, rtol=1e-6, atol=0)


def test_each_layouts_engine_stores_the_reference_of_zero0(mode_run, baseline_run):
    """ZeRO-3 computes it from gathered partitions, TP from split layers: the same log-probs, each its own file."""
    _, base = stored(baseline_run(BY_NAME["dpo-zero3"]).check())
    for name in ("dpo-zero3", "dpo-tp2-zero1"):
        run = mode_run(BY_NAME[name]).check()
        _, ref = stored(run)
        assert np.isfinite(ref).all() and np.allclose(ref, base, rtol=1e-6, atol=0), name


MODES = {  # the modes without a contract row: a DPO run trains, its export reloads
    "zero3+offload_all-bf16": (*CONFIGS["zero3+offload_all"], "ds_configs/bf16.json"),
    "moe-zero2+ep2": (*CONFIGS["zero2"], "ds_configs/ep2.json"),
    "qlora-zero2": (*CONFIGS["zero2"],),
}
EXTRA = {
    "moe-zero2+ep2": ("--model_config", json.dumps(MOE_MODEL), "--router_aux_loss_coef", "0.01"),
    "qlora-zero2": ("--model_name_or_path", QLORA_BASE, *LORA, "--load_in_4bit"),
}


@pytest.mark.parametrize("name", MODES)
def test_dpo_trains_in_the_modes_without_a_row(name, bases, tmp_path):
    args = (*MODES[name], *dpo(f"smoke-{name}"), *EXTRA.get(name, ()), "--max_steps", "4", "--verify_export")
    run = launch(mode_args(args, bases), tmp_path / name, launcher="forked").check()
    losses = [r["loss"] for r in run.records if "loss" in r]
    assert len(losses) == 4 and all(np.isfinite(losses)), run.log[-3000:]
    assert "reference: log-probs of" in run.log
    tol = 1e-2 if "bf16" in name or "qlora" in name else 1e-5
    assert next(r["export_max_abs_logit_diff"] for r in run.records if "export_max_abs_logit_diff" in r) <= tol


def test_dry_run_shows_one_pair_as_it_will_train(tmp_path):
    from zero_recipes.data.builtin import preference_examples

    data = write(tmp_path / "pairs.jsonl", preference_examples(20))
    out = dry_run_in_process("--deepspeed", *CONFIGS["zero2"], "--objective", "dpo", "--dataset_name", str(data))
    assert "detected TRL's preference format with an explicit prompt" in out
    assert "chosen 10 and rejected 10 tokens (trained, in [...])" in out and "assistant\\n[" in out
    assert "16 pairs x 256 tokens" in out and "memory: estimated peak" in out


# ---- bad input: one line, exit 2, nothing written ------------------------------------------------------------
def test_unknown_loss_types_and_beta_are_refused_before_anything_starts():
    line = refusal("--deepspeed", "ds_configs/zero0.json", "--objective", "dpo", "--loss_type", "sigmod")
    assert "--loss_type 'sigmod' is not one TRL knows" in line and "did you mean 'sigmoid'" in line
    line = refusal("--deepspeed", "ds_configs/zero0.json", "--objective", "dpo", "--beta", "0")
    assert line.startswith("error: --beta must be > 0")
    line = refusal("--deepspeed", "ds_configs/zero1.json", "ds_configs/sp2.json", "--objective", "dpo", world=2)
    assert "sequence_parallel_size = 2 with --objective dpo" in line


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_identical_answers_are_one_line_after_the_datas_progress_and_nothing_is_written(tmp_path):
    """Found while preparing the pairs, after the process group started: the shell still gets one line, exit 2."""
    from zero_recipes.data.builtin import preference_examples

    pairs = preference_examples(40)
    pairs[7]["rejected"] = pairs[7]["chosen"]
    data = write(tmp_path / "pairs.jsonl", pairs)
    before = sorted(p.name for p in tmp_path.iterdir())
    args = [*FAST, "--deepspeed", *CONFIGS["zero0"], "--objective", "dpo", "--dataset_name", str(data),
            "--block_size", "128", "--reference_cache", str(tmp_path / "ref.npz")]  # fmt: skip
    proc = launch(args, tmp_path / "out", nproc=1, launcher="python").proc
    # after the data's progress bars (datasets' own, on stderr), one line and no traceback
    lines = [
        line for line in proc.stderr.splitlines() if line.strip() and "examples/s" not in line and "it/s]" not in line
    ]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("error: ") and "example 8: chosen and rejected are identical" in lines[0], lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no output_dir, no reference file


def test_another_models_reference_file_is_refused_before_anything_starts(baseline_run, bases, tmp_path):
    """ZeRO-0's file, computed from the embedded model's random init, given to a run from the LoRA base."""
    ref = reference_file(baseline_run(BY_NAME["dpo-zero1"]).check())
    line = refusal("--deepspeed", *CONFIGS["zero0"], "--objective", "dpo", "--dataset_name", bases((DPO_PAIRS,))[DPO_PAIRS],
                   "--model_name_or_path", bases((LORA_BASE,))[LORA_BASE], "--reference_cache", str(ref),
                   "--output_dir", str(tmp_path / "out"))  # fmt: skip
    assert "holds the reference log-probs of another model" in line and "a random init (seed 42)" in line, line
    assert not (tmp_path / "out").exists()


def test_tiny_dpo_recipe_learns_the_preference_and_shows_its_answers(trained, tmp_path):
    """recipes/tiny-dpo.yaml from a quick-start-like model (the session's ZeRO-3 run) on 400 pairs of the embedded
    set: the held-out reward accuracy climbs from 0 (every reward is 0 before the first step; TRL counts a tie as
    wrong) well above chance in 40 steps, and the live samples page shows held-out prompts' answers."""
    from zero_recipes.data.builtin import preference_examples

    data = write(tmp_path / "pairs.jsonl", preference_examples(400))
    base = trained("zero3", "fp32").check().output_dir
    args = ["--recipe", "recipes/tiny-dpo.yaml", "--model_name_or_path", str(base), "--dataset_name", str(data),
            "--max_steps", "40", "--eval_steps", "40", "--save_steps", "0", "--eval_samples", "2",
            "--verify_export"]  # fmt: skip
    run = launch(args, tmp_path / "dpo", launcher="forked").check()
    evals = [r for r in run.records if "eval_rewards/accuracies" in r]
    assert [r["step"] for r in evals] == [0, 40] and evals[0]["eval_rewards/accuracies"] == 0
    assert evals[1]["eval_rewards/accuracies"] >= 0.6 and evals[1]["eval_rewards/margins"] > 0, evals
    assert "plan: 40 steps x 32 pairs x 128 tokens" in run.log
    page = (run.output_dir / "eval_samples.html").read_text()
    assert "step 40" in page and any(q in page for q in ("What is", "Which is larger", "Reverse the", "Sort the"))
