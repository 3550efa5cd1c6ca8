"""DeepSpeed JSONs DeepSpeed 0.19.8 would reject deep inside model construction (or accept and then ignore) are
refused under the launcher before any process group: one `error:` line with the fix, exit 2, nothing written.

The first config goes through the real deepspeed launcher on 2 ranks, which proves the refusal reaches the shell;
every config's refusal is also checked in this process as rank 0 of 2 ranks (helpers.refusal), which proves it
comes before any process group, where a launch would only add start-up time."""

import json

import pytest

from brought_configs import REFUSED
from helpers import launch, refusal


def write(name, tmp_path):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(REFUSED[name][0], indent=2))
    return path


def test_a_brought_config_is_refused_under_the_launcher_in_one_line(tmp_path):
    name = next(iter(REFUSED))
    run = launch(["--deepspeed", str(write(name, tmp_path)), "--max_steps", "2"], tmp_path / "out", timeout=300)
    assert run.proc.returncode != 0
    assert "Traceback" not in run.log, run.log[-3000:]
    errors = [line for line in run.proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and REFUSED[name][1] in errors[0], run.log[-3000:]
    assert "exits with return code = 2" in run.log  # the launcher saw train.py's bad-input exit
    assert not run.output_dir.exists()


@pytest.mark.parametrize("name", list(REFUSED))
def test_brought_config_refused_in_one_line(name, tmp_path):
    out = tmp_path / "out"
    line = refusal("--deepspeed", write(name, tmp_path), "--max_steps", "2", "--output_dir", out, world=2)
    assert REFUSED[name][1] in line
    assert not out.exists()
