"""The data benchmark: prep throughput vs run_clm.py, time to first step cold vs cached, packing utilisation.

Each preparation runs in its own process with a fresh HF_DATASETS_CACHE and cache_dir, so neither the datasets
fingerprint cache nor our array cache makes a repetition free; ours and the run_clm.py reproduction alternate
(A/B/A/B) and share num_proc.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from itertools import chain
from pathlib import Path

from ..common import REPO, environment, free_port, quiet, run_checked, seed_cache, write_report
from .report import BLOCK, markdown

BENCHMARK_PY = REPO / "tools" / "benchmark.py"
TARGET_TOKENS = 10_000_000  # prep throughput corpus
FIRST_STEP_TOKENS = 100_000_000  # time-to-first-step corpus: a modest real fine-tuning/pretraining set
GOALS = {"prep_ratio": 2.0, "first_step_ratio": 0.10, "packing": 0.95}


# ---- one preparation, timed (runs in a child process with a fresh HF_DATASETS_CACHE) -------------------


def prep_ours(jsonl: str, num_proc: int, cache: str, tok) -> tuple[float, int]:
    from zero_recipes import data
    from zero_recipes.config.train_config import TrainConfig

    cfg = TrainConfig(
        dataset_name=jsonl,
        block_size=BLOCK,
        validation_split_percentage=0,
        cache_dir=cache,
        preprocessing_num_workers=num_proc,
    )
    t = time.perf_counter()
    prepared = data.prepare(cfg, tok, log=quiet)
    return time.perf_counter() - t, int(prepared.train.num_tokens)


def prep_run_clm(jsonl: str, num_proc: int, cache: str, tok) -> tuple[float, int]:
    """transformers' examples/pytorch/language-modeling/run_clm.py data path, with a local json file and no
    validation split: load_dataset -> tokenize map -> group_texts map (default map batch size 1000)."""
    import logging

    from datasets import load_dataset
    from transformers.testing_utils import CaptureLogger

    tok_logger = logging.getLogger("transformers.tokenization_utils_base")
    block_size = min(BLOCK, tok.model_max_length)

    def tokenize_function(examples):
        with CaptureLogger(tok_logger) as cl:
            output = tok(examples[text_column_name])
        if "Token indices sequence length is longer than the" in cl.out:
            tok_logger.warning(
                "^^^^^^^^^^^^^^^^ Please ignore the warning above - this long input will be chunked "
                "into smaller bits before being passed to the model."
            )
        return output

    def group_texts(examples):
        concatenated = {k: list(chain(*examples[k])) for k in examples.keys()}
        total_length = len(concatenated[list(examples.keys())[0]])
        total_length = (total_length // block_size) * block_size
        result = {
            k: [t[i : i + block_size] for i in range(0, total_length, block_size)] for k, t in concatenated.items()
        }
        result["labels"] = result["input_ids"].copy()
        return result

    t = time.perf_counter()
    raw_datasets = load_dataset("json", data_files={"train": jsonl}, cache_dir=cache)
    column_names = list(raw_datasets["train"].features)
    text_column_name = "text" if "text" in column_names else column_names[0]
    tokenized = raw_datasets.map(
        tokenize_function,
        batched=True,
        num_proc=num_proc,
        remove_columns=column_names,
        load_from_cache_file=True,
        desc="Running tokenizer on dataset",
    )
    lm_datasets = tokenized.map(
        group_texts,
        batched=True,
        num_proc=num_proc,
        load_from_cache_file=True,
        desc=f"Grouping texts in chunks of {block_size}",
    )
    seconds = time.perf_counter() - t
    return seconds, len(lm_datasets["train"]) * block_size


def cmd_prep_once(args) -> int:
    import datasets
    import pyarrow.compute  # noqa: F401 -- imported before the clock starts, for both pipelines alike

    from zero_recipes import data
    from zero_recipes.config.train_config import TrainConfig

    cache = Path(os.environ.get("HF_DATASETS_CACHE", ""))
    if not cache.is_dir() or any(cache.iterdir()) or Path(datasets.config.HF_DATASETS_CACHE) != cache:
        sys.exit("prep-once: set HF_DATASETS_CACHE to an empty directory, so nothing is reused")
    tok = data.load_tokenizer(TrainConfig())  # the embedded tokenizer, from the shared cache; not timed
    fn = prep_ours if args.pipeline == "ours" else prep_run_clm
    seconds, tokens = fn(str(Path(args.jsonl).resolve()), args.num_proc, str(cache / "prep"), tok)
    print(json.dumps({"pipeline": args.pipeline, "seconds": seconds, "tokens": tokens}))
    return 0


# ---- the data benchmark ------------------------------------------------------------------------------


def make_corpus(tmp: Path, quick: bool, target: int = TARGET_TOKENS, name: str = "corpus.jsonl") -> dict:
    """The embedded corpus repeated K times (~target tokens; 1 copy with --quick), each copy's lines changed."""
    from zero_recipes import data
    from zero_recipes.config.train_config import TrainConfig

    cfg = TrainConfig()
    texts = [json.loads(line)["text"] for line in data.builtin_corpus_file(cfg).open()]
    tokens = sum(len(x) for x in data.load_tokenizer(cfg)(texts, add_special_tokens=False)["input_ids"])
    copies = 1 if quick else max(1, round(target / tokens))
    path = tmp / name
    with path.open("w") as f:
        for k in range(copies):
            for text in texts:
                f.write(json.dumps({"text": f"{text} (copy {k})"}) + "\n")
    return {
        "path": str(path),
        "copies": copies,
        "documents": copies * len(texts),
        "bytes": path.stat().st_size,
        "approx_tokens": copies * tokens,
    }


