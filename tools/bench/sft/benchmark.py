"""The SFT speed benchmark: train.py against TRL's SFTTrainer and the HF Trainer on the same conversations.

Every runner is a real 2-rank `deepspeed` launch with the same DeepSpeed JSON, model config and seeded init,
tokenizer and chat template, torch AdamW, schedule, micro-batch of rows, max length and one epoch:
- train.py: packed SFT (its default), through tools/bench/sft/train_run.py;
- TRL SFTTrainer, packing (best-fit decreasing, padding-free), completion-only loss (peer_run.py);
- HF Trainer: prompt-masked labels, DataCollatorForSeq2Seq, group_by_length (peer_run.py);
- train.py on pretraining text, same model and block size: the limit SFT's real tokens/s is held against.

All four read their steps the same way (probe.py). Runners alternate in rotated rounds and each timing
ratio is the median of window-paired ratios with a bootstrap interval (paired.py). Each runner has its own
fresh data caches in round 1 (its cold time to first step) and reuses them afterwards (cached).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from .. import paired
from ..common import (
    REPO,
    embedded_tokenizer_dir,
    embedded_words,
    footer,
    free_port,
    new_report,
    run_checked,
    seed_cache,
    write_report,
    yes,
)
from . import packed_rows, startup as sft_startup
from .data import as_prompt_completion, padding_share, skewed_chats, write_jsonl

# conversations: train set; eval: held out; block: row length (max_length); micro: rows per rank and step; rounds;
# windows per run after warmup steps; text_steps: the text run's length (about the packed SFT epoch); longest: the
# longest conversation's target length, under the block with room for the chat template; startup_pairs: cached
# launches of train.py and TRL, each stopped at its first step, beyond the breakdown's one pair; attention_steps:
# timed steps of each packed-row attention variant (bench/sft/packed_rows.py; default 5).
FULL = dict(
    conversations=1000, eval=100, block=2048, micro=2, rounds=4, windows=6, warmup=3, text_steps=37, longest=1950,
    startup_pairs=9,
)  # fmt: skip
QUICK = dict(
    conversations=120, eval=8, block=512, micro=2, rounds=1, windows=2, warmup=1, text_steps=12, longest=460,
    attention_steps=1,
)  # fmt: skip
RUNNERS = {
    "train.py": ["--module", "bench.sft.train_run"],
    "TRL SFTTrainer": ["--module", "bench.sft.peer_run", "--peer", "trl"],
    "HF Trainer": ["--module", "bench.sft.peer_run", "--peer", "hf"],
    "train.py, text": ["--module", "bench.sft.train_run"],
}
GOALS = {"vs_trl": 1.0, "vs_hf": 1.2, "sft_vs_text": 0.9, "first_step_vs_trl": 0.5, "half_width": 0.03}


def make_work(tmp: Path, s: dict) -> dict:
    """The tokenizer (the embedded one in train.py's cache, where every runner loads it) and the conversations,
    in `messages` form and in TRL's prompt-completion form."""
    from zero_recipes import data
    from zero_recipes.config.train_config import TrainConfig
    from zero_recipes.data import formats

    tok_dir = embedded_tokenizer_dir()
    tok = data.load_tokenizer(TrainConfig(tokenizer_name_or_path=str(tok_dir)))
    words = embedded_words()
    per_word = len(tok(" ".join(words[:500]), add_special_tokens=False)["input_ids"]) / 500
    train = skewed_chats(s["conversations"], words, per_word, seed=0, high=s["longest"])
    held_out = skewed_chats(s["eval"], words, per_word, seed=1, high=s["longest"])
    formats.ensure_chat_template(tok, lambda *a: None)
    lengths = sorted(rendered_length(r, tok) for r in train)
    if lengths[-1] > s["block"]:  # every runner must see whole conversations (train.py drops longer ones)
        raise RuntimeError(f"a conversation of {lengths[-1]} tokens does not fit the {s['block']}-token block")
    return {
        "tokenizer": str(tok_dir),
        "messages": str(write_jsonl(train, tmp / "chats.jsonl")),
        "prompt_completion": str(write_jsonl([as_prompt_completion(r) for r in train], tmp / "chats-pc.jsonl")),
        "eval": str(write_jsonl(held_out, tmp / "eval.jsonl")),
        "length_percentiles": {p: lengths[int(p / 100 * (len(lengths) - 1))] for p in (5, 25, 50, 75, 95, 100)},
        "mean_length": sum(lengths) / len(lengths),
        "tokens": sum(lengths),
    }


def rendered_length(row: dict, tok) -> int:
    """Tokens of a conversation through the chat template (train.py adds one EOS after it)."""
    return len(tok(tok.apply_chat_template(row["messages"], tokenize=False), add_special_tokens=False)["input_ids"])


def flags(runner: str, s: dict, work: dict) -> list[str]:
    """`s` may also carry `model` (fields over the embedded Llama's) and `fragments` (after zero2.json): the GPU
    benchmark's (tools/bench/gpu/parts.py) larger bf16 model."""
    out = [
        "--deepspeed",
        "ds_configs/zero2.json",
        *s.get("fragments", ()),
        "--model_config",  # the embedded tiny Llama, long enough
        json.dumps({"max_position_embeddings": max(s["block"], 1024), **s.get("model", {})}),
        "--tokenizer_name_or_path",
        work["tokenizer"],
        "--block_size",
        str(s["block"]),
        "--per_device_train_batch_size",
        str(s["micro"]),
        "--learning_rate",
        "1e-3",
        "--warmup_steps",
        "2",
        "--logging_steps",
        "1000000",
        "--eval_steps",
        "0",
        "--save_steps",
        "0",
        "--validation_split_percentage",
        "0",
        "--report_to",  # as the peers (report_to=[]): no TensorBoard events, nor its package (the GPU machine's)
        "none",
    ]
    if runner == "train.py, text":  # the embedded pretraining corpus, about as many steps as the SFT epoch
        return out + ["--max_steps", str(s["text_steps"])]
    out += ["--dataset_name", work["messages"], "--max_steps", "0", "--num_train_epochs", "1"]
    if runner == "TRL SFTTrainer":
        out += ["--prompt_completion_file", work["prompt_completion"]]
    return out + ["--eval_file", work["eval"]]


def cache_name(runner: str) -> str:
    return runner.replace(" ", "_").replace(",", "").replace(".", "")


def runner_env(cache: Path) -> dict:
    """A runner's environment with its own data caches under `cache`. The embedded corpus is in them from the start
    (seed_cache), as the conversations' files are for the SFT runners: a cold start prepares its data, and the
    text runner's parses no standard library."""
    if not (cache / "zr").exists():
        seed_cache(cache / "zr")
    env = {**os.environ, "ZERO_RECIPES_CACHE": str(cache / "zr"), "HF_DATASETS_CACHE": str(cache / "hf")}
    env.pop("OMP_NUM_THREADS", None)
    return env


def command(runner: str, s: dict, work: dict, out: Path, ranks: int = 2) -> list[str]:
    """The launch of one runner, its probe writing under `out`. The `deepspeed` launcher is run as a module of
    this interpreter, so no `deepspeed` script need be on PATH (the GPU kit's wheels are installed with --target,
    their scripts in a bin/ of their own)."""
    launcher = [sys.executable, "-m", "deepspeed.launcher.runner"]
    cmd = [*launcher, "--num_gpus", str(ranks), "--master_port", str(free_port()), *RUNNERS[runner]]
    cmd += flags(runner, s, work) + ["--probe_out", str(out / "probe")]
    if RUNNERS[runner][1] == "bench.sft.train_run":
        cmd += ["--output_dir", str(out / "run")]
    return cmd


def run_one(
    runner: str, s: dict, work: dict, tmp: Path, tag: str, ranks: int = 2, timeout: int = 7200, trace: bool = False
) -> dict:
    """One launch of `ranks` ranks; what their probes recorded, summed over ranks step by step. trace: the launch
    also runs under the start-up probe (bench/sft/startup.py), which leaves it running past its first step; its
    breakdown is the result's "startup"."""
    name = cache_name(runner)
    out = tmp / "runs" / f"{tag}-{name}"
    out.mkdir(parents=True)
    env = runner_env(tmp / "caches" / name)  # each runner's own: round 1 is its cold start, later rounds cached
    if s.get("threads"):  # the GPU benchmark's --quick (tools/bench/gpu/parts.py QUICK): one thread a rank
        env["OMP_NUM_THREADS"] = str(s["threads"])
    cmd = command(runner, s, work, out, ranks)
    if trace:
        cmd = sft_startup.traced(cmd, out, keep_going=True)
    run_checked(cmd, env, timeout, f"{runner}: {' '.join(cmd)}")
    probes = [json.loads((out / f"probe.rank{r}.json").read_text()) for r in range(ranks)]
    n = min(len(r["starts"]) for r in probes)
    tokens = [[sum(r["tokens"][i][k] for r in probes) for i in range(n)] for k in range(3)]
    return summarise_run(probes[0]["starts"][:n], tokens, probes, s) | (
        {"startup": sft_startup.read(out)} if trace else {}
    )


def summarise_run(starts: list[float], tokens: list[list[int]], ranks: list[dict], s: dict) -> dict:
    computed, trained, real = tokens
    w, warm = s["windows"], s["warmup"]
    return {
        "steps": len(starts),
        "label_rates": paired.window_rates(starts, trained, w, warm),
        "real_rates": paired.window_rates(starts, real, w, warm),
        "computed": sum(computed),
        "trained": sum(trained),
        "real": sum(real),
        "padding_share": padding_share(sum(computed), sum(real)),
        "train_seconds": starts[-1] - starts[0],
        "time_to_first_step": ranks[0]["time_to_first_step"],
        "max_rss_gib": [r["max_rss_bytes"] / 2**30 for r in ranks],
        "eval_loss": ranks[0].get("eval_loss"),
        "eval_tokens": ranks[0].get("eval_tokens"),
    }


def measure(s: dict, tmp: Path) -> dict:
    work = make_work(tmp, s)
    work["attention"] = packed_rows.measure(s["block"], s["longest"], s.get("attention_steps", 5))
    print(f"  one packed step, text / block mask / per example: {attention_line(work['attention'])}", flush=True)
    # --quick: the breakdown is its one round's train.py and TRL launches, traced (cold), not two more launches
    quick = s.get("quick")
    rounds = []
    for r, order in enumerate(paired.rotations(list(RUNNERS), s["rounds"])):
        runs = {}
        for runner in order:
            trace = bool(quick) and r == 0 and runner in sft_startup.RUNNERS
            runs[runner] = run_one(runner, s, work, tmp, f"r{r}", trace=trace)
            print(f"  round {r + 1}/{s['rounds']} {runner}: {line(runs[runner])}", flush=True)
        rounds.append(runs)

    def env_of(runner: str, fresh: bool) -> dict:  # fresh caches, or the ones the runner's rounds built
        return runner_env(tmp / ("startup-caches" if fresh else "caches") / cache_name(runner))

    cmd_of = lambda runner, out: command(runner, s, work, out)  # noqa: E731
    if quick:
        startup = {f"{r}, cold": rounds[0][r].pop("startup") for r in sft_startup.RUNNERS}
        first = [[startup[f"{r}, cold"]["time_to_first_step"] for r in sft_startup.RUNNERS]]
    else:
        startup = sft_startup.measure(cmd_of, env_of, tmp, sft_startup.STATES)
        first = [[startup[f"{r}, cached"]["time_to_first_step"] for r in sft_startup.RUNNERS]]
    first += sft_startup.pairs(cmd_of, env_of, tmp, s.get("startup_pairs", 0))
    return {"work": work, "rounds": rounds, "startup": startup, "startup_pairs": first}


def attention_line(a: dict) -> str:
    return (
        f"{a['text']:.3f} / {a['block_mask']:.3f} / {a['per_example']:.3f} s "
        f"(attention {a['block_mask_attention_share']:.0%} of the masked step)"
    )


def line(run: dict) -> str:
    return (
        f"{statistics.median(run['label_rates']):,.0f} label tokens/s, {statistics.median(run['real_rates']):,.0f} "
        f"real, padding {run['padding_share']:.1%}, first step {run['time_to_first_step']:.1f}s"
    )


def summarise(m: dict, s: dict) -> dict:
    """Per runner: medians over rounds; the headline ratios paired within rounds (paired.py)."""
    rounds = m["rounds"]
    label = [{r: run["label_rates"] for r, run in rd.items()} for rd in rounds]
    real = [{r: run["real_rates"] for r, run in rd.items()} for rd in rounds]
    cached = rounds[1:]  # round 1 built each runner's caches (cold)
    runners = {}
    for name in RUNNERS:
        runs = [rd[name] for rd in rounds]
        runners[name] = {
            "label_tokens_per_sec": statistics.median(x for r in runs for x in r["label_rates"]),
            "real_tokens_per_sec": statistics.median(x for r in runs for x in r["real_rates"]),
            "padding_share": runs[0]["padding_share"],
            "steps": runs[0]["steps"],
            "trained_tokens": runs[0]["trained"],
            "real_tokens": runs[0]["real"],
            "epoch_seconds": statistics.median(r["train_seconds"] for r in runs),
            "first_step_cold": runs[0]["time_to_first_step"],
            "first_step_cached": statistics.median(r["time_to_first_step"] for r in runs[1:]) if cached else None,
            "max_rss_gib": [max(r["max_rss_gib"][k] for r in runs) for k in range(2)],
            "eval_loss": statistics.median(r["eval_loss"] for r in runs) if runs[0]["eval_loss"] else None,
        }
    ratios = {
        "vs_trl": paired.ratio(label, "train.py", "TRL SFTTrainer"),
        "vs_hf": paired.ratio(label, "train.py", "HF Trainer"),
        "sft_vs_text": paired.ratio(real, "train.py", "train.py, text"),
    }
    if cached:
        ratios["first_step_vs_trl"] = paired.bootstrap(
            [[rd["train.py"]["time_to_first_step"] / rd["TRL SFTTrainer"]["time_to_first_step"]] for rd in cached]
        )
    if m.get("startup_pairs"):  # traced launches stopped at the first step: many pairs for little time
        ratios["first_step_traced_vs_trl"] = paired.bootstrap([[a / b] for a, b in m["startup_pairs"]])
    return {
        "settings": s,
        "data": m["work"],
        "runners": runners,
        "ratios": ratios,
        "rounds": rounds,
        "startup": m.get("startup", {}),
        "startup_pairs": m.get("startup_pairs", []),
    }


def beside(r: dict, other: str, key: str = "label_tokens_per_sec") -> str:
    """train.py's median rate and the other runner's, beside their ratio: a loaded host shows in the rates."""
    a, b = r["runners"]["train.py"][key], r["runners"][other][key]
    return f" ({a:,.0f} / {b:,.0f})"


# one list of the page's lines, top to bottom: split, its sections would only pass the same dict along
def markdown(r: dict) -> str:
    s, d, q = r["settings"], r["data"], r["ratios"]
    p = d["length_percentiles"]
    lines = [
        f"# SFT speed, {r['date']}",
        "",
        f"Command: `{r['command']}`",
        "",
        f"{s['conversations']:,} generated one-turn conversations (`messages`), {d['tokens']:,} tokens through the "
        f"chat template, mean {d['mean_length']:.0f}; percentiles 5/25/50/75/95/100: "
        + "/".join(str(p[k]) for k in p)
        + f". Embedded tiny Llama (2.3M parameters) with {s['block']}-token rows, micro-batch {s['micro']} rows x "
        "2 ranks, ds_configs/zero2.json, fp32, one epoch, {rounds} rotated rounds.".format(rounds=s["rounds"]),
        "",
        "| runner | label tokens/s | real tokens/s | padding | steps | label tokens | epoch s | first step cold / "
        "cached s | peak RSS per rank GiB | held-out loss |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, x in r["runners"].items():
        cached = f"{x['first_step_cached']:.1f}" if x["first_step_cached"] is not None else "-"
        loss = f"{x['eval_loss']:.3f}" if x["eval_loss"] is not None else "-"
        lines.append(
            f"| {name} | {x['label_tokens_per_sec']:,.0f} | {x['real_tokens_per_sec']:,.0f} | {x['padding_share']:.1%} "
            f"| {x['steps']} | {x['trained_tokens']:,} | {x['epoch_seconds']:.0f} | {x['first_step_cold']:.1f} / "
            f"{cached} | {' / '.join(f'{g:.2f}' for g in x['max_rss_gib'])} | {loss} |"
        )
    lines += [
        "",
        "Ratios: median of window-paired ratios (each run's steady epoch in "
        f"{s['windows']} windows after {s['warmup']} warm-up steps; window i of one runner over window i of the "
        "other in the same round), 95 % interval from a bootstrap over rounds and pairs (tools/bench/paired.py).",
        "",
        "| ratio | median (95 % interval) | goal | met? | interval within ±3 %? |",
        "|---|---|---|---|---|",
        row(
            f"train.py / TRL SFTTrainer, label tokens/s{beside(r, 'TRL SFTTrainer')}",
            q["vs_trl"],
            f">= {GOALS['vs_trl']}",
            True,
        ),
        row(
            f"train.py / HF Trainer, label tokens/s{beside(r, 'HF Trainer')}", q["vs_hf"], f">= {GOALS['vs_hf']}", True
        ),
        row(
            f"train.py SFT / train.py text, real tokens/s{beside(r, 'train.py, text', 'real_tokens_per_sec')}",
            q["sft_vs_text"],
            f">= {GOALS['sft_vs_text']}",
            True,
        ),
    ]
    if "first_step_vs_trl" in q:
        lines.append(
            row(
                "cached time to first step, train.py / TRL",
                q["first_step_vs_trl"],
                f"<= {GOALS['first_step_vs_trl']}",
                False,
            )
        )
    if "first_step_traced_vs_trl" in q:
        x = q["first_step_traced_vs_trl"]
        pairs = r["startup_pairs"]
        seconds = f" ({statistics.median(a for a, _ in pairs):.1f} / {statistics.median(b for _, b in pairs):.1f} s)"
        what = f"the same, {x['pairs']} traced launch pairs stopped at the first step{seconds}"
        if s.get("quick"):
            what = "cold time to first step, train.py / TRL, the round's traced launches"
        lines.append(row(what, x, f"<= {GOALS['first_step_vs_trl']}", False))
    lines += [
        "",
        "- label tokens: the targets the loss counts; real: non-padding positions; padding: the share of computed "
        "positions that were padding (tools/bench/sft/data.py).",
        "- held-out loss: every runner's trained model scored by the same code on the same "
        f"{s['eval']} held-out conversations (mean over assistant tokens).",
        "- first step: process start to the end of the first optimizer step; round 1 ran with empty data caches "
        "(cold), later rounds reused them (cached).",
        *attention_notes(d.get("attention")),
        *sft_startup.markdown(r.get("startup", {}), rounds_traced=bool(s.get("quick"))),
        "",
        *footer(r),
    ]
    return "\n".join(lines) + "\n"


def attention_notes(a: dict | None) -> list[str]:
    if not a:
        return []
    return [
        f"- One forward+backward of two packed rows ({' and '.join(map(str, a['examples_per_row']))} examples; "
        "bench/sft/packed_rows.py, 1 thread), "
        f"text / transformers' block mask / train.py's per-example sdpa: {attention_line(a)}. The mask makes "
        "attention grow with the row; the per-example split (zero_recipes/modeling/packed_attention.py) with the examples; "
        "on GPUs flash-attention's varlen kernel does the same (`--attn_implementation flash_attention_2`).",
    ]


def row(what: str, x: dict, goal: str, at_least: bool) -> str:
    bound = float(goal.split()[-1])
    met = x["median"] >= bound if at_least else x["median"] <= bound
    return f"| {what} | {paired.text(x)} | {goal} | {yes(met)} | {yes(x['half_width'] <= GOALS['half_width'])} |"


def cmd_sft(args) -> int:
    s = dict(QUICK, quick=True) if args.quick else dict(FULL)
    if args.rounds:
        s["rounds"] = args.rounds
    if args.startup_pairs is not None:
        s["startup_pairs"] = args.startup_pairs
    tmp = Path(tempfile.mkdtemp(prefix="zr-bench-sft-"))
    result = new_report(**summarise(measure(s, tmp), s))
    write_report(args.out_dir, f"sft-{result['date']}", result, markdown(result))
    for name, x in result["ratios"].items():
        print(f"{name}: {paired.text(x)}")
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("sft", help="SFT tokens/s of train.py vs TRL's SFTTrainer vs the HF Trainer, paired rounds")
    p.add_argument("--quick", action="store_true", help="120 short conversations, 1 round (for tests)")
    p.add_argument("--rounds", type=int, help="rotated rounds of the four runners (default 4)")
    p.add_argument(
        "--startup-pairs",
        type=int,
        help="traced train.py and TRL launches to the first step beyond the breakdown's (default 9; --quick 0)",
    )
    p.add_argument("--out-dir", default=str(REPO / "benchmarks"), help="where sft-DATE.{md,json} go")
    p.set_defaults(func=cmd_sft)
