"""The resolved run plan: built once from the command line, completed once with the step count."""

import pytest

from zero_recipes.config import ConfigError
from zero_recipes.plan import RunPlan

ZERO3 = ["--deepspeed", "ds_configs/zero3.json"]


def test_plan_adopts_the_deepspeed_files_values_and_completes_once():
    plan = RunPlan.from_args(ZERO3 + ["--max_steps", "0", "--num_train_epochs", "2", "--warmup_ratio", "0.1"])
    assert plan.total_steps is None and plan.zero_stage == 3 and plan.precision == "fp32"
    done = plan.complete(plan.steps_to_train(micro_batches_per_rank=50))
    assert done.total_steps == 100  # 2 epochs x 50 micro-batches per rank, no accumulation
    assert plan.total_steps is None  # the plan itself is frozen; complete returns a new one
    with pytest.raises(RuntimeError, match="twice"):
        done.complete(100)


def test_scheduler_steps_are_filled_when_the_plan_completes(tmp_path):
    sched = tmp_path / "sched.json"
    sched.write_text(
        '{"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": "auto", '
        '"total_num_steps": "auto", "warmup_max_lr": "auto"}}}'
    )
    plan = RunPlan.from_args(ZERO3 + [str(sched), "--max_steps", "40", "--warmup_steps", "4"])
    assert plan.ds["scheduler"]["params"]["total_num_steps"] == "auto"
    done = plan.complete(40)
    assert done.ds["scheduler"]["params"] == {
        "warmup_num_steps": 4,
        "total_num_steps": 40,
        "warmup_max_lr": 2e-3,
        "warmup_min_lr": 0,
    }


def test_signature_ignores_launch_controls_and_records_the_files_as_given():
    a = RunPlan.from_args(ZERO3 + ["--output_dir", "/tmp/a", "--logging_steps", "3"])
    b = RunPlan.from_args(ZERO3 + ["--output_dir", "/tmp/b", "--logging_steps", "7"])
    c = RunPlan.from_args(ZERO3 + ["--learning_rate", "1e-4"])
    assert a.signature == b.signature != c.signature
    assert a.signature["deepspeed"]["zero_optimization"]["reduce_bucket_size"] == "auto"  # raw, not resolved


def test_an_auto_nobody_can_fill_fails_before_anything_runs(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"zero_optimization": {"sub_group_size": "auto"}}')
    with pytest.raises(ConfigError, match="sub_group_size"):
        RunPlan.from_args(ZERO3 + [str(bad), "--max_steps", "0"])
