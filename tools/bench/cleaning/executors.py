"""`python tools/benchmark.py cleaning --executors`: tools/clean_data.py in memory against its datatrove executor
path (`--executor local`, 1, 2 and 4 tasks), on the cleaning corpus (bench/cleaning/corpus.py) at 100,000
documents and at 1,000,000, each run under a memory limit (a cgroup, as a cluster's job gets).

Per run: documents/s, the peak RSS of the largest single process and of the whole process tree, the cgroup's
own peak, and whether it ran out of memory; near-duplicate recall and precision read from the run's outputs.
At 100,000 documents every step is on, and the executor path's kept rows must equal the in-memory path's. The
large corpus runs `--dedupe near` alone: MinHash is the step that needs the whole corpus at once; the
per-document steps hold one batch per task at any size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from multiprocessing import Pool
from pathlib import Path

from ..common import REPO
from . import corpus as cleaning_corpus
from .benchmark import ALL_ON, fates, ratio, score

CGROUPS = Path("/sys/fs/cgroup/memory")
LABELS = ("lang", "kind", "variant")


def build_chunk(args) -> list[dict]:
    """One chunk of the corpus, written to its own file; returns its labels (no texts: 1M texts are GBs)."""
    n, seed, offset, path = args
    docs = cleaning_corpus.build(n, seed=seed, originals=True)
    with open(path, "w", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(
                json.dumps({"id": offset + i} | {k: v for k, v in d.items() if k != "original"}, ensure_ascii=False)
            )
            f.write("\n")
    return [{k: d[k] for k in LABELS} | {"original": d.get("original")} for d in docs]


def build_corpus(n: int, seed: int, path: Path, chunk: int = 100_000) -> list[dict]:
    """`n` documents in chunks of `chunk` (each its own seed: duplicates are planted within a chunk), built in
    parallel, concatenated into `path`."""
    parts = [
        (min(chunk, n - start), seed + k, start, path.with_name(f"{path.name}.{k}"))
        for k, start in enumerate(range(0, n, chunk))
    ]
    with Pool(min(len(parts), len(os.sched_getaffinity(0)))) as pool:
        labels = [lab for part in pool.map(build_chunk, parts) for lab in part]
    with open(path, "wb") as out:
        for *_, p in parts:
            out.write(p.read_bytes())
            p.unlink()
    return labels


def tree_peaks(proc: subprocess.Popen, stop: threading.Event, out: dict, cg: Path) -> None:
    """The peak RSS of the largest process and of the whole tree, sampled every 0.1 s. When the kernel kills a
    process of the cgroup for memory, the rest of it is ended too, as a cluster ends a job: a worker killed
    under `datasets.map` would otherwise leave its parent waiting for it forever."""
    import psutil

    root = psutil.Process(proc.pid)
    while not stop.is_set():
        if "oom_kill 0" not in (cg / "memory.oom_control").read_text():
            for pid in (cg / "cgroup.procs").read_text().split():
                try:
                    os.kill(int(pid), 9)
                except ProcessLookupError:
                    pass
        try:
            rss = [p.memory_info().rss for p in [root, *root.children(recursive=True)]]
            out["process"] = max(out.get("process", 0), max(rss))
            out["tree"] = max(out.get("tree", 0), sum(rss))
        except psutil.Error:
            pass
        time.sleep(0.1)


def limited(name: str, limit: int):
    """A memory cgroup of `limit` bytes (no swap on these machines), and the preexec hook that joins it."""
    cg = CGROUPS / f"zero-recipes-bench-{os.getpid()}-{name}"
    cg.mkdir()
    (cg / "memory.limit_in_bytes").write_text(str(limit))
    return cg, lambda: (cg / "cgroup.procs").write_text(str(os.getpid()))


def run(name: str, corpus: Path, out: Path, flags: list[str], limit: int) -> dict:
    """clean_data as a user runs it, in a fresh datasets cache, under a `limit`-byte memory cgroup."""
    cg, join = limited(name, limit)
    env = dict(os.environ, HF_DATASETS_CACHE=str(out.parent / f"{name}.hf-cache"))
    cmd = [sys.executable, "tools/clean_data.py", str(corpus), "--output", str(out), *flags]
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=join
    )
    stop, peaks = threading.Event(), {}
    sampler = threading.Thread(target=tree_peaks, args=(proc, stop, peaks, cg))
    sampler.start()
    said, _ = proc.communicate()
    stop.set()
    sampler.join()
    wall = time.perf_counter() - start
    oom = "oom_kill 0" not in (cg / "memory.oom_control").read_text()
    cgroup_peak = int((cg / "memory.max_usage_in_bytes").read_text())
    cg.rmdir()
    result = {
        "name": name,
        "flags": flags,
        "returncode": proc.returncode,
        "out_of_memory": oom,
        "wall_seconds": round(wall, 1),
    }
    result |= {
        "peak_process_mib": mib(peaks.get("process")),
        "peak_tree_mib": mib(peaks.get("tree")),
        "cgroup_peak_mib": mib(cgroup_peak),
    }
    if proc.returncode != 0:
        result["said"] = said[-1500:]
    return result


def mib(n) -> float | None:
    return None if n is None else round(n / 2**20, 1)


def near_scores(labels: list[dict], removed_rows) -> dict:
    """Near-duplicate recall (planted copies removed as duplicates) and precision (removed as duplicates that
    were planted), from the removed rows alone."""
    why = {}
    for row in removed_rows:
        why[row["id"]] = row["removed_because"]
    by = defaultdict(lambda: [0, 0])
    removed_as_dup = true_dup = 0
    for i, d in enumerate(labels):
        is_dup = why.get(i, "").startswith(("near duplicates", "exact duplicates"))
        planted = d["kind"] in ("near_dup", "exact_dup")
        removed_as_dup += is_dup
        true_dup += is_dup and planted
        if planted:
            by[d["lang"]][0] += is_dup
            by[d["lang"]][1] += 1
    total = [sum(v[0] for v in by.values()), sum(v[1] for v in by.values())]
    return {"near_recall": ratio(*total), "near_precision": ratio(true_dup, removed_as_dup)}


def removed_rows(out: Path):
    files = (
        sorted(Path(str(out) + ".removed").glob("*.jsonl"))
        if out.is_dir()
        else [out.with_name(out.stem + ".removed.jsonl")]
    )
    for f in files:
        with open(f, encoding="utf-8") as lines:
            for line in lines:
                yield json.loads(line)


def kept_ids(out: Path) -> list:
    files = sorted(out.glob("*.jsonl")) if out.is_dir() else [out]
    return [json.loads(line)["id"] for f in files for line in open(f, encoding="utf-8")]


def settings(tasks: list[int]) -> list[tuple[str, list[str]]]:
    cores = len(os.sched_getaffinity(0))
    out = [("in memory", ["--preprocessing_num_workers", str(cores)])]
    return out + [
        (f"local, {t} task(s)", ["--executor", "local", "--tasks", str(t), "--workers", str(min(t, cores))])
        for t in tasks
    ]


def corpus_runs(
    size: int, labels, corpus: Path, tmp: Path, flags: list[str], limit: int, tasks: list[int], full: bool
) -> list[dict]:
    """Every setting on one corpus; the executor runs' kept rows compared with the in-memory run's."""
    results, reference = [], None
    for k, (name, extra) in enumerate(settings(tasks)):
        out = tmp / f"{size}-{k}" if k else tmp / f"{size}-memory.jsonl"
        print(f"cleaning {size} documents: {name} ...", flush=True)
        r = run(f"{size}-{k}", corpus, out, flags + extra, limit) | {"setting": name, "documents": size}
        r["load_average"] = os.getloadavg()[1]  # the 5-minute load after the run: was the host busy
        if r["returncode"] == 0:
            r["documents_per_second"] = round(size / r["wall_seconds"], 1)
            r["scores"] = score(labels, fates(out)) if full else near_scores(labels, removed_rows(out))
            ids = kept_ids(out)
            reference = ids if reference is None else reference
            r["kept"] = len(ids)
            r["kept_equal_to_first"] = ids == reference
        results.append(r)
    return results


def cmd_executors(args) -> int:
    import tempfile

    from ..common import new_report, write_report
    from .benchmark import cleaning_corpus_versions

    small, large = (600, 1500) if args.quick else (args.documents, args.large)
    tasks = [int(t) for t in args.tasks.split(",")]
    limit = parse_bytes(args.memory_limit)
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        tmp, runs = Path(tmp), []
        for size, flags, full in ((small, ALL_ON, True), (large, ["--dedupe", "near"], False)):
            start = time.perf_counter()
            labels = build_corpus(size, args.seed, tmp / f"corpus-{size}.jsonl")
            print(f"corpus: {size} documents in {time.perf_counter() - start:.0f} s", flush=True)
            runs += corpus_runs(size, labels, tmp / f"corpus-{size}.jsonl", tmp, flags, limit, tasks, full)
            (tmp / f"corpus-{size}.jsonl").unlink()
    result = new_report(small=small, large=large, seed=args.seed, memory_limit=args.memory_limit, tasks=tasks, runs=runs,
                        load_average=os.getloadavg(), **cleaning_corpus_versions())  # fmt: skip
    name = f"cleaning-executors-{result['date']}" + ("-quick" if args.quick else "")
    write_report(args.out_dir, name, result, markdown(result))
    return 0


def parse_bytes(text: str) -> int:
    units = {"GiB": 2**30, "MiB": 2**20}
    for unit, size in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * size)
    raise SystemExit(f"error: --memory-limit takes a size like 4GiB or 512MiB, got {text!r}")


def cell(r: dict, key: str, fmt: str = "{:.0f}") -> str:
    return "" if r.get(key) is None else fmt.format(r[key])


def markdown(r: dict) -> str:
    from ..common import footer
    from .benchmark import pct

    lines = [
        f"# Data cleaning on datatrove's executors, {r['date']}",
        "",
        f"`{r['command']}`: tools/clean_data.py in memory and with `--executor local` on the cleaning corpus "
        f"(tools/bench/cleaning/corpus.py, seed {r['seed']}, English and Chinese, planted duplicates, garbled text), "
        f"each run in a {r['memory_limit']} memory cgroup. {r['small']} documents with every step on "
        f"(`{' '.join(ALL_ON)}`), and {r['large']} documents with `--dedupe near` alone. Recall and precision are "
        "read from each run's outputs. Load average at the end: "
        + ", ".join(f"{x:.1f}" for x in r["load_average"])
        + ".",
        "",
        "| documents | run | documents/s | wall s | load (5 min) | peak RSS, largest process (MiB) | peak RSS, all processes (MiB) | "
        "cgroup peak (MiB) | near-dup recall | near-dup precision | kept rows equal the first run's |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for x in r["runs"]:
        if x["returncode"] != 0:
            why = f"ran out of memory at {r['memory_limit']}" if x["out_of_memory"] else f"failed ({x['returncode']})"
            lines.append(f"| {x['documents']} | {x['setting']} | {why} | {x['wall_seconds']:.0f} | {x['load_average']:.1f} | {cell(x, 'peak_process_mib')} "
                         f"| {cell(x, 'peak_tree_mib')} | {cell(x, 'cgroup_peak_mib')} | | | |")  # fmt: skip
            continue
        s = x["scores"]
        lines.append(
            f"| {x['documents']} | {x['setting']} | {x['documents_per_second']:.0f} | {x['wall_seconds']:.0f} | "
            f"{x['load_average']:.1f} | "
            f"{cell(x, 'peak_process_mib')} | {cell(x, 'peak_tree_mib')} | {cell(x, 'cgroup_peak_mib')} | "
            f"{pct(s['near_recall'])} | {pct(s['near_precision'])} | {'yes' if x['kept_equal_to_first'] else 'no'} |"
        )
    lines += ["", *footer(r)]
    return "\n".join(lines) + "\n"
