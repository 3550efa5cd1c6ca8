"""tools/clean_data.py --executor local|ray on datatrove's real executors, against the in-memory path on the
cleaning benchmark's corpus (English and Chinese, planted near-duplicates, garbled text, mojibake), every step
on: the same documents kept, in order, the same rows removed for the same reasons, the same report; a killed
run resumes from datatrove's completions; train.py's loader reads the output directory."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from helpers import REPO, free_port, tool_in_process
from slurm_cluster import cluster  # noqa: F401 -- the module-scoped fixture: a real one-node Slurm
from zero_recipes.config.train_config import TrainConfig
from zero_recipes.data import sources

sys.path.insert(0, str(REPO / "tools"))
from bench.cleaning import corpus as cleaning_corpus  # noqa: E402

FLAGS = ["--fix_text", "true", "--drop_garbled", "true", "--quality_filter", "gopher", "--dedupe", "near"]
DOCUMENTS = 600


@pytest.fixture(scope="module")
def cleaned(tmp_path_factory):
    """The benchmark's corpus, and the in-memory path's kept rows, removed rows and report for it."""
    tmp = tmp_path_factory.mktemp("clean")
    docs = cleaning_corpus.build(DOCUMENTS, seed=3)
    raw = tmp / "raw.jsonl"
    raw.write_text("".join(json.dumps({"id": i} | d, ensure_ascii=False) + "\n" for i, d in enumerate(docs)))
    done = tool_in_process("clean_data", raw, "--output", tmp / "memory.jsonl", *FLAGS)
    assert done.returncode == 0, done.stderr
    return raw, read_rows(tmp / "memory.jsonl"), read_rows(tmp / "memory.removed.jsonl"), report(tmp / "memory.jsonl")


def read_rows(path: Path) -> list[dict]:
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    return [json.loads(line) for f in files for line in f.read_text(encoding="utf-8").splitlines()]


def report(output: Path) -> dict:
    r = json.loads(output.with_name(output.name.removesuffix(".jsonl") + ".report.json").read_text())
    return {k: r[k] for k in ("format", "options", "documents", "edited", "removed", "kept")}


def removed_by_id(rows: list[dict]) -> dict:
    return {r["id"]: (r["removed_because"], r["duplicate_of"]) for r in rows}


def clean_data(*args, env=None, **popen) -> subprocess.Popen:
    cmd = [sys.executable, "tools/clean_data.py", *map(str, args)]
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen
    )


def assert_same_as_in_memory(cleaned, out: Path):
    _, kept, removed, in_memory = cleaned
    assert read_rows(out) == kept  # the same rows, in input order, with the same repairs
    by_id = removed_by_id(read_rows(out.with_name(out.name + ".removed")))
    assert {k: v[0] for k, v in by_id.items()} == {k: v[0] for k, v in removed_by_id(removed).items()}
    assert report(out) == in_memory  # counts per step and reason, and the same examples
    assert any(r.startswith("near duplicates") for r in in_memory["removed"]) and in_memory["edited"]["fix_text"]


def test_a_killed_local_run_resumes_from_datatrove_completions_and_keeps_what_the_in_memory_path_keeps(
    cleaned, tmp_path
):
    raw = cleaned[0]
    out = tmp_path / "clean"
    first_done = tmp_path / "logs" / "1-clean" / "completions" / "00000"
    run = clean_data(raw, "--output", out, *FLAGS, "--executor", "local", "--tasks", "4", "--workers", "1",
                     "--logging_dir", tmp_path / "logs", start_new_session=True)  # fmt: skip
    while not first_done.exists() and run.poll() is None:
        time.sleep(0.05)
    os.killpg(run.pid, signal.SIGKILL)  # task 0 finished, the others not: a preemption mid-stage
    run.communicate()
    assert not (tmp_path / "logs" / "1-clean" / "completions" / "00003").exists(), "the kill came too late"
    assert not out.with_name("clean.report.json").exists()
    task0_log = tmp_path / "logs" / "1-clean" / "logs" / "task_00000.log"
    before = task0_log.read_text()

    rerun = clean_data(raw, "--output", out, *FLAGS, "--executor", "local", "--tasks", "4", "--workers", "1",
                       "--logging_dir", tmp_path / "logs")  # fmt: skip
    said, _ = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, said[-3000:]
    assert "Skipping 1 already completed tasks" in said and task0_log.read_text() == before  # task 0 not rerun
    assert_same_as_in_memory(cleaned, out)
    assert f"clean: {DOCUMENTS} documents -> {cleaned[3]['kept']} kept" in said

    # train.py's loader reads the directory of shards as the kept rows
    cfg = TrainConfig(dataset_name=str(out), validation_split_percentage=0)
    spec = sources.dataset_specs(cfg)[0]
    ds = sources.load(spec, sources.describe(spec, cfg), spec.split)
    assert ds["id"] == [r["id"] for r in cleaned[1]]

    # the same directory asked for with other options is another run's: refused, nothing touched
    files = {p: p.read_bytes() for p in out.iterdir()}
    done = tool_in_process(
        "clean_data", raw, "--output", out, "--dedupe", "exact", "--executor", "local", "--tasks", "4"
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "holds another run's shards (its options differ)" in done.stderr
    assert {p: p.read_bytes() for p in out.iterdir()} == files


@pytest.fixture
def ray_cluster():
    """A real local Ray cluster on loopback, started for the test and stopped after."""
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's sockets live there: a path under 108 bytes
    # every port Ray listens on from this worker's span, the workers' too: Ray's default worker range (10002-19999)
    # overlaps the suite's spans, and Ray refuses to start when a chosen port falls inside it (seen in CI)
    ports: list[int] = []
    while len(ports) < 13:  # head, client, node manager, object manager, dashboard agent and 8 workers
        if (p := free_port()) not in ports:
            ports.append(p)
    port, workers = ports[4], ",".join(map(str, ports[5:]))
    start = ["ray", "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2",
             "--include-dashboard=false", "--disable-usage-stats", f"--ray-client-server-port={ports[0]}",
             f"--node-manager-port={ports[1]}", f"--object-manager-port={ports[2]}",
             f"--dashboard-agent-listen-port={ports[3]}", f"--worker-port-list={workers}",
             f"--temp-dir={temp}"]  # fmt: skip
    started = subprocess.run(start, capture_output=True, text=True)
    assert started.returncode == 0, f"Ray did not start: {started.stderr[-2000:]}"
    try:
        yield dict(os.environ, RAY_ADDRESS=f"127.0.0.1:{port}")
    finally:
        subprocess.run(["ray", "stop", "--force"], capture_output=True)
        shutil.rmtree(temp, ignore_errors=True)


def test_ray_executor_on_a_real_local_cluster_keeps_what_the_in_memory_path_keeps(cleaned, ray_cluster, tmp_path):
    out = tmp_path / "clean"
    run = clean_data(cleaned[0], "--output", out, *FLAGS, "--executor", "ray", "--tasks", "2", env=ray_cluster)
    said, _ = run.communicate(timeout=600)
    assert run.returncode == 0, said[-3000:]
    assert_same_as_in_memory(cleaned, out)


def test_slurm_executor_on_a_real_slurm_keeps_what_the_in_memory_path_keeps(cleaned, cluster, tmp_path):  # noqa: F811
    out = tmp_path / "clean"
    wrong = clean_data(
        cleaned[0], "--output", out, *FLAGS, "--executor", "slurm", "--partition", "nope", env=cluster.env
    )
    said, _ = wrong.communicate(timeout=120)  # Slurm's own words, in one line, and nothing written
    assert (
        wrong.returncode == 2
        and said
        == "error: Slurm refused a job on partition nope: allocation failure: Invalid partition name specified\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == []

    run = clean_data(cleaned[0], "--output", out, *FLAGS, "--executor", "slurm", "--tasks", "2", env=cluster.env)
    said, _ = run.communicate(timeout=120)
    assert run.returncode == 0 and "clean: submitted Slurm jobs" in said, said[-3000:]
    deadline = time.time() + 600
    while cluster.run(["squeue", "--noheader"]).stdout.strip() and time.time() < deadline:
        time.sleep(1)
    assert out.with_name("clean.report.json").exists(), cluster.log()
    assert_same_as_in_memory(cleaned, out)
