"""DeepSpeed JSONs DeepSpeed 0.19.8 would reject deep inside model construction (or accept and then ignore) are
refused under the launcher before any process group: one `error:` line with the fix, exit 2, nothing written."""

import json

import pytest

from brought_configs import REFUSED
from helpers import launch


@pytest.mark.parametrize("name", list(REFUSED))
def test_brought_config_refused_in_one_line(name, tmp_path):
    ds, expected = REFUSED[name]
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(ds, indent=2))
    run = launch(["--deepspeed", str(path), "--max_steps", "2"], tmp_path / "out", timeout=300)
    assert run.proc.returncode != 0
    assert "Traceback" not in run.log, run.log[-3000:]
    errors = [line for line in run.proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], run.log[-3000:]
    assert "exits with return code = 2" in run.log  # the launcher saw train.py's bad-input exit
    assert not run.output_dir.exists()
