"""Storage that fails under a run, on real filesystems: a tmpfs that fills during a checkpoint save and during the
export, a checkpoints directory remounted read-only mid-run, a data cache that is full or read-only, and the
tools' outputs. Each ends in one line and a non-zero exit on every rank, with nothing of the user's lost. In-process
writes (export staging, metrics.jsonl, the samples page) are tests/unit/checkpointing/test_storage.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import (
    FAST,
    REPO,
    free_port,
    launch,
    one_error_line,
    read_only,
    read_only_bind,
    resize,
    small_llama,
    tmpfs,
)
from zero_recipes.checkpointing.integrity import MANIFEST, damage
from zero_recipes.config.train_config import TrainConfig
from zero_recipes.data import builtin_tokenizer_dir

ZERO2_FP32 = ["--deepspeed", "ds_configs/zero2.json", "--bf16", "false"]
SAVE_EVERY_STEP = [*FAST[:-2], "--save_steps", "1", "--max_steps", "6"]  # FAST's 4 eval batches dropped


def ranks_alone(args: list[str], output_dir, nproc: int = 2, timeout: int = 300) -> list[subprocess.CompletedProcess]:
    """train.py's ranks as plain processes with the environment a launcher gives them, and no launcher: nothing
    kills a rank when another exits, so each rank's own exit code shows that none is left waiting."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(nproc)}
    env.pop("OMP_NUM_THREADS", None)
    procs = [
        subprocess.Popen(
            [sys.executable, "train.py", *args, "--output_dir", str(output_dir)],
            cwd=REPO,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(nproc)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(nproc)
    ]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def error_lines(text: str) -> list[str]:
    return [line[line.index("error: ") :] for line in text.splitlines() if "error: " in line]


def test_a_disk_that_fills_during_a_save_then_during_the_export(tmp_path):
    """The issue's reproduction on 2 ranks: step-2 does not fit. Every rank exits non-zero by itself, one line
    says where, how much is free and what the save needed; step-2 is gone, `latest` and tools/export_hf.py take
    step-1. With room for the checkpoints but not the export, the relaunch resumes, trains, and stops at the
    export with one line and no half-written model; with room, the same command exports."""
    with tmpfs(tmp_path / "disk", "48M") as disk:
        out = disk / "run"
        ranks = ranks_alone([*ZERO2_FP32, *SAVE_EVERY_STEP, "--save_total_limit", "8"], out)
        assert [r.returncode for r in ranks] == [2, 2], ranks[0].stderr[-3000:] + ranks[1].stderr[-3000:]
        assert not any("Traceback" in r.stdout + r.stderr for r in ranks)
        (line,) = error_lines(ranks[0].stderr)
        assert line.startswith(f"error: saving checkpoint step-2 failed: cannot write {out / 'checkpoints'}: ")
        for part in ("no space left on device", "free of 48.0 MiB; it needs about", "No partial step-2 is left"):
            assert part in line
        assert "the newest complete checkpoint, step-1, is what relaunching the same command resumes from" in line
        assert error_lines(ranks[1].stderr) == []  # rank 0 speaks for all
        ckpts = out / "checkpoints"
        assert (ckpts / "latest").read_text() == "step-1" and not (ckpts / "step-2").exists()
        assert damage(ckpts / "step-1") is None

        exported = tmp_path / "exported"
        proc = subprocess.run(
            [sys.executable, "tools/export_hf.py", str(out), str(exported)], cwd=REPO, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        AutoModelForCausalLM.from_pretrained(exported)

        # room for two checkpoints (save_total_limit 2 removes the older before writing), not for the export
        checkpoint = sum(json.loads((ckpts / "step-1" / MANIFEST).read_text())["files"].values())
        weights = (ckpts / "step-1" / "mp_rank_00_model_states.pt").stat().st_size
        used = sum(f.stat().st_size for f in disk.rglob("*") if f.is_file())
        resize(disk, f"{(used + checkpoint + weights // 2) // 1024}k")
        run = launch([*ZERO2_FP32, *SAVE_EVERY_STEP, "--save_total_limit", "2"], out)
        assert run.proc.returncode == 2, run.log[-4000:]
        assert "resume: loaded" in run.log and "step-1 at step 1" in run.log
        (line,) = error_lines(run.proc.stderr)
        assert line.startswith(f"error: export failed: cannot write {out}: no space left on device"), line
        assert "previous files are untouched; the newest checkpoint holds the trained weights: `python " in line
        assert (ckpts / "latest").read_text() == "step-6" and damage(ckpts / "step-6") is None
        assert not list(out.glob("model*.safetensors")) and not list(out.glob(".staging-*"))

        resize(disk, "200M")
        run = launch([*ZERO2_FP32, *SAVE_EVERY_STEP, "--save_total_limit", "2"], out).check()
        assert "nothing left to train" in run.log
        AutoModelForCausalLM.from_pretrained(out)


def test_checkpoints_remounted_read_only_mid_run(tmp_path):
    """The checkpoints directory turns read-only between two saves (a bind mount remounted read-only, as a
    failing disk's forced remount leaves it): the next save stops both ranks with one line, `latest` intact."""
    with tmpfs(tmp_path / "disk", "400M") as disk:
        out = disk / "run"
        args = [*ZERO2_FP32, *FAST[:-2], "--save_steps", "3", "--max_steps", "60"]
        port = str(free_port())
        proc = subprocess.Popen(
            ["deepspeed", "--num_gpus", "2", "--master_port", port, "train.py", *args, "--output_dir", str(out)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"},
        )
        deadline = time.monotonic() + 240
        while not (out / "checkpoints" / "latest").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        read_only_bind(out / "checkpoints")
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode != 0 and "Traceback" not in stdout + stderr, stderr[-3000:]
        (line,) = error_lines(stderr)
        assert "failed: cannot write" in line and "read-only file system" in line and "remount it read-write" in line
        tag = (out / "checkpoints" / "latest").read_text()
        assert f"the newest complete checkpoint, {tag}, is what relaunching" in line
        assert damage(out / "checkpoints" / tag) is None


@pytest.mark.parametrize("fault", ["full", "read-only"])
def test_a_data_cache_that_is_full_or_read_only(tmp_path, fault):
    """--cache_dir on a disk too small for the prepared blocks, or remounted read-only: one line naming the
    cache, and no entry there that a later run could take as complete."""
    with tmpfs(tmp_path / "cache", "3M") as cache:
        if fault == "read-only":
            read_only(cache)
        run = launch([*ZERO2_FP32, *FAST, "--cache_dir", str(cache)], tmp_path / "run", nproc=1, launcher="python")
        assert run.proc.returncode == 2 and "Traceback" not in run.log, run.log[-3000:]
        (line,) = error_lines(run.proc.stderr)
        cause = "a write was cut short, as when the disk fills" if fault == "full" else "read-only file system"
        assert line.startswith(f"error: preparing the data failed: cannot write {cache}: {cause}"), line
        assert "--cache_dir" in line
        assert not list(cache.rglob("*.tmp*")) and not list(cache.rglob("meta.json"))


def test_the_tools_outputs_on_a_full_or_read_only_disk(tmp_path):
    """tools/clean_data.py on a full disk leaves no cut-off output; on a read-only one, and tools/evaluate.py
    too, are refused before any work."""
    docs = tmp_path / "raw.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document {i} " + "words " * 200}) + "\n" for i in range(800)))
    with tmpfs(tmp_path / "disk", "512K") as disk:
        clean = [sys.executable, "tools/clean_data.py", str(docs), "--output", str(disk / "clean.jsonl")]
        proc = subprocess.run(clean, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
        (line,) = error_lines(proc.stderr)
        assert line.startswith(f"error: writing the cleaned data failed: cannot write {disk}: "), line
        assert "--output at a larger disk" in line
        assert sorted(p.name for p in disk.iterdir()) == []
        read_only(disk)
        line = one_error_line(subprocess.run(clean, cwd=REPO, capture_output=True, text=True, timeout=300))
        assert line == (
            f"error: --output {disk / 'clean.jsonl'}: cannot write in {disk} (read-only file system); remount it read-write or "
            "point --output elsewhere"
        )
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(8)))
        model = tmp_path / "model"  # a model directory evaluate.py accepts: weights and a tokenizer
        tokenizer = AutoTokenizer.from_pretrained(builtin_tokenizer_dir(TrainConfig()))
        tokenizer.save_pretrained(model)
        AutoModelForCausalLM.from_config(small_llama(num_hidden_layers=1, vocab_size=len(tokenizer))).save_pretrained(
            model
        )
        evaluate = [sys.executable, "tools/evaluate.py", str(model), "--samples", str(prompts)]
        proc = subprocess.run(
            [*evaluate, "--samples_output", str(disk / "s")], cwd=REPO, capture_output=True, text=True
        )
        assert one_error_line(proc).startswith(f"error: --samples_output {disk / 's'}: cannot write in {disk}")
    with tmpfs(tmp_path / "small", "8k") as small:  # writable, too small for the page: the write itself fails
        proc = subprocess.run(
            [*evaluate, "--samples_output", str(small / "s")], cwd=REPO, capture_output=True, text=True
        )
        assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
        (line,) = error_lines(proc.stderr)
        assert line.startswith(f"error: writing the samples failed: cannot write {small}: no space left on device")
        # the answers (s.jsonl, written first) are whole; the page did not fit and left no part of itself
        assert [p.name for p in small.iterdir()] == ["s.jsonl"]
        assert len([json.loads(line) for line in (small / "s.jsonl").read_text().splitlines()]) == 8
