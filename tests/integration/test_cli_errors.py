"""Bad input: exit non-zero with one line that names the problem and the fix, and no traceback.

The first test runs train.py as a process, so the shell sees the one line and exit 2; the refusals after it
happen before any process group and are checked in this process (helpers.refusal), as train.py's entry point
meets them. The vocabulary refusal comes after the data is prepared and stays a process."""

from helpers import dry_run_in_process, one_error_line, refusal, run_train


def test_missing_ds_config():
    proc = run_train("--deepspeed", "ds_configs/zero9.json", "--dry_run")
    line = one_error_line(proc)
    assert "'ds_configs/zero9.json' not found" in line and "zero3.json" in line
    assert proc.returncode == 2


def test_malformed_ds_config_gives_line_and_column(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "train_batch_size": "auto",\n  "zero_optimization": {"stage": 2,,}\n}\n')
    line = refusal("--deepspeed", str(bad), "--dry_run")
    assert f"{bad}:3:" in line and "invalid JSON" in line


def test_unknown_recipe_key(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("learning_rat: 1.0e-4\n")
    line = refusal("--recipe", str(recipe), "--deepspeed", "ds_configs/zero2.json", "--dry_run")
    assert "unknown option 'learning_rat'" in line and "did you mean 'learning_rate'" in line


def test_batch_arithmetic_that_does_not_add_up(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(
        '{"train_batch_size": 48, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}'
    )
    line = refusal("--deepspeed", str(ds), "--per_device_train_batch_size", "4", "--dry_run")
    assert "train_batch_size=48" in line and "= 4" in line


def test_fp16_and_bf16_both_on(tmp_path):
    line = refusal("--deepspeed", "ds_configs/zero2.json", "--bf16", "--fp16", "--dry_run")
    assert "bf16 and fp16 are both on" in line
    both = tmp_path / "both.json"
    both.write_text('{"bf16": {"enabled": true}, "fp16": {"enabled": true}}')
    line = refusal("--deepspeed", "ds_configs/zero2.json", str(both), "--dry_run")
    assert "bf16 and fp16 are both enabled" in line


def test_block_size_above_max_positions():
    line = refusal("--deepspeed", "ds_configs/zero2.json", "--block_size", "4096", "--dry_run")
    assert "block_size 4096 exceeds the model's max_position_embeddings 1024" in line


def test_no_deepspeed_config():
    line = refusal("--max_steps", "1")
    assert "--deepspeed ds_configs/zero3.json" in line


def test_missing_dataset_file(tmp_path):
    out = tmp_path / "out"
    line = refusal("--deepspeed", "ds_configs/zero2.json", "--dataset_name", str(tmp_path / "nope.jsonl"), "--output_dir", str(out))  # fmt: skip
    assert "does not exist" in line and not out.exists()


def test_output_dir_with_foreign_files_is_refused_and_kept(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.txt").write_text("precious")
    line = refusal("--deepspeed", "ds_configs/zero2.json", "--output_dir", str(out))
    assert "holds no zero-recipes run" in line and "--overwrite_output_dir" in line
    assert (out / "thesis.txt").read_text() == "precious"


def test_model_config_vocab_smaller_than_the_tokenizer(tmp_path):
    """A random-init architecture whose vocab cannot hold the tokenizer's ids fails before anything is
    written, not with an embedding index error mid-step."""
    small = (
        '{"model_type": "llama", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64, '
        '"num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}'
    )
    out = tmp_path / "run"
    proc = run_train(
        "--model_config",
        small,
        "--deepspeed",
        "ds_configs/zero2.json",
        "--max_steps",
        "1",
        "--block_size",
        "32",
        "--report_to",
        "none",
        "--output_dir",
        str(out),
    )
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]  # after the data's progress bars
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(errors) == 1, proc.stderr[-3000:]
    assert "tokenizer has 4096 tokens but the model's vocab_size is 100" in errors[0]
    assert not out.exists()


def test_output_dir_that_is_a_file_or_not_writable(tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("the user's file")
    line = refusal("--deepspeed", "ds_configs/zero2.json", "--output_dir", str(a_file))
    assert f"--output_dir {a_file} is a file, not a directory" in line
    assert a_file.read_text() == "the user's file"
    # sysfs refuses new files even to root, as a read-only mount does
    line = refusal("--deepspeed", "ds_configs/zero2.json", "--output_dir", "/sys/zero-recipes-run")
    assert "cannot write in /sys" in line and "choose a directory you can write to" in line


def test_deepspeed_path_that_is_a_directory():
    line = refusal("--deepspeed", "ds_configs", "--dry_run")
    assert "--deepspeed ds_configs is a directory" in line and "zero3.json" in line


def test_nvme_path_that_does_not_exist_is_not_created(tmp_path):
    nvme, out = tmp_path / "nvme", tmp_path / "out"
    line = refusal(
        "--deepspeed", "ds_configs/zero3.json", "ds_configs/nvme.json", "--nvme_path", str(nvme),
        "--output_dir", str(out),
    )  # fmt: skip
    assert f"nvme_path {nvme} does not exist; create it on the NVMe drive" in line
    assert not nvme.exists() and not out.exists()


def test_dry_run_warns_what_this_machine_cannot_train(tmp_path):
    nvme = tmp_path / "nvme"
    out = dry_run_in_process("--deepspeed", "ds_configs/zero3.json", "ds_configs/nvme.json", "--nvme_path", str(nvme))
    assert f"warning: this machine cannot train it: nvme_path {nvme} does not exist" in out
    assert not nvme.exists()