def prep_throughput(tmp: Path, corpus: str, num_proc: int, pairs: int) -> dict:
    runs = {"ours": [], "run_clm": []}
    for rep in range(pairs):
        for pipeline in ("ours", "run_clm"):  # A/B/A/B: drift in machine load hits both alike
            cache = Path(tempfile.mkdtemp(prefix=f"prep-{pipeline}-{rep}-", dir=tmp))
            env = {**os.environ, "HF_DATASETS_CACHE": str(cache)}
            cmd = [sys.executable, str(BENCHMARK_PY), "prep-once", pipeline, corpus, "--num-proc", str(num_proc)]
            output = run_checked(cmd, env, 1800, f"prep-once {pipeline}")
            runs[pipeline].append(
                json.loads(next(line for line in reversed(output.splitlines()) if line.startswith('{"pipeline"')))
            )
            shutil.rmtree(cache, ignore_errors=True)
            r = runs[pipeline][-1]
            print(f"  prep {pipeline:8s} rep {rep + 1}/{pairs}: {r['seconds']:.2f}s, {r['tokens']} tokens", flush=True)
    out = {}
    for pipeline, rs in runs.items():
        med = statistics.median(r["seconds"] for r in rs)
        out[pipeline] = {
            "seconds": [r["seconds"] for r in rs],
            "median_seconds": med,
            "tokens": rs[0]["tokens"],
            "tokens_per_sec": rs[0]["tokens"] / med,
        }
    out["ratio_tokens_per_sec"] = out["ours"]["tokens_per_sec"] / out["run_clm"]["tokens_per_sec"]
    out["ratio_time"] = out["run_clm"]["median_seconds"] / out["ours"]["median_seconds"]
    out["goal"], out["met"] = GOALS["prep_ratio"], out["ratio_tokens_per_sec"] >= GOALS["prep_ratio"]
    return out


def train_command(corpus: str, output_dir, port) -> list[str]:
    return [
        "deepspeed",
        "--num_gpus",
        "2",
        "--master_port",
        str(port),
        "train.py",
        "--deepspeed",
        "ds_configs/zero2.json",
        "--dataset_name",
        corpus,
        "--max_steps",
        "1",
        "--logging_steps",
        "1",
        "--eval_steps",
        "0",
        "--save_steps",
        "0",
        "--block_size",
        "256",
        "--per_device_train_batch_size",
        "4",
        "--output_dir",
        str(output_dir),
    ]


