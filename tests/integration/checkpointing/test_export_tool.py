"""tools/export_hf.py: any ZeRO checkpoint (here 2-rank ZeRO-1/2/3) becomes an HF directory on one
process, with the engine's logits; broken checkpoints get one line."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import EXPORT_TOL, REPO, tool_in_process


def export(*args):
    """The tool in this process; the first broken checkpoint below goes through a real process (exit 2)."""
    return tool_in_process("export_hf", *args)


def export_process(*args):
    return subprocess.run(
        [sys.executable, "tools/export_hf.py", *map(str, args)], cwd=REPO, capture_output=True, text=True, timeout=300
    )


def logits(model_dir, dtype=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    probe = torch.arange(1, 33).reshape(1, 32)
    with torch.no_grad():
        return model(input_ids=probe).logits.float()


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3"])
def test_export_of_a_two_rank_checkpoint_matches_the_engine(name, trained, tmp_path):
    run = trained(name, "fp32").check()
    out = tmp_path / "hf"
    proc = export(run.output_dir / "checkpoints" / "step-8", out, "--max_shard_size", "2MB")
    assert proc.returncode == 0, proc.stderr[-3000:]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded, with an index
    for f in ("config.json", "generation_config.json", "tokenizer.json"):
        assert (out / f).is_file(), f
    # the run's own export was checked against the engine's logits (--verify_export); match it
    assert (logits(out) - logits(run.output_dir)).abs().max().item() < EXPORT_TOL["fp32"]


def test_bf16_export_and_broken_checkpoints(trained, tmp_path):
    run = trained("zero2", "fp32").check()
    out = tmp_path / "bf16"
    assert export(run.output_dir, out, "--dtype", "bf16").returncode == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert (logits(out, torch.bfloat16) - logits(run.output_dir)).abs().max().item() < EXPORT_TOL["bf16"] * 10

    broken = tmp_path / "broken"
    shutil.copytree(run.output_dir / "checkpoints", broken / "checkpoints")
    partial = broken / "checkpoints" / "step-8"
    next(partial.glob("*optim_states.pt")).unlink()  # a shard lost after the save
    for tool, path, target, message in [
        (export_process, partial, tmp_path / "x", "_optim_states.pt is missing"),  # its manifest lists it
        (export, tmp_path / "nothing", tmp_path / "x", "holds no DeepSpeed checkpoint"),
        (export, run.output_dir, out, "is not empty"),
    ]:
        proc = tool(path, target)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(errors) == 1 and message in errors[0], proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr
    (broken / "checkpoints" / "latest").write_text("step-99")
    proc = export(broken, tmp_path / "y")
    assert proc.returncode == 2 and "names 'step-99', which is missing" in proc.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()  # nothing written on failure


@pytest.mark.parametrize("name", ["zero1", "zero3"])
def test_checkpoints_name_no_module_of_this_package_so_a_moved_module_never_breaks_a_resume(name, trained):
    """A checkpoint written before a module moved (issue 49 moved them all into subpackages) must still resume and
    export: torch.load unpickles a class by its module path, so no pickle in a checkpoint may name zero_recipes.
    Every .pt file's pickle (rank states, model and optimizer states, client state) is read for the name."""
    import zipfile

    run = trained(name, "fp32").check()
    files = sorted((run.output_dir / "checkpoints").rglob("*.pt"))
    assert len(files) >= 6, files  # both ranks' rng/data states and DeepSpeed's states, at steps 4 and 8
    for path in files:
        with zipfile.ZipFile(path) as archive:
            pickled = archive.read(next(n for n in archive.namelist() if n.endswith("/data.pkl")))
        assert b"zero_recipes" not in pickled, f"{path} pickles an object of zero_recipes"
