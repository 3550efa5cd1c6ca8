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


def test_export_benchmark_samples_the_memory_a_child_allocates():
    """`benchmark.py export` judges the goal on the child's peak anonymous memory: a child that fills 300 MB
    must read as about 300 MB more than one that allocates nothing."""
    sys.path.insert(0, str(REPO))
    from tools.bench.export import peak_memory

    def child(nbytes):
        return peak_memory([sys.executable, "-c", f"import time; b = bytearray({nbytes}); b[::4096] = b'1' * "
                            f"len(b[::4096]); time.sleep(0.5)"])

    idle, busy = child(0), child(300_000_000)
    grew = busy["RssAnon"] - idle["RssAnon"]
    assert 280e6 <= grew <= 330e6, (idle, busy)
    assert busy["VmRSS"] >= busy["RssAnon"]


def test_train_speed_benchmark_quick(tmp_path):
    """train.py, the HF Trainer and the bare DeepSpeed loop all train the same tiny workload through the
    launcher, and the report's ratios are the ratios of its medians."""
    proc = subprocess.run([sys.executable, "tools/benchmark.py", "train", "--quick", "--out-dir", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"benchmark failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}"
    [report] = list(tmp_path.glob("train-*.json"))
    m = json.loads(report.read_text())["models"]["tiny"]
    t = m["tokens_per_sec"]
    assert set(t) == {"train.py", "HF Trainer", "bare DeepSpeed loop", "train.py --torch_compile"}
    for runner in t.values():
        assert runner["windows"] == 2 and 0 < runner["min"] <= runner["median"] <= runner["max"]
    assert abs(m["vs_hf_trainer"] - t["train.py"]["median"] / t["HF Trainer"]["median"]) < 1e-9
    assert abs(m["vs_bare_loop"] - t["train.py"]["median"] / t["bare DeepSpeed loop"]["median"]) < 1e-9
    assert abs(m["compiled_vs_hf_trainer"] - t["train.py --torch_compile"]["median"] / t["HF Trainer"]["median"]) < 1e-9


def test_gpu_benchmark_is_prepared_and_refuses_a_cpu():
    """The GPU script cannot run here; it must say so in one line, and its memory predictions must be sane."""
    proc = subprocess.run([sys.executable, "tools/benchmark.py", "gpu", "--out-dir", "/nonexistent"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "no CUDA GPU" in errors[0]
    sys.path.insert(0, str(REPO))
    from tools.bench.gpu import CONFIGS, predicted

    pred = {name: predicted(files) for name, files in CONFIGS.items()}
    assert pred["zero3+offload_optimizer"] < pred["zero2"] < 139 * 2**30  # fits an H200; offload saves memory


def test_settings_benchmark_arithmetic():
    """`benchmark.py settings`: each variant is compared with the shipped config it modifies (the last
    variant without a fragment before it), on speed after the warm-up steps and on per-step losses."""
    sys.path.insert(0, str(REPO))
    from tools.bench.settings import PARITY_TOL, VARIANTS, summarise

    names = [name for name, *_ in VARIANTS]
    shipped2, shipped3 = [name for name, _, fragment in VARIANTS if not fragment]  # the shipped baselines
    overlap, z3_variant = names[names.index(shipped2) + 1], names[names.index(shipped3) + 1]
    runs = {n: [{"losses": [8.0, 7.0, 6.0], "tokens_per_sec": [1.0, 100.0, 100.0]}] for n in names}
    runs[overlap] = [{"losses": [8.0, 7.0, 6.5], "tokens_per_sec": [1.0, 150.0, 250.0]}]
    runs[shipped3] = [{"losses": [9.0, 7.0, 6.0], "tokens_per_sec": [1.0, 50.0, 50.0]},
                      {"losses": [9.0, 7.0, 6.0], "tokens_per_sec": [1.0, 70.0, 70.0]}]
    out = summarise(runs, skip=1)
    assert out[overlap]["tokens_per_sec"] == 200.0 and out[overlap]["vs_shipped"] == 2.0  # warm-up step left out
    assert out[overlap]["max_abs_loss_delta"] == 0.5 and not out[overlap]["loss_parity"]
    assert out[shipped2]["vs_shipped"] == 1.0 and out[shipped2]["loss_parity"]
    assert out[shipped3]["tokens_per_sec"] == 60.0 and out[shipped3]["windows"] == 4
    assert out[z3_variant]["vs_shipped"] == 100.0 / 60.0  # ZeRO-3 variants compare with zero3.json, not zero2.json
    assert out[z3_variant]["max_abs_loss_delta"] == 1.0 > PARITY_TOL
