"""tools/benchmark.py cleaning --quick: tools/clean_data.py, as a user runs it, on 2,000 generated English and
Chinese documents with planted near-duplicates and garbled text, then --dedupe exact alone as the baseline.
The report must score every planted kind from clean_data's own outputs, and the scores must show what
cleaning is for: near-duplicates that exact hashing misses, garbled text dropped, clean text kept."""

import json

from helpers import benchmark, run_quick


def test_cleaning_benchmark_quick(tmp_path):
    report = run_quick("cleaning", tmp_path, timeout=600)
    assert report.with_suffix(".md").exists()
    r = json.loads(report.read_text())
    full, exact = r["all_steps"]["scores"], r["exact_only"]["scores"]
    assert sum(r["corpus"].values()) == r["documents"] == 2000
    # exact hashing finds the exact copies only; MinHash also the edited, re-headed and reordered ones
    assert exact["near_recall"]["value"] < 0.25 < 0.85 < full["near_recall"]["value"]
    assert exact["near_recall_by"]["en exact copy"]["value"] == 1.0
    assert full["near_precision"]["value"] >= 0.98 and full["garbled_recall"]["value"] >= 0.9
    assert exact["garbled_recall"]["value"] == 0
    for lang in ("en", "zh"):
        assert full["clean_removed_by_language"][lang]["value"] <= 0.02
        assert full["clean_removed_by_language"][lang]["total"] > 600
    sweep = r["threshold_sweep"]["thresholds"]  # a lower threshold finds more
    assert (
        sweep["0.5"]["near_recall"]["value"]
        >= sweep["0.7"]["near_recall"]["value"]
        >= sweep["0.9"]["near_recall"]["value"]
    )
    assert r["all_steps"]["report"]["documents_per_second"] > 0 and r["all_steps"]["peak_rss_mib"] > 0


def test_cleaning_executors_quick_the_in_memory_path_runs_out_of_memory_where_the_executor_fits(tmp_path):
    """`cleaning --executors --quick` under a 140 MiB cgroup: the in-memory path (datasets + a signature index)
    is killed for memory on both corpora, the executor path (one batch at a time) cleans them within it."""
    proc = benchmark("cleaning", "--executors", "--quick", "--tasks", "1", "--memory-limit", "140MiB",
                     "--out-dir", str(tmp_path), timeout=600)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    [report] = tmp_path.glob("cleaning-executors-*.json")
    r = json.loads(report.read_text())
    runs = {(x["documents"], x["setting"]): x for x in r["runs"]}
    for size in (r["small"], r["large"]):
        in_memory, executor = runs[size, "in memory"], runs[size, "local, 1 task(s)"]
        assert in_memory["out_of_memory"] and in_memory["returncode"] != 0
        assert executor["returncode"] == 0 and not executor["out_of_memory"] and executor["cgroup_peak_mib"] <= 140
        assert executor["scores"]["near_recall"]["value"] >= 0.85
        assert executor["scores"]["near_precision"]["value"] >= 0.98
    assert "ran out of memory at 140MiB" in report.with_suffix(".md").read_text()
