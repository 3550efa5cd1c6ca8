"""The DPO benchmark: train.py's DPO against TRL's DPOTrainer, with a live reference model and with precomputed
reference log-probs, at ZeRO-2 and ZeRO-3.

Every runner is a real 2-rank `deepspeed` launch with the same model directory (train.py's seeded init of a Llama,
saved once with the tokenizer and its chat template: the policy's start and the reference), the same pairs
(data.realistic_pairs, written here), DeepSpeed JSON (raw to TRL: the Trainer fills its "auto"s), torch AdamW,
schedule, pairs per step, max_length, beta and loss, one epoch:
- train.py `--objective dpo` (train_run.py): each pair one stretch, the prompt computed once, no padding; reference
  log-probs computed once by the run's engine before step 1;
- TRL live (peer_run.py --reference live, TRL's default): 2 N padded rows a step and a second model, in a second
  DeepSpeed engine, run forward on every step;
- TRL precompute (--reference precompute): a reference pass over the pairs before training, then 2 N padded rows.

All three are read the same way (probe.py). Each launch starts with empty caches (tokenisation and the reference pass
in every time to first step; train.py's reference file, which a relaunch would read instead, is a fresh path). The
runners alternate in rotated rounds per ZeRO stage; each ratio is the median of window-paired ratios with a
bootstrap interval (bench/paired.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from .. import paired
from ..common import REPO, embedded_tokenizer_dir, free_port, new_report, run_checked, write_report
from . import data, report

# pairs: the epoch; micro: pairs per rank and step; block: train.py's row (prompt + both answers); max_length:
# tokens per side (prompt + answer), TRL's; windows per run after warmup steps; model: over TINY_LLAMA
FULL = dict(pairs=256, micro=4, block=1024, max_length=640, rounds=3, windows=4, warmup=2, model=data.MODEL,
            stages=("zero2", "zero3"))  # fmt: skip
QUICK = dict(
    pairs=8, micro=2, block=1024, max_length=640, rounds=1, windows=1, warmup=0, model={}, stages=("zero3",)
)  # fmt: skip -- ZeRO-3: where TRL's live reference is a second engine
RUNNERS = {
    "train.py": ["--module", "bench.dpo.train_run"],
    "TRL live reference": ["--module", "bench.dpo.peer_run", "--reference", "live"],
    "TRL precomputed reference": ["--module", "bench.dpo.peer_run", "--reference", "precompute"],
}
GOALS = {"vs_trl_live": 2.0, "vs_trl_precompute": 1.5, "memory_vs_trl": 1.0, "first_step_vs_trl": 1.0}
REFERENCE_LINE = re.compile(r"reference: log-probs of (\d+) \+ (\d+) pairs in ([\d.]+) s")


def make_work(tmp: Path, s: dict) -> dict:
    """The model directory and the pairs, with their lengths through the chat template."""
    from zero_recipes import data as zr_data
    from zero_recipes.config.train_config import TrainConfig
    from zero_recipes.data import formats

    tok_dir = embedded_tokenizer_dir()
    tok = zr_data.load_tokenizer(TrainConfig(tokenizer_name_or_path=str(tok_dir)))
    formats.ensure_chat_template(tok, lambda *a: None)
    words, per_word = data.words_and_rate(tok)
    rows = data.realistic_pairs(s["pairs"], words, per_word, seed=0)
    lengths = data.pair_lengths(rows, tok)
    longest_side = max(p + max(c, r) for p, c, r in lengths)
    longest_pair = max(sum(x) for x in lengths)
    if longest_side > s["max_length"] or longest_pair > s["block"]:  # every runner must see every pair whole
        raise RuntimeError(f"a pair of {longest_pair} tokens ({longest_side} a side) does not fit block {s['block']} "
                           f"/ max_length {s['max_length']}")  # fmt: skip
    base = data.base_model(tmp / "base", tok, {"max_position_embeddings": s["block"], **s["model"]})
    pct = lambda xs: {p: sorted(xs)[int(p / 100 * (len(xs) - 1))] for p in (5, 50, 95, 100)}  # noqa: E731
    return {
        "model": str(base),
        "parameters": data.parameters(base),
        "pairs": str(data.write_jsonl(rows, tmp / "pairs.jsonl")),
        "prompt_tokens": pct([x[0] for x in lengths]),
        "answer_tokens": pct([x[1] for x in lengths] + [x[2] for x in lengths]),
        "pair_tokens": sum(sum(x) for x in lengths),  # each prompt once
        "side_tokens": sum(2 * p + c + r for p, c, r in lengths),  # each prompt twice, unpadded
    }


def flags(runner: str, stage: str, s: dict, work: dict, out: Path) -> list[str]:
    f = ["--deepspeed", f"ds_configs/{stage}.json", "--objective", "dpo", "--model_name_or_path", work["model"],
         "--dataset_name", work["pairs"], "--block_size", str(s["block"]), "--max_length", str(s["max_length"]),
         "--per_device_train_batch_size", str(s["micro"]), "--learning_rate", "5e-6", "--warmup_steps", "2",
         "--optim", "adamw_torch", "--beta", "0.1", "--loss_type", "sigmoid", "--max_steps", "0",
         "--num_train_epochs", "1", "--logging_steps", "1000000", "--eval_steps", "0", "--save_steps", "0",
         "--validation_split_percentage", "0", "--report_to", "none", "--seed", "42"]  # fmt: skip
    if runner == "train.py":
        f += ["--output_dir", str(out / "run"), "--reference_cache", str(out / "reference.npz")]
    return f


def runner_env(cache: Path) -> dict:
    env = {**os.environ, "ZERO_RECIPES_CACHE": str(cache / "zr"), "HF_DATASETS_CACHE": str(cache / "hf")}
    env.pop("OMP_NUM_THREADS", None)
    return env


def run_one(runner: str, stage: str, s: dict, work: dict, tmp: Path, tag: str, ranks: int = 2,
            timeout: int = 7200) -> dict:  # fmt: skip
    """One launch; its ranks' probes summed step by step, and the reference pass's seconds."""
    out = tmp / "runs" / f"{tag}-{stage}-{runner.replace(' ', '_').replace('.', '')}"
    out.mkdir(parents=True)
    launcher = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks)]
    cmd = [*launcher, "--master_port", str(free_port()), *RUNNERS[runner], *flags(runner, stage, s, work, out)]
    cmd += ["--probe_out", str(out / "probe")]
    started = time.monotonic()
    log = run_checked(cmd, runner_env(out / "cache"), timeout, f"{runner}: {' '.join(cmd)}")
    wall = time.monotonic() - started
    probes = [json.loads((out / f"probe.rank{r}.json").read_text()) for r in range(ranks)]
    n = min(len(p["starts"]) for p in probes)
    sums = [[sum(p["tokens"][i][k] for p in probes) for i in range(n)] for k in range(3)]
    reference = probes[0]["reference_seconds"]
    if runner == "train.py":
        m = REFERENCE_LINE.search(log)
        if not m:
            raise RuntimeError(f"train.py logged no reference pass:\n{log[-3000:]}")
        reference = float(m[3])
    return summarise_run(probes[0]["starts"][:n], sums, probes, reference, runner, s) | {"launch_seconds": wall}


def summarise_run(starts, sums, probes, reference: float, runner: str, s: dict) -> dict:
    pairs, computed, real = sums
    steps = len(starts)
    epoch = (starts[-1] - starts[0]) * steps / max(1, steps - 1)  # the last step has no end stamp
    live = runner == "TRL live reference"  # its reference runs inside the steps; the others' before step 1
    return {
        "steps": steps,
        "pair_rates": paired.window_rates(starts, pairs, s["windows"], s["warmup"]),
        "pairs": sum(pairs),
        "computed": sum(computed),
        "real": sum(real),
        "padding_share": (sum(computed) - sum(real)) / sum(computed),
        "epoch_seconds": epoch,
        "time_to_first_step": probes[0]["time_to_first_step"],
        "reference_seconds": reference,
        "reference_share": reference / epoch if live else reference / (reference + epoch),
        "max_rss_gib": [p["max_rss_bytes"] / 2**30 for p in probes],
    }


def measure(s: dict, tmp: Path) -> dict:
    work = make_work(tmp, s)
    print(f"  {s['pairs']} pairs, {work['pair_tokens']:,} tokens (each prompt once); model "
          f"{work['parameters'] / 1e6:.1f}M parameters", flush=True)  # fmt: skip
    rounds = {stage: [] for stage in s["stages"]}
    for r, order in enumerate(paired.rotations(list(RUNNERS), s["rounds"])):
        for stage in s["stages"]:
            runs = {}
            for runner in order:
                runs[runner] = run_one(runner, stage, s, work, tmp, f"r{r}")
                print(f"  round {r + 1}/{s['rounds']} {stage} {runner}: {line(runs[runner])}", flush=True)
            rounds[stage].append(runs)
    return {"work": work, "rounds": rounds}


def line(run: dict) -> str:
    return (
        f"{statistics.median(run['pair_rates']):.2f} pairs/s, {run['computed'] / run['pairs']:.0f} tokens computed "
        f"a pair, padding {run['padding_share']:.1%}, first step {run['time_to_first_step']:.1f} s, reference "
        f"{run['reference_seconds']:.1f} s ({run['reference_share']:.0%}), peak RSS "
        + " / ".join(f"{g:.2f}" for g in run["max_rss_gib"])
        + f" GiB; launch {run['launch_seconds']:.0f} s"
    )


def summarise(m: dict, s: dict) -> dict:
    """Per stage and runner: medians over rounds; the ratios paired within rounds."""
    stages = {}
    for stage, rounds in m["rounds"].items():
        runners = {}
        for name in RUNNERS:
            runs = [rd[name] for rd in rounds]
            med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
            runners[name] = {
                "pairs_per_sec": statistics.median(x for r in runs for x in r["pair_rates"]),
                "steps": runs[0]["steps"],
                "pairs": runs[0]["pairs"],
                "computed_tokens": runs[0]["computed"],
                "computed_per_pair": runs[0]["computed"] / runs[0]["pairs"],
                "padding_share": runs[0]["padding_share"],
                "epoch_seconds": med("epoch_seconds"),
                "time_to_first_step": med("time_to_first_step"),
                "reference_seconds": med("reference_seconds"),
                "reference_share": med("reference_share"),
                "max_rss_gib": [max(r["max_rss_gib"][k] for r in runs) for k in range(len(runs[0]["max_rss_gib"]))],
            }
        rates = [{r: run["pair_rates"] for r, run in rd.items()} for rd in rounds]
        per_round = lambda key, a, b, f=lambda x: x: paired.bootstrap(  # noqa: E731
            [[f(rd[a][key]) / f(rd[b][key])] for rd in rounds]
        )
        peak = lambda x: max(x)  # noqa: E731 -- the larger rank's
        ratios = {}
        for short, peer in (("live", "TRL live reference"), ("precompute", "TRL precomputed reference")):
            ratios[f"vs_trl_{short}"] = paired.ratio(rates, "train.py", peer)
            ratios[f"memory_vs_trl_{short}"] = per_round("max_rss_gib", "train.py", peer, peak)
            ratios[f"first_step_vs_trl_{short}"] = per_round("time_to_first_step", "train.py", peer)
        stages[stage] = {"runners": runners, "ratios": ratios, "rounds": rounds}
    return {"settings": s, "data": m["work"], "stages": stages}


def cmd_dpo(args) -> int:
    s = dict(QUICK, quick=True) if args.quick else dict(FULL)
    for key in ("rounds", "pairs"):
        if getattr(args, key):
            s[key] = getattr(args, key)
    if args.model:
        s["model"] = json.loads(args.model)
    if args.stages:
        s["stages"] = tuple(args.stages)
    tmp = Path(tempfile.mkdtemp(prefix="zr-bench-dpo-"))
    try:
        result = new_report(**summarise(measure(s, tmp), s))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the model, the pairs and every launch's caches
    write_report(args.out_dir, f"dpo-{result['date']}", result, report.markdown(result, GOALS, RUNNERS))
    for stage, x in result["stages"].items():
        for name, ratio in x["ratios"].items():
            print(f"{stage} {name}: {paired.text(ratio)}")
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("dpo", help="DPO pairs/s, memory and first step of train.py vs TRL's DPOTrainer (live and "
                       "precomputed reference), ZeRO-2 and ZeRO-3, paired rounds")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="8 pairs, the embedded tiny Llama, 2 steps, 1 round (tests)")
    p.add_argument(
        "--rounds", type=int, help=f"rotated rounds of the three runners per stage (default {FULL['rounds']})"
    )
    p.add_argument("--pairs", type=int, help=f"pairs in the epoch (default {FULL['pairs']})")
    p.add_argument("--model", help="JSON fields over the embedded tiny Llama (default: ~8.4M parameters)")
    p.add_argument("--stages", nargs="+", choices=("zero2", "zero3"), help="ZeRO stages (default both)")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks"), help="where dpo-DATE.{md,json} go")
    p.set_defaults(func=cmd_dpo)
