"""One run per output_dir: relaunching continues or finishes, another run is refused, resume is exact."""

import json

from helpers import FAST, launch, refusal

ZERO2 = ["--deepspeed", "ds_configs/zero2.json"]


def test_relaunch_finishes_and_second_launch_uses_the_data_cache(tmp_path):
    out = tmp_path / "run"
    env = {"ZERO_RECIPES_CACHE": str(tmp_path / "cache")}  # a cold cache of its own
    first = launch(FAST + ZERO2, out, env=env).check()
    assert "tokenisation skipped" not in first.log and "cached at" in first.log
    n_records = len(first.records)
    again = launch(FAST + ZERO2, out, env=env).check()  # the quick start, run twice
    assert "tokenisation skipped" in again.log
    assert "resume: loaded" in again.log and "nothing left to train" in again.log
    assert len([r for r in again.records if "loss" in r]) == len(first.losses)  # no step trained twice
    assert len(again.records) >= n_records
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()


def test_different_run_is_refused_unless_overwrite(tmp_path):
    out = tmp_path / "run"
    launch(FAST + ZERO2 + ["--max_steps", "2"], out, launcher="forked").check()
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    refused = launch(FAST + ZERO2 + ["--max_steps", "2", "--learning_rate", "1e-4"], out)  # the shell's view
    assert refused.proc.returncode != 0
    assert "holds a different run (changed: learning_rate)" in refused.log
    assert "Traceback" not in refused.log
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before  # nothing of the old run lost
    old_events = list((out / "tensorboard").glob("events.*"))
    (out / "plots").mkdir()
    (out / "plots" / "loss.png").write_bytes(b"old chart")  # what tools/plot_metrics.py leaves by default
    (out / "notes.txt").write_text("mine")
    (out / "data").mkdir()
    (out / "data" / "train.jsonl").write_text('{"text": "mine"}\n')
    overwrite = ["--max_steps", "2", "--learning_rate", "1e-4", "--overwrite_output_dir"]
    over = launch(FAST + ZERO2 + overwrite, out, launcher="forked")
    assert "resume: loaded" not in over.check().log
    assert "output_dir: 2 entries this project did not write stay untouched: data, notes.txt" in over.log
    assert (out / "data" / "train.jsonl").read_text() == '{"text": "mine"}\n'
    written = json.loads((out / "run_files.json").read_text())["written"]  # what a later overwrite may remove
    assert {"config.json", "model.safetensors", "tokenizer.json", "checkpoints"} <= set(written)
    assert not {"notes.txt", "data"} & set(written)
    assert [r["step"] for r in over.records if "loss" in r] == [1, 2]
    # the old run's derived files go (TensorBoard would draw both runs as one line); the user's stay
    events = list((out / "tensorboard").glob("events.*"))
    assert len(old_events) == 1 and len(events) == 1 and events != old_events
    assert not (out / "plots").exists() and (out / "notes.txt").read_text() == "mine"


def test_overwrite_refuses_to_replace_a_users_file_under_an_export_name(tmp_path):
    """Issue 29's first finding: a folder of the user's with a config.json of their own, and the flag the
    refusal suggests. The export would replace config.json, so it is refused, naming it; nothing changes."""
    out = tmp_path / "mydir"
    out.mkdir()
    (out / "config.json").write_text('{"a":1}')
    (out / "notes.txt").write_text("notes")
    line = refusal(*FAST, *ZERO2, "--output_dir", out, "--overwrite_output_dir", world=2)
    assert "did not write under names its run and export write: config.json;" in line
    assert (out / "config.json").read_text() == '{"a":1}' and (out / "notes.txt").read_text() == "notes"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "notes.txt"]
