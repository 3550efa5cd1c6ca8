"""`python tools/benchmark.py cleaning`: tools/clean_data.py on a labelled corpus (bench/cleaning/corpus.py)
of English and Chinese documents with planted near-duplicates, exact duplicates, garbled text and
repairable mojibake. Each document's fate is read from clean_data's own outputs (OUT.jsonl and
OUT.removed.jsonl, which say why), so what is scored is what a user gets.

Scores: near-duplicate recall (per variant and language) and precision, garbled recall (per variant),
clean documents wrongly removed (per language and reason), documents/s and the peak memory of the whole
process tree; then the same corpus through `--dedupe exact` alone, the baseline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

from ..common import REPO, footer, new_report, write_report, yes
from . import corpus as cleaning_corpus

ALL_ON = ["--fix_text", "true", "--drop_garbled", "true", "--quality_filter", "gopher", "--dedupe", "near"]
GOALS = {"near_recall": 0.9, "near_precision": 0.98, "garbled_recall": 0.9, "clean_removed": 0.02}


def peak_tree_rss(proc: subprocess.Popen, stop: threading.Event, out: list) -> None:
    """Sample the RSS of `proc` and all its children (the map's worker processes) every 0.1 s."""
    import psutil

    peak = 0
    root = psutil.Process(proc.pid)
    while not stop.is_set():
        try:
            procs = [root, *root.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in procs if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.1)
    out.append(peak)


def run_clean(corpus: Path, out: Path, flags: list[str], workers: int) -> dict:
    """tools/clean_data.py as a user runs it, in a fresh datasets cache (so nothing is reused)."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, HF_DATASETS_CACHE=cache)
        cmd = [sys.executable, "tools/clean_data.py", str(corpus), "--output", str(out), *flags]
        cmd += ["--preprocessing_num_workers", str(workers)]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        stop, peak = threading.Event(), []
        sampler = threading.Thread(target=peak_tree_rss, args=(proc, stop, peak))
        sampler.start()
        output, _ = proc.communicate()
        stop.set()
        sampler.join()
        wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"error: clean_data failed:\n{output[-3000:]}")
    report = json.loads(out.with_name(out.stem + ".report.json").read_text())
    return {"report": report, "wall_seconds": round(wall, 1), "peak_rss_mib": round(peak[0] / 2**20, 1)}


def fates(out: Path) -> dict[int, tuple[str, object]]:
    """document id -> (why removed, '' if kept; the id it duplicates, or the kept text). `out` is a file, or the
    directory of shards `--executor` writes (its removed rows in OUT.removed/)."""
    kept, removed = ([out], [out.with_name(out.stem + ".removed.jsonl")]) if not out.is_dir() else (
        sorted(out.glob("*.jsonl")), sorted(Path(f"{out}.removed").glob("*.jsonl")))  # fmt: skip
    result = {}
    for path in kept:
        for line in open(path, encoding="utf-8"):
            r = json.loads(line)
            result[r["id"]] = ("", r["text"])
    for path in removed:
        for line in open(path, encoding="utf-8"):
            r = json.loads(line)
            result[r["id"]] = (r["removed_because"], r["duplicate_of"])
    return result


def ratio(hit: int, total: int) -> dict:
    return {"hit": hit, "total": total, "value": round(hit / total, 4) if total else None}


def score(docs: list[dict], fate: dict) -> dict:
    """The planted labels against what clean_data did."""
    near = defaultdict(lambda: [0, 0])
    garbled = defaultdict(lambda: [0, 0])
    clean = defaultdict(lambda: [0, 0])
    clean_reasons, repairs = Counter(), Counter()
    removed_as_dup, true_dup = 0, 0
    for i, d in enumerate(docs):
        why, _ = fate[i]
        is_dup = why.startswith(("near duplicates", "exact duplicates"))
        removed_as_dup += is_dup
        true_dup += is_dup and d["kind"] in ("near_dup", "exact_dup")
        if d["kind"] in ("near_dup", "exact_dup"):
            key = f"{d['lang']} {d['variant'] or 'exact copy'}"
            near[key][0] += is_dup
            near[key][1] += 1
        elif d["kind"] == "garbled":  # caught: removed as garbled, or repaired by fix_text into its original
            repaired = not why and fate[i][1] == fixed(d["original"])  # the text kept is the repaired original
            key = f"{d['lang']} {d['variant']}"
            garbled[key][0] += why.startswith("garbled") or repaired
            garbled[key][1] += 1
            repairs[key] += repaired
        else:  # clean, and mojibake that fix_text repairs: both must be kept
            clean[d["lang"]][0] += why != ""
            clean[d["lang"]][1] += 1
            if why:
                clean_reasons[f"{d['lang']}: {why}"] += 1
    total = lambda table: ratio(sum(h for h, _ in table.values()), sum(n for _, n in table.values()))  # noqa: E731
    return {
        "near_recall": total(near),
        "near_recall_by": {k: ratio(*v) for k, v in sorted(near.items())},
        "near_precision": ratio(true_dup, removed_as_dup),
        "garbled_recall": total(garbled),
        "garbled_recall_by": {k: ratio(*v) for k, v in sorted(garbled.items())},
        "garbled_repaired_by": dict(sorted(repairs.items())),
        "clean_removed_by_language": {k: ratio(*v) for k, v in sorted(clean.items())},
        "clean_removed_reasons": dict(clean_reasons.most_common()),
    }


def fixed(text: str) -> str:
    from zero_recipes.data.cleaning import fix_text

    return fix_text(text)


def threshold_sweep(docs: list[dict], limit: int) -> dict:
    """Near-duplicate recall and precision of `dedupe.near` at several thresholds, on the first `limit`
    documents that reach dedupe (clean ones, their duplicates, repaired mojibake): what --dedupe_threshold
    trades. Computed in this process from the same signatures clean_data uses."""
    import numpy as np

    from zero_recipes.data import dedupe

    subset = [d for d in docs[:limit] if d["kind"] != "garbled"]
    sigs = np.stack([dedupe.signature(fixed(d["text"])) for d in subset])
    planted = np.array([d["kind"] in ("near_dup", "exact_dup") for d in subset])
    edits = np.array([d["variant"] == "edit" for d in subset])
    out = {}
    for t in (0.5, 0.6, 0.7, 0.8, 0.9):
        found = dedupe.near(sigs, t) >= 0
        out[str(t)] = {
            "near_recall": ratio(int((found & planted).sum()), int(planted.sum())),
            "edit_recall": ratio(int((found & planted & edits).sum()), int((planted & edits).sum())),
            "near_precision": ratio(int((found & planted).sum()), int(found.sum())),
        }
    return {"documents": len(subset), "thresholds": out}


def cmd_cleaning(args) -> int:
    if args.executors:
        from .executors import cmd_executors

        return cmd_executors(args)
    n = 2000 if args.quick else args.documents
    workers = args.num_proc or len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        start = time.perf_counter()
        docs = cleaning_corpus.build(n, seed=args.seed, originals=True)
        for i, d in enumerate(docs):
            d["id"] = i
        cleaning_corpus.write_jsonl([{k: v for k, v in d.items() if k != "original"} for d in docs], corpus)
        built = time.perf_counter() - start
        print(f"corpus: {n} documents in {built:.0f} s; cleaning with every step on ...", flush=True)
        full = run_clean(corpus, Path(tmp) / "all.jsonl", ALL_ON, workers)
        full["scores"] = score(docs, fates(Path(tmp) / "all.jsonl"))
        print("baseline: --dedupe exact only ...", flush=True)
        exact = run_clean(corpus, Path(tmp) / "exact.jsonl", ["--dedupe", "exact"], workers)
        exact["scores"] = score(docs, fates(Path(tmp) / "exact.jsonl"))
        counts = Counter(f"{d['lang']} {d['kind']}" for d in docs)
    print("threshold sweep ...", flush=True)
    sweep = threshold_sweep(docs, limit=min(n, 20_000))
    result = new_report(
        documents=n,
        seed=args.seed,
        workers=workers,
        corpus=dict(sorted(counts.items())),
        all_steps=full,
        exact_only=exact,
        threshold_sweep=sweep,
        goals=GOALS,
        **cleaning_corpus_versions(),
    )
    name = f"cleaning-{result['date']}" + ("-quick" if args.quick else "")
    write_report(args.out_dir, name, result, markdown(result))
    return 0


def cleaning_corpus_versions() -> dict:
    from ..common import optional_versions

    return {"cleaning_versions": optional_versions("datatrove", "ftfy")}


def pct(r: dict) -> str:
    return "n/a" if r["value"] is None else f"{100 * r['value']:.1f} % ({r['hit']}/{r['total']})"


# one list of the page's lines, top to bottom: split, its sections would only pass the same dict along
def markdown(r: dict) -> str:
    a, e = r["all_steps"], r["exact_only"]
    s, b = a["scores"], e["scores"]
    clean_worst = max((x["value"] or 0) for x in s["clean_removed_by_language"].values())
    lines = [
        f"# Data cleaning, {r['date']}",
        "",
        f"`{r['command']}`: tools/clean_data.py on {r['documents']} generated documents (seed {r['seed']}, "
        f"{r['workers']} workers), half English and half Chinese: {', '.join(f'{k} {v}' for k, v in r['corpus'].items())}. "
        "How the corpus is made: tools/bench/cleaning/corpus.py. Each document's fate is read from clean_data's "
        "own outputs.",
        "",
        "| goal | every step on (`" + " ".join(ALL_ON) + "`) | `--dedupe exact` alone (baseline) | met |",
        "| --- | --- | --- | --- |",
        f"| near-duplicate recall ≥ 0.9 | {pct(s['near_recall'])} | {pct(b['near_recall'])} | "
        f"{yes((s['near_recall']['value'] or 0) >= GOALS['near_recall'])} |",
        f"| near-duplicate precision ≥ 0.98 | {pct(s['near_precision'])} | {pct(b['near_precision'])} | "
        f"{yes((s['near_precision']['value'] or 0) >= GOALS['near_precision'])} |",
        f"| garbled recall ≥ 0.9 | {pct(s['garbled_recall'])} | {pct(b['garbled_recall'])} | "
        f"{yes((s['garbled_recall']['value'] or 0) >= GOALS['garbled_recall'])} |",
    ]
    for lang, x in s["clean_removed_by_language"].items():
        base = b["clean_removed_by_language"][lang]
        lines.append(f"| clean {lang} documents wrongly removed ≤ 2 % | {pct(x)} | {pct(base)} | "
                     f"{yes((x['value'] or 0) <= GOALS['clean_removed'])} |")  # fmt: skip
    lines += [
        f"| documents/s | {a['report']['documents_per_second']:.0f} | {e['report']['documents_per_second']:.0f} | |",
        f"| peak memory, whole process tree | {a['peak_rss_mib']:.0f} MiB | {e['peak_rss_mib']:.0f} MiB | |",
        f"| wall time of the command | {a['wall_seconds']:.0f} s | {e['wall_seconds']:.0f} s | |",
        "",
        "Near-duplicate recall by language and variant (every step on):",
        "",
        "| planted | recall | baseline |",
        "| --- | --- | --- |",
        *(f"| {k} | {pct(v)} | {pct(b['near_recall_by'][k])} |" for k, v in s["near_recall_by"].items()),
        "",
        f"`--dedupe_threshold` against near-duplicate recall and precision (on the {r['threshold_sweep']['documents']} "
        "non-garbled documents among the first 20,000; computed in-process from the same signatures; "
        "the default is 0.7):",
        "",
        "| threshold | recall | recall of word/character edits | precision |",
        "| --- | --- | --- | --- |",
        *(
            f"| {t} | {pct(x['near_recall'])} | {pct(x['edit_recall'])} | {pct(x['near_precision'])} |"
            for t, x in r["threshold_sweep"]["thresholds"].items()
        ),
        "",
        "Garbled recall by language and variant (caught: removed as garbled, or repaired by `--fix_text` into "
        "exactly its original text and kept):",
        "",
        "| planted | recall | of it repaired |",
        "| --- | --- | --- |",
        *(f"| {k} | {pct(v)} | {s['garbled_repaired_by'].get(k, 0)} |" for k, v in s["garbled_recall_by"].items()),
        "",
        "Clean documents removed, by reason: "
        + (", ".join(f"{k} ({v})" for k, v in s["clean_removed_reasons"].items()) or "none")
        + f" (worst language {100 * clean_worst:.1f} %).",
        "",
        *footer(r),
        f"- Cleaning: datatrove {r['cleaning_versions'].get('datatrove')}, ftfy {r['cleaning_versions'].get('ftfy')}.",
    ]
    return "\n".join(lines) + "\n"


def add_parsers(sub) -> None:
    p = sub.add_parser("cleaning", help="clean_data.py on planted near-duplicates and garbled text, EN and ZH")
    p.add_argument("--documents", type=int, default=100_000, help="corpus size (default 100,000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-proc", type=int, default=None, help="clean_data's workers (default: all cores)")
    p.add_argument("--quick", action="store_true", help="2,000 documents (the test)")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks"), help="where cleaning-DATE.{md,json} go")
    p.add_argument("--executors", action="store_true",
                   help="in memory against --executor local (--tasks) at --documents and --large documents (--quick: 600, 1,500), "
                        "under --memory-limit (cleaning-executors-DATE.md)")  # fmt: skip
    p.add_argument("--large", type=int, default=1_000_000, help="the large corpus (--dedupe near alone)")
    p.add_argument("--tasks", default="1,2,4", help="the executor runs' task counts")
    p.add_argument("--memory-limit", default="4GiB", help="each run's memory cgroup")
    p.add_argument("--work-dir", default=None, help="where the corpora and outputs go (several GB at 1M)")
    p.set_defaults(func=cmd_cleaning)
