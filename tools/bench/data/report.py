"""The data benchmark's report: benchmarks/data-DATE.md from the figures tools/bench/data/benchmark.py measured."""

from __future__ import annotations

from ..common import yes

BLOCK = 1024  # the block size both pipelines prepare (benchmark.py) and the report states


def markdown(r: dict) -> str:
    """The report: one table row per measured figure, kept in the order the report reads, then the notes."""
    lines = [
        f"# Data pipeline benchmark, {r['date']}",
        "",
        f"Command: `{r['command']}`",
        "",
        "| what | ours | baseline | ratio | goal | met? |",
        "|---|---|---|---|---|---|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(r)]
    lines += notes(r)
    return "\n".join(lines) + "\n"


def table_rows(r: dict) -> list[tuple[str, ...]]:
    """(what, ours, baseline, ratio, goal, met?) per measured figure."""
    p, f, k = r["prep"], r["time_to_first_step"], r["packing"]
    o, b = p["ours"], p["run_clm"]
    return [
        (
            "prep throughput, tokens/s (median)",
            f"{o['tokens_per_sec']:,.0f}",
            f"{b['tokens_per_sec']:,.0f} (run_clm.py)",
            f"{p['ratio_tokens_per_sec']:.2f}x",
            f">= {p['goal']:g}x",
            yes(p["met"]),
        ),
        (
            "prep wall time, s (median)",
            f"{o['median_seconds']:.2f}",
            f"{b['median_seconds']:.2f} (run_clm.py)",
            f"{p['ratio_time']:.2f}x faster",
            "",
            "",
        ),
        (
            "tokens produced (block 1024)",
            f"{o['tokens']:,}",
            f"{b['tokens']:,} (run_clm.py)",
            f"{o['tokens'] / b['tokens']:.4f}",
            "",
            "",
        ),
        (
            "time to first step, s",
            f"{f['cached_seconds']:.1f} (cached)",
            f"{f['cold_seconds']:.1f} (cold)",
            f"{f['ratio']:.1%}",
            f"<= {f['goal']:.0%}",
            yes(f["met"]),
        ),
        (
            "packing utilisation (real/computed tokens)",
            f"{k['with_packing']['utilisation']:.1%} (packing)",
            f"{k['without_packing']['utilisation']:.1%} (no packing)",
            "",
            f">= {k['goal']:.0%}",
            yes(k["met"]),
        ),
    ]


def notes(r: dict) -> list[str]:
    """The corpus, the repetitions, the time-to-first-step and packing setups, the machine and versions."""
    p, f, k = r["prep"], r["time_to_first_step"], r["packing"]
    o, b = p["ours"], p["run_clm"]
    m, v = r["machine"], r["versions"]
    s = r["settings"]
    return [
        "",
        f"- Corpus: the embedded corpus x {s['corpus_copies']} ({s['corpus_documents']:,} documents, "
        f"{s['corpus_bytes'] / 1e6:.1f} MB, ~{s['corpus_approx_tokens']:,} tokens); block size {BLOCK}; "
        f"num_proc {s['num_proc']} for both; {s['pairs']} A/B pair(s), each in a fresh process and fresh caches.",
        f"- Prep seconds per repetition: ours {', '.join(f'{x:.2f}' for x in o['seconds'])}; "
        f"run_clm.py {', '.join(f'{x:.2f}' for x in b['seconds'])}.",
        "- Tokens: ours appends EOS to each document and drops only the final partial block; run_clm.py adds "
        "no separator and drops a partial block per 1000-document map batch.",
        f"- Time to first step: `{f['command']}` on a corpus of {s['first_step_documents']:,} documents "
        f"(~{s['first_step_approx_tokens']:,} tokens, {s['first_step_bytes'] / 1e6:.0f} MB), run twice with the "
        "same fresh ZERO_RECIPES_CACHE and HF_DATASETS_CACHE (the embedded tokenizer is built beforehand, so "
        "the cold run pays for the data only); second run "
        f"{'reused the cached arrays' if f['cache_hit'] else '**did not report a cache hit**'}. The cached "
        "launch is mostly fixed cost (imports, process group, engine), so the ratio depends on the corpus size.",
        f"- Packing: {k['examples']} synthetic prompt/completion examples (lognormal lengths, longest "
        f"{k['without_packing']['longest_row_tokens']} tokens, {k['with_packing']['examples_kept']} kept), "
        f"micro-batch {k['micro_batch']}, each batch padded to its longest row; {k['with_packing']['rows']} "
        f"rows packed vs {k['without_packing']['rows']} unpacked.",
        f"- Machine: {m['cpu']}, {m['cores']} cores ({m['cores_usable']} usable), {m['ram_gib']} GiB RAM"
        + (f", GPUs: {', '.join(m['gpus'])}" if m["gpus"] else ", no GPU")
        + ".",
        "- Versions: " + ", ".join(f"{n} {x}" for n, x in v.items()) + ".",
    ]
