"""Whether a checkpoint is intact (integrity.damage), which one a resume takes, and the one line for a
damaged one, over checkpoint directories written here with torch.save (no process group). Real DeepSpeed
checkpoints of ZeRO-2, ZeRO-3 and TP runs: tests/integration/checkpointing/test_damaged_checkpoints.py."""

from __future__ import annotations

import json
import os

import pytest
import torch

from zero_recipes.checkpointing.checkpoint import resolve_resume
from zero_recipes.checkpointing.integrity import LAYOUT, MANIFEST, check_intact, damage, file_sizes, write_manifest_of
from zero_recipes.config.train_config import ConfigError

OPTIM = "zero_pp_rank_1_mp_rank_00_optim_states.pt"


def save_step(out, step: int, manifest: bool = True):
    """A 2-rank ZeRO-2 checkpoint's files, as train.py's save names them, and `latest` on it."""
    d = out / "checkpoints" / f"step-{step}"
    (d / "hf").mkdir(parents=True)
    for r in range(2):
        torch.save({"state": torch.arange(4000.0) + r}, d / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
        torch.save({"torch": torch.get_rng_state()}, d / f"rng_state_{r}.pt")
    torch.save({"module": {"w": torch.ones(1000)}}, d / "mp_rank_00_model_states.pt")
    (d / "hf" / "config.json").write_text("{}")
    layout = {"world": 2, "step": step, "zero_stage": 2, "tensor_parallel": 1, "sequence_parallel": 1}
    (d / LAYOUT).write_text(json.dumps({**layout, **({"manifest": True} if manifest else {})}))
    if manifest:
        write_manifest_of(d, [file_sizes(d)])
    (out / "checkpoints" / "latest").write_text(f"step-{step}")
    return d


def truncate(f):
    os.truncate(f, f.stat().st_size // 2)


DAMAGE = {  # how -> (what it does to a file, what the line says)
    "truncated": (truncate, "bytes; the save wrote"),
    "missing": (lambda f: f.unlink(), "is missing"),
    "zero-byte": (lambda f: os.truncate(f, 0), "is empty (0 bytes; the save wrote"),
}


@pytest.fixture
def run(tmp_path):
    """An output_dir with intact step-1 and step-2 checkpoints; `latest` is step-2."""
    save_step(tmp_path, 1)
    save_step(tmp_path, 2)
    return tmp_path


def test_an_intact_checkpoint_is_taken_as_it_is(run):
    assert damage(run / "checkpoints" / "step-2") is None
    assert resolve_resume(run, "auto") == ((run / "checkpoints", "step-2"), None)
    assert resolve_resume(run, str(run / "checkpoints" / "step-2")) == ((run / "checkpoints", "step-2"), None)


@pytest.mark.parametrize("name", [OPTIM, "mp_rank_00_model_states.pt", "rng_state_0.pt", "hf/config.json"])
@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_a_damaged_latest_is_named_and_the_newest_intact_one_is_used(run, how, name):
    step2 = run / "checkpoints" / "step-2"
    change, says = DAMAGE[how]
    change(step2 / name)
    problem = damage(step2)
    assert problem.startswith(name) and says in problem, problem
    if how == "truncated":
        assert problem.endswith("(truncated)")
    where, line = resolve_resume(run, "auto")
    assert where == (run / "checkpoints", "step-1")
    assert line == f"resume: {step2} is damaged ({problem}); using step-1, the newest intact checkpoint"
    with pytest.raises(ConfigError) as refused:  # a path the user gave is refused, not swapped for another
        resolve_resume(run, str(step2))
    want = f"{step2} is damaged: {problem}; the newest intact checkpoint before it is {run / 'checkpoints' / 'step-1'}"
    assert str(refused.value) == f"--resume_from_checkpoint {step2}: {want}"
    with pytest.raises(ConfigError, match="is damaged"):  # the output_dir given as the path: its latest
        resolve_resume(run, str(run))


def test_with_none_intact_the_resume_is_one_line(run):
    truncate(run / "checkpoints" / "step-2" / OPTIM)
    (run / "checkpoints" / "step-1" / "rng_state_1.pt").unlink()
    with pytest.raises(ConfigError) as refused:
        resolve_resume(run, "auto")
    line = str(refused.value)
    assert line.startswith("no intact checkpoint to resume from: ") and "\n" not in line
    assert f"step-2 is damaged ({OPTIM} is" in line and "step-1 is damaged (rng_state_1.pt is missing)" in line
    assert "--overwrite_output_dir" in line
    with pytest.raises(ConfigError, match="no checkpoint before it is intact"):
        check_intact((run / "checkpoints", "step-2"))


def test_a_checkpoint_newer_than_latest_is_never_taken(run):
    save_step(run, 3)
    (run / "checkpoints" / "latest").write_text("step-2")  # step-3's save did not reach `latest`
    truncate(run / "checkpoints" / "step-2" / OPTIM)
    assert resolve_resume(run, "auto")[0] == (run / "checkpoints", "step-1")


def test_a_save_that_did_not_reach_its_manifest_is_damaged(run):
    (run / "checkpoints" / "step-2" / MANIFEST).unlink()  # layout.json says this save writes one
    assert damage(run / "checkpoints" / "step-2") == f"{MANIFEST} is missing: the save did not finish"
    (run / "checkpoints" / "step-1" / MANIFEST).write_text("{not json")
    assert damage(run / "checkpoints" / "step-1") == f"{MANIFEST} cannot be read"


def test_a_size_kept_but_a_cut_zip_directory_is_unreadable(run):
    f = run / "checkpoints" / "step-2" / OPTIM
    data = f.read_bytes()
    f.write_bytes(data[:-200] + b"\0" * 200)  # the same size, the end of torch.save's zip archive overwritten
    assert damage(run / "checkpoints" / "step-2").startswith(f"{OPTIM} cannot be read as torch.save wrote it")


def test_a_checkpoint_from_before_manifests_is_trusted_less_what_needs_none(tmp_path):
    d = save_step(tmp_path, 1, manifest=False)
    assert damage(d) is None
    (d / "hf" / "config.json").write_text("")  # no size was recorded: not knowable
    assert damage(d) is None
    truncate(d / OPTIM)  # torch.save's zip directory is gone: unreadable whatever the manifest
    assert damage(d).startswith(f"{OPTIM} cannot be read as torch.save wrote it")
    d = save_step(tmp_path, 2, manifest=False)
    os.truncate(d / OPTIM, 0)
    assert damage(d) == f"{OPTIM} is empty (0 bytes)"
    d = save_step(tmp_path, 3, manifest=False)
    (d / "rng_state_1.pt").unlink()  # layout.json says 2 ranks saved it
    assert damage(d) == "rng_state_1.pt is missing"
    d = save_step(tmp_path, 4, manifest=False)
    (d / "mp_rank_00_model_states.pt").unlink()
    assert damage(d) == "no model_states.pt file is there"


def test_a_file_in_another_format_is_not_judged_by_its_zip_directory(run):
    d = run / "checkpoints" / "step-2"
    torch.save({"x": torch.ones(3)}, d / OPTIM, _use_new_zipfile_serialization=False)  # torch's legacy format
    write_manifest_of(d, [file_sizes(d)])
    assert damage(d) is None


def test_the_manifest_keeps_each_file_at_the_largest_size_any_rank_saw(tmp_path):
    (tmp_path / "a.pt").write_bytes(b"x" * 10)
    (tmp_path / "b.pt").write_bytes(b"y" * 5)
    # rank 0's client saw a.pt short (a stale cached size) and not b.pt at all; rank 1 wrote both
    write_manifest_of(tmp_path, [{"a.pt": 3}, {"a.pt": 10, "b.pt": 5}])
    assert json.loads((tmp_path / MANIFEST).read_text()) == {"files": {"a.pt": 10, "b.pt": 5}}
    assert MANIFEST not in file_sizes(tmp_path)
