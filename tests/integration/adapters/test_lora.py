"""LoRA (peft) on every ZeRO stage, trained for real on 2 CPU ranks from a pretrained base (the session's
zero3 fp32 run, a quick-start-like model directory). Loss parity with ZeRO-0, bitwise resume after a kill,
the export and another world size are the LoRA and QLoRA rows of the contract table (tests/contract.py);
here: checkpoints without the frozen base, adapters that are never saved empty, bf16, merging, SFT, refusals."""

import json
import shutil
from pathlib import Path

import pytest

import contract
from contract import BY_NAME, LORA_BASE, QLORA_BASE
from helpers import (
    CONFIGS,
    EXPORT_TOL,
    FAST,
    PRECISIONS,
    launch,
    one_error_line,
    refusal,
    run_train,
    tool_in_process,
)

BF16_TOL = 2e-3  # against LoRA's fp32 ZeRO-0 run
LORA = [*contract.LORA, "--save_steps", "4", "--verify_export"]


@pytest.fixture(scope="module")
def base(bases):
    return Path(bases((LORA_BASE,))[LORA_BASE])


@pytest.fixture(scope="module")
def base64(bases):
    """A base whose layers are 64 wide, as bitsandbytes' CPU 4-bit kernel needs (conftest.make_qlora_base)."""
    return Path(bases((QLORA_BASE,))[QLORA_BASE])


@pytest.fixture(scope="module")
def lora_run(mode_run):
    """A LoRA row's run of the contract table (tests/contract.py), which checks its parity, resume and export."""
    return lambda name: mode_run(BY_NAME[f"lora-{name}"])


@pytest.fixture(scope="module")
def bf16_lora(base, tmp_path_factory):
    args = FAST + ["--deepspeed", *CONFIGS["zero3"], *PRECISIONS["bf16"], "--model_name_or_path", str(base)]
    return launch(args + LORA, tmp_path_factory.mktemp("lora-zero3-bf16") / "run", launcher="forked")


def export_diff(run) -> float:
    diff = [r["export_max_abs_logit_diff"] for r in run.records if "export_max_abs_logit_diff" in r]
    assert diff, run.log[-3000:]
    return diff[0]


def test_lora_on_zero0_the_rows_baseline_exports_its_adapter(baseline_run):
    """The LoRA rows' baseline is LoRA on ZeRO-0, whose own export the contract's export column does not read."""
    run = baseline_run(BY_NAME["lora-zero1"]).check()
    assert "lora: r 8, alpha 16 on all-linear; trains" in run.log and "the base frozen" in run.log
    assert (run.output_dir / "adapter_config.json").is_file() and not (run.output_dir / "model.safetensors").exists()
    assert export_diff(run) <= EXPORT_TOL["fp32"]


def test_bf16_lora_matches_fp32_and_keeps_no_fp32_copy_of_the_base(bf16_lora, baseline_run):
    import torch

    run = bf16_lora.check()
    ref = baseline_run(BY_NAME["lora-zero3"]).check().losses
    worst = max(abs(a - b) for a, b in zip(run.losses, ref))
    assert worst <= BF16_TOL, f"bf16 LoRA diverges from fp32 by {worst:.3g}"
    assert export_diff(run) <= EXPORT_TOL["bf16"]
    # DeepSpeed's fp32 master copy (ZeRO-3's fp32 partitions in the optimizer state) covers the adapters only
    ckpt = run.output_dir / "checkpoints" / "step-8"
    fp32 = 0
    for f in ckpt.glob("*optim_states.pt"):
        groups = torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"]["fp32_flat_groups"]
        fp32 += sum(g.numel() for g in groups)
    trainable = int(run.log.split("lora: ")[1].split("trains ")[1].split(" of ")[0].replace(",", ""))
    assert trainable <= fp32 < trainable + 2 * 64, (fp32, trainable)  # partitions are padded per rank


