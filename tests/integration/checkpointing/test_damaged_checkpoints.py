"""Damaged checkpoints of real 2-rank runs (ZeRO-2, ZeRO-3, and TP2 with ZeRO-2), each saved at steps 4 and
8: a file cut short, a missing shard, a zero-byte file. In this process, over copies of the runs: a resume
names the damaged file and takes step 4; the user's own path to the damaged one, and tools/export_hf.py on
it, are one line and exit 2 with nothing written. One relaunch per layout proves the fallback end to end:
it resumes from step 4 and repeats the uninterrupted losses bit for bit. (The logic over hand-made files:
tests/unit/checkpointing/test_integrity.py.)"""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from helpers import CONFIGS, FAST, launch, refusal, step_losses, tool_in_process, train_args
from zero_recipes.checkpointing.checkpoint import resolve_resume
from zero_recipes.checkpointing.integrity import damage
from zero_recipes.config.shipped import TENSOR_PARALLEL

# TP2 on 2 ranks: one data-parallel replica, micro 8 (the rows the `trained` runs train per step)
TP_ARGS = FAST + ["--deepspeed", *CONFIGS["zero2"], TENSOR_PARALLEL[2], "--per_device_train_batch_size", "8"]
TP_ARGS += ["--save_steps", "4"]

# layout -> damage -> the file of step-8 it is done to: optimizer and model shards of either rank, and a
# rank's own rng_state file
TARGETS = {
    "zero2": {
        "truncated": "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "missing": "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "zero-byte": "mp_rank_00_model_states.pt",
    },
    "zero3": {
        "truncated": "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "missing": "zero_pp_rank_1_mp_rank_00_model_states.pt",
        "zero-byte": "rng_state_1.pt",
    },
    "tp2-zero2": {
        "truncated": "zero_pp_rank_0_mp_rank_01_optim_states.pt",
        "missing": "mp_rank_01_model_states.pt",
        "zero-byte": "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    },
}
DAMAGE = {  # how -> (what it does to the file, how the line says it after the file's name)
    "truncated": (
        lambda f: os.truncate(f, min(2**20, f.stat().st_size // 2)),
        r"is \d+ bytes; the save wrote \d+ \(truncated\)",
    ),
    "missing": (lambda f: f.unlink(), "is missing"),
    "zero-byte": (lambda f: os.truncate(f, 0), r"is empty \(0 bytes; the save wrote \d+\)"),
}
CASES = [(layout, how) for layout in TARGETS for how in DAMAGE]


@pytest.fixture(scope="module")
def runs(trained, tmp_path_factory):
    """The finished 8-step run of a layout: the shared `trained` runs for ZeRO-2/3, one TP run here."""
    made = {}

    def get(layout: str):
        if layout != "tp2-zero2":
            return trained(layout, "fp32").check()
        if layout not in made:
            made[layout] = launch(TP_ARGS, tmp_path_factory.mktemp("tp2") / "run", launcher="forked").check()
        return made[layout]

    return get


def damaged_copy(run, tmp_path, layout: str, how: str):
    """A copy of the run with its step-8 checkpoint damaged; (the copy, the damaged file's name)."""
    out = tmp_path / "run"
    shutil.copytree(run.output_dir, out)
    name = TARGETS[layout][how]
    DAMAGE[how][0](out / "checkpoints" / "step-8" / name)
    return out, name


@pytest.mark.parametrize("layout,how", CASES)
def test_a_damaged_checkpoint_is_passed_over_on_resume_and_refused_where_named(layout, how, runs, tmp_path):
    run = runs(layout)
    out, name = damaged_copy(run, tmp_path, layout, how)
    step8, step4 = out / "checkpoints" / "step-8", out / "checkpoints" / "step-4"
    problem = damage(step8)
    assert re.fullmatch(f"{re.escape(name)} {DAMAGE[how][1]}", problem), problem
    assert damage(step4) is None

    where, line = resolve_resume(out, "auto")  # `--resume_from_checkpoint auto`, and the same command again
    assert where == (out / "checkpoints", "step-4")
    assert line == f"resume: {step8} is damaged ({problem}); using step-4, the newest intact checkpoint"

    # the user's own path to it: one line, before any process group (as rank 0 of the run's 2 ranks)
    told = refusal(*train_args(run), "--output_dir", out, "--resume_from_checkpoint", step8, world=2)
    damaged = f"{step8} is damaged: {problem}; the newest intact checkpoint before it is {step4}"
    assert told == f"error: --resume_from_checkpoint {step8}: {damaged}"

    before = sorted(os.listdir(tmp_path))
    proc = tool_in_process("export_hf", out, tmp_path / "hf")  # the run's newest checkpoint: step-8
    assert (proc.returncode, proc.stderr, proc.stdout) == (2, f"error: {damaged}\n", "")
    assert sorted(os.listdir(tmp_path)) == before  # nothing written, not even a scratch directory


def test_with_no_intact_checkpoint_the_same_command_again_is_one_line(runs, tmp_path):
    run = runs("zero2")
    out, name = damaged_copy(run, tmp_path, "zero2", "truncated")
    (out / "checkpoints" / "step-4" / "rng_state_0.pt").unlink()
    told = refusal(*train_args(run), "--output_dir", out, world=2)
    assert told.startswith(f"error: no intact checkpoint to resume from: {out / 'checkpoints' / 'step-8'} is damaged ")
    assert f"({name} is " in told and "step-4 is damaged (rng_state_0.pt is missing)" in told
    assert told.endswith("Start over with --overwrite_output_dir, or train into another --output_dir")


@pytest.mark.parametrize("layout,how", [("zero2", "truncated"), ("zero3", "missing"), ("tp2-zero2", "zero-byte")])
def test_the_same_command_again_resumes_bit_for_bit_from_the_newest_intact_checkpoint(layout, how, runs, tmp_path):
    run = runs(layout)
    out, name = damaged_copy(run, tmp_path, layout, how)
    step8 = out / "checkpoints" / "step-8"
    again = launch(train_args(run), out, launcher="forked").check()
    assert f"resume: {step8} is damaged ({name} " in again.log
    assert "; using step-4, the newest intact checkpoint" in again.log
    assert f"resume: loaded {out / 'checkpoints' / 'step-4'} at step 4" in again.log
    assert step_losses(again) == step_losses(run)  # steps 5-8 trained again, exactly as the first time
    assert damage(step8) is None  # saved again, whole


@pytest.mark.parametrize("layout", sorted(TARGETS))
def test_a_checkpoint_saved_before_manifests_is_trusted_as_before_less_what_needs_none(layout, runs, tmp_path):
    run = runs(layout)
    out = tmp_path / "run"
    shutil.copytree(run.output_dir, out)
    for step in (out / "checkpoints").glob("step-*"):  # as the save wrote them before manifests existed
        (step / "manifest.json").unlink()
        layout_file = step / "layout.json"
        layout_file.write_text(
            json.dumps({k: v for k, v in json.loads(layout_file.read_text()).items() if k != "manifest"})
        )
    step8 = out / "checkpoints" / "step-8"
    assert resolve_resume(out, "auto") == ((out / "checkpoints", "step-8"), None)
    DAMAGE["truncated"][0](step8 / TARGETS[layout]["truncated"])  # a cut .pt file: its zip directory is gone
    where, line = resolve_resume(out, "auto")
    assert where == (out / "checkpoints", "step-4")
    assert f"({TARGETS[layout]['truncated']} cannot be read as torch.save wrote it (" in line
