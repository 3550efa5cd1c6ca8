"""What --overwrite_output_dir may remove: only the entries a run recorded in run_files.json (run_dir.py)."""

import pytest

from helpers import file_tree
from zero_recipes.checkpointing import run_dir
from zero_recipes.config.train_config import ConfigError

SIGNATURE = {"learning_rate": 3e-4}
# One user file under every name a run or its export may write, as a user might have them.
EXPORT_NAMES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model-00001-of-00002.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "adapter_config.json",
    "adapter_model.safetensors",
    "README.md",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "spiece.model",
    "run_config.json",
    "metrics.jsonl",
    "checkpoints",
]


def a_finished_run(out, user_files=("notes.txt",)):
    """What a finished run leaves (the manifest as start_run and the export record it), plus user files."""
    out.mkdir()
    for name in user_files:
        (out / name).write_text("mine")
    run_dir.record(out, run_dir.RUN_ENTRIES)
    run_dir.write_run_config(out, SIGNATURE, {"train_batch_size": 4})
    (out / "checkpoints" / "step-2").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("step-2")
    (out / "metrics.jsonl").write_text("{}\n")
    with run_dir.recording(out, rank=0):
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (out / name).write_text("exported")
    return out


@pytest.mark.parametrize("name", EXPORT_NAMES)
def test_a_user_file_under_a_name_the_run_writes_is_refused_with_or_without_overwrite(tmp_path, name):
    out = tmp_path / "mydir"
    out.mkdir()
    (out / "notes.txt").write_text("notes")
    target = out / name
    if name == "checkpoints":
        target.mkdir()
        (target / "mine.bin").write_bytes(b"x")
    else:
        target.write_text('{"a": 1}')
    before = file_tree(out)
    for overwrite in (True, False):
        with pytest.raises(ConfigError) as e:
            run_dir.check_output_dir(out, SIGNATURE, overwrite, None)
        assert "\n" not in str(e.value)
        if overwrite:
            assert name in str(e.value) and "did not write" in str(e.value)
    assert file_tree(out) == before


def test_overwrite_removes_only_what_the_run_recorded(tmp_path):
    out = a_finished_run(tmp_path / "run", user_files=("notes.txt", "my_eval.py"))
    (out / "data").mkdir()
    (out / "data" / "train.jsonl").write_text("{}")
    (out / "wandb").mkdir()  # an offline W&B run, maybe not synced
    assert run_dir.user_entries(out) == ["data", "my_eval.py", "notes.txt"]
    other = {"learning_rate": 1e-4}
    with pytest.raises(ConfigError, match="different run"):
        run_dir.check_output_dir(out, other, False, None)
    assert run_dir.check_output_dir(out, other, True, None) is None
    mine = {k: v for k, v in file_tree(out).items() if k.split("/")[0] in ("data", "my_eval.py", "notes.txt")}
    run_dir.clear_previous_run(out)
    assert sorted(p.name for p in out.iterdir()) == ["data", "my_eval.py", "notes.txt", "run_files.json", "wandb"]
    assert {k: v for k, v in file_tree(out).items() if k not in ("run_files.json", "wandb")} == mine  # byte for byte
    (out / "config.json").write_text("mine now")  # a name the cleared run no longer owns
    assert "config.json" in run_dir.user_entries(out)


def test_a_file_added_after_the_run_is_the_users(tmp_path):
    out = a_finished_run(tmp_path / "run")
    (out / "plot_by_me.png").write_bytes(b"png")
    (out / "README.md").write_text("my notes on this run")  # a name PEFT's export writes, but not this run's
    with pytest.raises(ConfigError, match="README.md"):
        run_dir.check_output_dir(out, SIGNATURE, True, None)
    (out / "README.md").unlink()
    assert run_dir.check_output_dir(out, SIGNATURE, False, None) == "auto"  # the same run, relaunched
    run_dir.clear_previous_run(out)
    assert (out / "plot_by_me.png").read_bytes() == b"png" and (out / "notes.txt").read_text() == "mine"


def test_a_run_from_before_the_manifest_owns_only_the_names_a_run_writes(tmp_path):
    out = tmp_path / "old-run"
    out.mkdir()
    run_dir.write_run_config(out, SIGNATURE, {})
    for name in ("config.json", "model.safetensors", "metrics.jsonl", "notes.txt"):
        (out / name).write_text("x")
    assert run_dir.user_entries(out) == ["notes.txt"]
    run_dir.clear_previous_run(out)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_an_unreadable_manifest_owns_nothing(tmp_path):
    out = a_finished_run(tmp_path / "run")
    (out / "run_files.json").write_text("{not json")
    run_dir.clear_previous_run(out)
    assert (out / "config.json").exists() and (out / "notes.txt").exists()  # nothing removed on a guess