def first_step(tmp: Path, corpus: str, timeout: int) -> dict:
    """Two launches of train.py sharing fresh caches: the first builds them (tokenizer and arrays), the
    second should only memory-map them."""
    env = {**os.environ, "ZERO_RECIPES_CACHE": str(tmp / "zr-cache"), "HF_DATASETS_CACHE": str(tmp / "hf-cache")}
    env.pop("OMP_NUM_THREADS", None)
    seed_cache(tmp / "zr-cache")  # the embedded tokenizer is there beforehand: the cold launch pays for the data alone
    times = {}
    for name, run in (("cold", "run1"), ("cached", "run2")):
        cmd = train_command(corpus, tmp / run, free_port())
        output = run_checked(cmd, env, timeout, f"train.py ({name}): {' '.join(cmd)}")
        first = json.loads((tmp / run / "metrics.jsonl").read_text().splitlines()[0])
        times[name] = first["time_to_first_step"]
        print(f"  train.py {name}: time to first step {times[name]:.1f}s", flush=True)
    reused = "tokenisation skipped" in output  # train.py's log line for a cache hit
    if not reused:
        print("  warning: the second launch did not report a cache hit (no 'tokenisation skipped')", flush=True)
    ratio = times["cached"] / times["cold"]
    return {
        "cold_seconds": times["cold"],
        "cached_seconds": times["cached"],
        "ratio": ratio,
        "cache_hit": reused,
        "goal": GOALS["first_step_ratio"],
        "met": ratio <= GOALS["first_step_ratio"],
        "command": " ".join(train_command("<corpus.jsonl>", "<tmp>/run1", "<free port>")),
    }


