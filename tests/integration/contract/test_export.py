"""The contract's export column (tests/contract.py): the directory train.py finishes is the trained model (a
PEFT adapter for LoRA rows), and reloaded with plain `from_pretrained` it gives the engine's logits. Where
tools/export_hf.py takes the row's checkpoint, its export is that same model; where it cannot, it says so in
one line, exit 2, writing nothing."""

import subprocess
import sys

import pytest

from contract import rows
from helpers import REPO, export_diff, one_error_line


@pytest.mark.parametrize("mode", rows("export"), ids=lambda m: m.name)
def test_the_export_reloads_with_the_engines_logits(mode, mode_run):
    run = mode_run(mode).check()
    adapter = "--lora_r" in mode.args
    assert (run.output_dir / ("adapter_config.json" if adapter else "config.json")).is_file()
    assert (run.output_dir / "model.safetensors").exists() != adapter  # an adapter, never the frozen base
    assert export_diff(run) <= mode.export_tol


@pytest.mark.parametrize("mode", rows("export_tool"), ids=lambda m: m.name)
def test_export_tool_writes_the_trained_model_or_refuses_in_one_line(mode, mode_run, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    run = mode_run(mode).check()
    tool = [sys.executable, "tools/export_hf.py", str(run.output_dir), str(tmp_path / "hf")]
    proc = subprocess.run(tool, cwd=REPO, capture_output=True, text=True)
    if mode.export_tool.startswith("refused: "):
        line = one_error_line(proc)
        assert proc.returncode == 2 and mode.export_tool.removeprefix("refused: ") in line, line
        assert line.endswith("the output_dir it finishes is the exported model") and not (tmp_path / "hf").exists()
        return
    assert proc.returncode == 0, proc.stderr[-3000:]
    ids = torch.randint(0, 1000, (2, 32))
    exported, loading = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    exported.eval()
    # every weight whole and found (a shard would mismatch, a missing one be drawn at random)
    assert not any(loading[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), loading
    trained = AutoModelForCausalLM.from_pretrained(run.output_dir).eval()
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, trained(ids).logits)
