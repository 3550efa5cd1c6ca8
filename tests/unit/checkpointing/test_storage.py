"""Writes meeting a full or read-only filesystem (a real tmpfs, mounted here as root), in this process: what the
writers' failures look like, and that each write leaves the previous whole file, never half a new one. The
launches that meet the same faults (a checkpoint save on 2 ranks, the data cache, the tools) are
tests/integration/checkpointing/test_storage_faults.py."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from helpers import fill, read_only, resize, tmpfs
from zero_recipes.checkpointing import atomic, storage
from zero_recipes.checkpointing.export import state_bytes, write_model_dir
from zero_recipes.evaluation import side_by_side
from zero_recipes.training.metrics_log import MetricsLog


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tiny_model(seed: int):
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, vocab_size=4096
    )
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("writer", ["torch.save", "np.save"])
def test_a_full_disk_is_recognised_in_each_writers_words(tmp_path, writer):
    """torch.save reports ENOSPC as an errno-less RuntimeError ("unexpected pos"), numpy as an errno-less OSError
    ("N requested and M written"): both are read as a full disk, diagnosed while the disk is still full."""
    with tmpfs(tmp_path / "disk", "1M") as disk:
        data = np.ones(1 << 19, dtype=np.float32)  # 2 MiB
        with pytest.raises(Exception) as caught:
            torch.save(torch.from_numpy(data), disk / "t.pt") if writer == "torch.save" else np.save(
                disk / "a.npy", data
            )
        failure = storage.failure_of(caught.value, "saving", disk)
        assert failure == ("saving", str(disk), "no space left on device")
        line = storage.describe(failure, needed=2 << 20)
        assert "no space left on device" in line and "of 1.0 MiB" in line and "needs about 2.0 MiB" in line
        assert "free space there or point --output_dir at a larger disk" in line


def test_a_bug_is_not_a_full_disk(tmp_path):
    assert storage.failure_cause(ValueError("bad")) is None
    assert storage.failure_cause(OSError("Can't load tokenizer for 'x'")) is None  # transformers' missing files
    with pytest.raises(KeyError):
        storage.attempt(lambda: {}["x"], "saving", tmp_path)


def test_an_export_on_a_full_disk_keeps_the_previous_one(tmp_path):
    """train.py's export (write_model_dir, the HF model and the PEFT adapter alike): the new weights do not fit,
    so the old model.safetensors stays byte for byte, loads, and no staging directory is left."""
    with tmpfs(tmp_path / "disk", "6M") as disk:  # two exports fit: the old one and the staged new one
        out = disk / "run"
        first = tiny_model(0)
        write_model_dir(out, 0, lambda stage: first.save_pretrained(stage), state_bytes(first.state_dict()))
        before = {p.name: digest(p) for p in out.iterdir()}
        filler = fill(disk, leave=256 << 10)
        second = tiny_model(1)
        with pytest.raises(storage.StorageError) as caught:
            write_model_dir(out, 0, lambda stage: second.save_pretrained(stage), state_bytes(second.state_dict()))
        line = str(caught.value)
        assert line.startswith(f"export failed: cannot write {out}: no space left on device")
        assert f"needs about {storage.human(state_bytes(second.state_dict()))}" in line  # its weights' size
        assert "previous files are untouched" in line and "export_hf.py" in line
        assert {p.name: digest(p) for p in out.iterdir()} == before  # nothing staged left, nothing replaced
        loaded = AutoModelForCausalLM.from_pretrained(out)
        assert torch.equal(loaded.model.embed_tokens.weight, first.model.embed_tokens.weight)
        filler.unlink()  # room again: the next export replaces the old one whole
        write_model_dir(out, 0, lambda stage: second.save_pretrained(stage))
        loaded = AutoModelForCausalLM.from_pretrained(out)
        assert torch.equal(loaded.model.embed_tokens.weight, second.model.embed_tokens.weight)
        read_only(disk)
        with pytest.raises(storage.StorageError, match="read-only file system.*remount it read-write"):
            write_model_dir(out, 0, lambda stage: first.save_pretrained(stage))


def test_a_peft_adapter_on_a_full_disk_keeps_the_previous_one(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    with tmpfs(tmp_path / "disk", "2M") as disk:
        base = tmp_path / "base"
        tiny_model(0).save_pretrained(base)
        adapted = get_peft_model(
            AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=64, target_modules="all-linear")
        )
        out = disk / "adapter"
        write_model_dir(out, 0, lambda stage: adapted.save_pretrained(stage))
        before = {p.name: digest(p) for p in out.iterdir()}
        fill(disk, leave=64 << 10)
        with pytest.raises(storage.StorageError, match="export failed: .*no space left on device"):
            write_model_dir(out, 0, lambda stage: adapted.save_pretrained(stage))
        assert {p.name: digest(p) for p in out.iterdir()} == before
        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(out))  # still loads


def test_metrics_on_a_full_disk_lose_records_not_lines(tmp_path, capsys):
    """metrics.jsonl never holds half a record: a write cut short is truncated back; one warning per launch;
    records are appended again once there is room."""
    with tmpfs(tmp_path / "disk", "256K") as disk:
        log = MetricsLog(disk / "metrics.jsonl", enabled=True)
        log.write({"step": 1, "loss": 1.0})
        filler = fill(disk, leave=0)
        for step in range(2, 40):
            log.write({"step": step, "loss": 1.0, "pad": "x" * 300})
        warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
        assert len(warnings) == 1 and "no space left on device" in warnings[0] and "training goes on" in warnings[0]
        filler.unlink()
        log.write({"step": 40, "loss": 0.5})
        log.close()
        steps = [json.loads(line)["step"] for line in (disk / "metrics.jsonl").read_text().splitlines()]
        assert steps[0] == 1 and steps[-1] == 40  # every line whole: json.loads read each one


def test_the_samples_page_on_a_full_disk_keeps_its_columns(tmp_path, capsys):
    """The live eval's page (evaluation/in_training.py writes it through storage.or_warn)."""
    with tmpfs(tmp_path / "disk", "512K") as disk:
        stem, prompts, decoding = disk / "eval_samples", [{"prompt": "2+2?"}], {"max_new_tokens": 8}
        side_by_side.append_column(stem, prompts, "step 10", ["4"], decoding, "run")
        before = {p.name: digest(p) for p in disk.iterdir()}
        fill(disk, leave=0)
        big = ["x" * (600 << 10)]
        assert not storage.or_warn(
            lambda: side_by_side.append_column(stem, prompts, "step 20", big, decoding, "run"),
            "the samples page",
            "it keeps its previous columns; training goes on",
        )
        assert "warning: the samples page not written (no space left on device)" in capsys.readouterr().err
        before["filler.bin"] = digest(disk / "filler.bin")
        assert {p.name: digest(p) for p in disk.iterdir()} == before  # no temporary left beside them


def test_a_small_file_on_a_full_disk_leaves_the_old_one_and_no_temporary(tmp_path):
    with tmpfs(tmp_path / "disk", "256K") as disk:
        atomic.write_text(disk / "latest.json", "old")
        fill(disk, leave=0)
        with pytest.raises(OSError):
            atomic.write_text(disk / "latest.json", "x" * (300 << 10))
        assert (disk / "latest.json").read_text() == "old"
        assert sorted(p.name for p in disk.iterdir()) == ["filler.bin", "latest.json"]
        resize(disk, "1M")
        atomic.write_text(disk / "latest.json", "new")
        assert (disk / "latest.json").read_text() == "new"
