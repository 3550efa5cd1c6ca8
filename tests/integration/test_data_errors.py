"""Bad data gets one line naming the problem and the fix, and a non-zero exit with nothing written."""

import subprocess
import sys

from helpers import REPO


def write(path, text):
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


def test_bad_data_under_the_launcher_is_one_line_and_writes_nothing(tmp_path):
    bad = write(tmp_path / "bad.jsonl", '{"text": "a"}\nnot json\n')
    out = tmp_path / "run"
    env_cache = tmp_path / "cache"
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--deepspeed",
            "ds_configs/zero2.json",
            "--dataset_name",
            bad,
            "--output_dir",
            str(out),
            "--cache_dir",
            str(env_cache),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "bad.jsonl:2:1: not valid JSON lines" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not out.exists()  # nothing written: the output dir is created only once the data is good