def test_zero3_adapter_is_gathered_not_saved_empty(lora_run, base):
    """The best-known LoRA + ZeRO-3 failure: save_pretrained writes the partitions' empty placeholders."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    run = lora_run("zero3").check()
    saved = load_file(run.output_dir / "adapter_model.safetensors")
    assert len(saved) == 2 * 7 * 4  # lora_A and lora_B on q, k, v, o, gate, up, down of 4 layers
    engine = get_fp32_state_dict_from_zero_checkpoint(
        str(run.output_dir / "checkpoints"), tag="step-8", exclude_frozen_parameters=True
    )
    for key, tensor in saved.items():
        assert tensor.numel() > 0 and tensor.abs().max() > 0, key
        ref = engine[key.replace(".weight", ".default.weight")]
        assert tensor.shape == ref.shape and (tensor == ref).all(), key
    config = json.loads((run.output_dir / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base.resolve()) and config["r"] == 8


def test_checkpoint_holds_the_adapter_not_the_base(lora_run, trained):
    def size(run):
        return sum(f.stat().st_size for f in (run.output_dir / "checkpoints" / "step-8").rglob("*") if f.is_file())

    lora, full = size(lora_run("zero3").check()), size(trained("zero3", "fp32").check())
    print(f"checkpoint size: LoRA {lora / 1e6:.2f} MB, full {full / 1e6:.2f} MB, ratio {lora / full:.3f}")
    assert lora < 0.15 * full


def test_merge_lora_writes_a_plain_model_with_the_engines_logits(base, tmp_path):
    from transformers import AutoModelForCausalLM

    args = FAST + ["--deepspeed", *CONFIGS["zero3"], "--model_name_or_path", str(base), *LORA, "--merge_lora"]
    run = launch(args, tmp_path / "run", launcher="forked").check()
    assert "the adapter merged into its base" in run.log
    assert not (run.output_dir / "adapter_config.json").exists()
    assert export_diff(run) <= EXPORT_TOL["fp32"]
    model = AutoModelForCausalLM.from_pretrained(run.output_dir)
    assert not any("lora" in n for n, _ in model.named_parameters())


def test_lora_sft_packed_with_checkpointing_offload_and_bf16(base, tmp_path):
    args = FAST + [
        "--deepspeed",
        *CONFIGS["zero3+offload_all"],
        *PRECISIONS["bf16"],
        "--model_name_or_path",
        str(base),
        *LORA,
        "--dataset_name",
        "builtin:tiny-instructions",
        "--block_size",
        "128",
        "--gradient_checkpointing",
        "--modules_to_save",
        "lm_head",
    ]
    run = launch(args, tmp_path / "run", launcher="forked").check()
    losses = run.losses
    assert len(losses) == 8 and sum(losses[-2:]) / 2 < losses[0] - 1.0, losses
    assert export_diff(run) <= EXPORT_TOL["bf16"]
    from safetensors.torch import load_file

    saved = load_file(run.output_dir / "adapter_model.safetensors")
    head = [k for k in saved if "lm_head" in k]
    assert head and all(saved[k].numel() > 0 for k in head)  # the fully trained head is saved with the adapter


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--lora_r", "-1"], ["--lora_r must be >= 0"]),
        (["--lora_r", "8", "--lora_alpha", "0"], ["--lora_alpha must be > 0"]),
        (["--merge_lora"], ["--merge_lora needs LoRA"]),
        (["--lora_r", "8", "--lora_target_modules", "q_proj", "qkv_proj"], ["no module 'qkv_proj'", "q_proj"]),
        (["--lora_r", "8", "--modules_to_save", "score"], ["--modules_to_save", "no module 'score'"]),
    ],
)
def test_bad_lora_options_are_one_line(base, args, fragments):
    line = refusal("--deepspeed", "ds_configs/zero2.json", "--model_name_or_path", str(base), *args)
    assert all(f in line for f in fragments), line


def test_lora_needs_a_pretrained_base():
    """Through a real process: a LoRA refusal reaches the shell as one line and exit 2 (the others in-process)."""
    proc = run_train("--deepspeed", "ds_configs/zero2.json", "--lora_r", "8", "--dry_run")
    assert "set --model_name_or_path" in one_error_line(proc) and proc.returncode == 2


def test_resuming_with_other_lora_settings_is_refused(lora_run, base, tmp_path):
    """(Another world size: the lora-zero2 row's layout column, tests/contract.py.)"""
    run = lora_run("zero2").check()
    out = tmp_path / "run"
    shutil.copytree(run.output_dir, out)
    args = FAST + ["--deepspeed", *CONFIGS["zero2"], "--model_name_or_path", str(base), *LORA]
    line = refusal(*args, "--lora_r", "4", "--resume_from_checkpoint", "auto", "--output_dir", str(out))
    assert "other adapter settings (lora_r)" in line


def test_export_tool_and_generate_take_a_lora_run(lora_run, tmp_path):
    """tools/export_hf.py turns the LoRA checkpoint into the adapter train.py exported (or a merged model);
    tools/generate.py samples from the adapter directory. In this process (helpers.tool_in_process): that
    both tools' exit codes and lines reach the shell is test_export_tool.py's and test_plot_and_generate.py's."""
    from safetensors.torch import load_file

    run = lora_run("zero3").check()
    adapter = tool_in_process("export_hf", run.output_dir, tmp_path / "adapter")
    assert adapter.returncode == 0 and "PeftModel.from_pretrained" in adapter.stdout, adapter.stderr[-2000:]
    want, got = (
        load_file(run.output_dir / "adapter_model.safetensors"),
        load_file(tmp_path / "adapter" / "adapter_model.safetensors"),
    )
    assert sorted(got) == sorted(want) and all((got[k] == want[k]).all() for k in want)
    merged = tool_in_process("export_hf", run.output_dir, tmp_path / "merged", "--merge")
    assert merged.returncode == 0 and (tmp_path / "merged" / "model.safetensors").is_file(), merged.stderr[-2000:]
    text = tool_in_process("generate", run.output_dir, "Return the", "--max_new_tokens", "8")
    assert text.returncode == 0 and text.stdout.strip(), text.stderr[-2000:]


def test_the_qlora_checkpoint_holds_no_4bit_base(mode_run):
    """QLoRA's parity with ZeRO-0 and its export are the qlora-zero2 row's (tests/contract.py)."""
    ckpt = mode_run(BY_NAME["qlora-zero2"]).check().output_dir / "checkpoints" / "step-8"
    assert sum(f.stat().st_size for f in ckpt.glob("*model_states.pt")) < 2e6


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--load_in_4bit"], "set --lora_r"),
        (["--lora_r", "8", "--load_in_4bit", "--deepspeed", "ds_configs/zero3.json"], "not supported here"),
    ],
)
def test_qlora_where_it_cannot_run_is_one_line(base64, args, fragment):
    line = refusal("--deepspeed", "ds_configs/zero2.json", "--model_name_or_path", str(base64), *args)
    assert fragment in line, line


def test_qlora_on_a_cpu_needs_64_wide_layers(base):
    line = refusal("--deepspeed", "ds_configs/zero2.json", "--model_name_or_path", str(base), "--lora_r", "8", "--load_in_4bit")  # fmt: skip
    assert "down_proj (352)" in line and "without --load_in_4bit" in line
