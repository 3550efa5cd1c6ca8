"""The resolved run plan: built once from the command line, completed once with the step count."""

import pytest

from helpers import dry_run_in_process, refusal
from zero_recipes.config.train_config import ConfigError
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


# ---- what the plan and --dry_run check before any process group ------------------------------------------
# (every case through train.main in this process: helpers.refusal and dry_run_in_process)

BLOOM = '{"model_type": "bloom", "hidden_size": 64, "n_layer": 2, "n_head": 4, "vocab_size": 4096}'


def _flash_installed(version: int) -> bool:
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

    return {2: is_flash_attn_2_available, 3: is_flash_attn_3_available}[version]()


def _on_cpu() -> bool:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cpu"


@pytest.mark.parametrize(
    "args,words",
    [
        pytest.param(
            ["--attn_implementation", "flash_attention_2"],
            "flash_attention_2 cannot be used: the package for FlashAttention2 doesn't seem to be installed; "
            "install it, or use --attn_implementation sdpa",
            marks=pytest.mark.skipif(_flash_installed(2), reason="flash-attn is installed here"),
            id="flash2-not-installed",
        ),
        pytest.param(
            ["--attn_implementation", "flash_attention_3"],
            "the package for FlashAttention3 doesn't seem to be installed",
            marks=pytest.mark.skipif(_flash_installed(3), reason="flash-attn 3 is installed here"),
            id="flash3-not-installed",
        ),
        pytest.param(
            ["--attn_implementation", "flex_attention"],
            "flex_attention cannot train on cpu: torch's FlexAttention has no backward there",
            marks=pytest.mark.skipif(not _on_cpu(), reason="flex_attention trains on this accelerator"),
            id="flex-on-cpu",
        ),
        pytest.param(
            ["--model_config", BLOOM],  # the default sdpa, on a class without it
            "sdpa cannot be used: BloomForCausalLM does not support an attention implementation through "
            "torch.nn.functional.scaled_dot_product_attention yet; use --attn_implementation eager",
            id="sdpa-unsupported-by-the-model",
        ),
        pytest.param(
            ["--model_config", BLOOM, "--attn_implementation", "flash_attention_2"],
            "BloomForCausalLM does not support Flash Attention 2 yet",
            id="flash2-unsupported-by-the-model",
        ),
        pytest.param(
            ["--attn_implementation", "flash"],
            'Specified `attn_implementation="flash"` is not supported; use --attn_implementation sdpa '
            "(LlamaForCausalLM supports eager, sdpa",
            id="unknown-value",
        ),
    ],
)
def test_an_attention_that_cannot_run_is_refused_in_one_line_even_in_a_dry_run(args, words):
    assert words in refusal(*args, "--dry_run")
    assert words in refusal(*args, "--deepspeed", "ds_configs/zero2.json")  # and before a real run's process group


def test_an_attention_that_runs_is_planned():
    assert "plan: model llama" in dry_run_in_process("--attn_implementation", "eager")
    assert "plan: model bloom" in dry_run_in_process("--model_config", BLOOM, "--attn_implementation", "eager")


@pytest.mark.parametrize(
    "content,words",
    [
        (None, "dataset '{path}' does not exist; give an existing file"),
        ("", "dataset file '{path}' is empty"),
        ('{"txt": "a"}\n', "dataset '{path}' has no column 'text' (columns: txt)"),
        ('{"messages": [{"role": "human", "content": "hi"}]}\n', "dataset '{path}', example 1: unknown chat role"),
        ('{"text": "a"}\n{"text": \n', "{path}:2:"),  # the line that is not JSON, named
    ],
    ids=["missing", "empty", "no-text-column", "bad-chat-role", "bad-json-line"],
)
def test_a_dry_run_reads_the_data_and_refuses_what_training_would(tmp_path, content, words):
    path = tmp_path / "data.jsonl"
    if content is not None:
        path.write_text(content)
    assert words.format(path=path) in refusal("--dataset_name", path, "--dry_run")


def test_a_dry_run_says_what_it_read_and_what_a_launch_does_with_output_dir(tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}]}\n' * 40)
    out = dry_run_in_process("--dataset_name", data, "--output_dir", tmp_path / "run")
    assert f"data: {data}: the first 16 rows of train read; detected format 'messages'" in out
    assert f"output: {tmp_path / 'run'}: a launch trains from scratch" in out
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "notes.txt").write_text("mine")
    assert "holds no zero-recipes run" in refusal("--output_dir", tmp_path / "theirs", "--dry_run")


def test_offline_a_hub_model_without_a_shipped_architecture_is_refused_at_once(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # what HF_HUB_OFFLINE=1 sets when it is imported
    line = refusal("--model_name_or_path", "some-org/some-model", "--dry_run")
    assert (
        "cannot read the config of some-org/some-model: HF_HUB_OFFLINE is set, and it is not in the local cache" in line
    )
    assert "give its config.json (with model_type) as --model_config" in line