def make_sft_file(tmp: Path, corpus_words: list[str], n: int = 4000, seed: int = 0) -> Path:
    """Prompt/completion examples with skewed lengths: lognormal word counts, most short, a few long."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words = np.array(corpus_words)
    total = np.clip(rng.lognormal(mean=np.log(40), sigma=0.9, size=n), 4, 400).astype(int)
    path = tmp / "sft.jsonl"
    with path.open("w") as f:
        for t in total:
            k = max(1, int(t * rng.uniform(0.2, 0.8)))
            f.write(
                json.dumps(
                    {
                        "prompt": " ".join(rng.choice(words, k)) + "\n",
                        "completion": " ".join(rng.choice(words, t - k + 1)),
                    }
                )
                + "\n"
            )
    return path


def packing_utilisation(tmp: Path, corpus: str) -> dict:
    import datasets
    import numpy as np

    from zero_recipes import data
    from zero_recipes.config.train_config import TrainConfig

    datasets.disable_progress_bars()
    tok = data.load_tokenizer(TrainConfig())
    vocab = []
    with open(corpus) as f:
        for line in f:
            vocab += [w for w in json.loads(line)["text"].split() if w.isalpha()]
            if len(vocab) > 50_000:
                break
    n = 4000
    sft = make_sft_file(tmp, sorted(set(vocab)), n)
    out = {"examples": n, "block_size": BLOCK, "micro_batch": 8}
    for packing in (True, False):
        cfg = TrainConfig(
            dataset_name=str(sft),
            dataset_format="prompt_completion",
            block_size=BLOCK,
            packing=packing,
            validation_split_percentage=0,
            cache_dir=str(tmp / f"sft-cache-{packing}"),
        )
        prepared = data.prepare(cfg, tok, log=quiet)
        order = data.BatchOrder(prepared.train, 8, 0, 1, 0, prepared.pad_id)
        lengths = prepared.train.row_lengths()
        real = computed = 0
        for _ in range(order.per_rank):
            idx = order.next_indices()
            batch = data.collate([prepared.train.row(int(i)) for i in idx], prepared.pad_id)
            real += int(lengths[idx].sum())
            computed += int(np.prod(batch["input_ids"].shape))
        key = "with_packing" if packing else "without_packing"
        out[key] = {
            "utilisation": real / computed,
            "rows": len(prepared.train),
            "batches": order.per_rank,
            "examples_kept": len(prepared.train.seg),
            "longest_row_tokens": int(lengths.max()),
        }
    out["goal"], out["met"] = GOALS["packing"], out["with_packing"]["utilisation"] >= GOALS["packing"]
    return out


def cmd_data(args) -> int:
    num_proc = args.num_proc or len(os.sched_getaffinity(0))
    pairs = args.pairs or (1 if args.quick else 3)
    tmp = Path(tempfile.mkdtemp(prefix="zr-bench-data-"))
    os.environ["HF_DATASETS_CACHE"] = str(tmp / "hf-cache-main")  # this process's own (untimed) datasets use
    try:
        corpus = make_corpus(tmp, args.quick)
        print(
            f"corpus: {corpus['copies']} copies, {corpus['documents']} documents, ~{corpus['approx_tokens']:,} "
            f"tokens; num_proc {num_proc}; {pairs} pair(s)",
            flush=True,
        )
        result = {
            "date": datetime.date.today().isoformat(),
            "command": " ".join(["python", "tools/benchmark.py"] + sys.argv[1:]),
            **environment(),
            "settings": {
                "quick": args.quick,
                "num_proc": num_proc,
                "pairs": pairs,
                "block_size": BLOCK,
                "corpus_copies": corpus["copies"],
                "corpus_documents": corpus["documents"],
                "corpus_bytes": corpus["bytes"],
                "corpus_approx_tokens": corpus["approx_tokens"],
            },
        }
        result["prep"] = prep_throughput(tmp, corpus["path"], num_proc, pairs)
        big = make_corpus(tmp, args.quick, FIRST_STEP_TOKENS, "first-step.jsonl")
        print(f"time-to-first-step corpus: {big['documents']} documents, ~{big['approx_tokens']:,} tokens", flush=True)
        result["settings"].update(
            first_step_documents=big["documents"],
            first_step_approx_tokens=big["approx_tokens"],
            first_step_bytes=big["bytes"],
        )
        result["time_to_first_step"] = first_step(tmp, big["path"], timeout=600 if args.quick else 1800)
        result["packing"] = packing_utilisation(tmp, corpus["path"])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    write_report(args.out_dir, f"data-{result['date']}", result, markdown(result))
    p, f, k = result["prep"], result["time_to_first_step"], result["packing"]
    print(
        f"prep: ours {p['ours']['tokens_per_sec']:,.0f} tok/s vs run_clm.py {p['run_clm']['tokens_per_sec']:,.0f} "
        f"tok/s = {p['ratio_tokens_per_sec']:.2f}x (goal >= 2x: {'met' if p['met'] else 'NOT met'})"
    )
    print(
        f"time to first step: cold {f['cold_seconds']:.1f}s, cached {f['cached_seconds']:.1f}s = {f['ratio']:.1%} "
        f"(goal <= 10%: {'met' if f['met'] else 'NOT met'})"
    )
    print(
        f"packing utilisation: {k['with_packing']['utilisation']:.1%} with, {k['without_packing']['utilisation']:.1%} "
        f"without (goal >= 95%: {'met' if k['met'] else 'NOT met'})"
    )
    return 0


def add_parsers(sub) -> None:
    d = sub.add_parser("data", help="data pipeline: prep throughput vs run_clm.py, time to first step, packing")
    d.add_argument("--quick", action="store_true", help="1 corpus copy and 1 A/B pair (seconds, for tests)")
    d.add_argument("--out-dir", default=str(REPO / "benchmarks"), help="where data-DATE.{md,json} go")
    d.add_argument("--num-proc", type=int, default=None, help="map workers for both pipelines (default: all cores)")
    d.add_argument("--pairs", type=int, default=None, help="A/B repetitions (default 3, --quick 1)")
    d.set_defaults(func=cmd_data)
    p = sub.add_parser("prep-once", help="one timed preparation in the empty HF_DATASETS_CACHE; prints JSON")
    p.add_argument("pipeline", choices=("ours", "run_clm"))
    p.add_argument("jsonl")
    p.add_argument("--num-proc", type=int, required=True)
    p.set_defaults(func=cmd_prep_once)
