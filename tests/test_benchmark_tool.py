"""tools/benchmark.py data --quick runs end to end on the real pipeline, run_clm.py's and train.py, and writes
its report. The figures themselves are machine-dependent; only their signs and orderings are checked."""

import json
import subprocess
import sys

from conftest import REPO


def test_data_benchmark_quick(tmp_path):
    proc = subprocess.run([sys.executable, "tools/benchmark.py", "data", "--quick", "--out-dir", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"benchmark failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}"
    [report] = list(tmp_path.glob("data-*.json"))
    assert report.with_suffix(".md").exists()
    r = json.loads(report.read_text())
    prep, first, packing = r["prep"], r["time_to_first_step"], r["packing"]
    assert prep["ours"]["tokens_per_sec"] > 0 and prep["run_clm"]["tokens_per_sec"] > 0
    assert prep["ours"]["tokens"] >= prep["run_clm"]["tokens"]  # ours drops only the final tail
    assert packing["with_packing"]["utilisation"] > packing["without_packing"]["utilisation"]
    assert first["cold_seconds"] > 0 and first["cached_seconds"] > 0
    assert r["versions"]["deepspeed"] and r["machine"]["cores"] > 0
