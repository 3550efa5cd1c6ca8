"""Evaluate a finished run: accuracy on tasks through EleutherAI's lm-evaluation-harness, and generations side
by side for people to read. MODEL_DIR is a train.py output_dir (a full model or a PEFT adapter), a merged
export, or any HF model directory.

    # the quick start's model on the shipped multiple-choice task (eval_tasks/), offline
    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 python tools/evaluate.py outputs/tiny-llama --tasks docstring_cloze

    # tiny-sft's exact match on its held-out questions, greedy, with its chat template; lm-eval's own tasks too
    python tools/evaluate.py outputs/tiny-sft --tasks tiny_instructions hellaswag --limit 200

    # prompts answered by the fine-tuned model and by its base, as an HTML page to read and judge blind
    python tools/evaluate.py outputs/tiny-sft --samples prompts.jsonl --compare outputs/tiny-llama

    # the judges' exports from that page: win rates, agreement, position bias; the pairs for --objective dpo
    python tools/evaluate.py outputs/tiny-sft --judgments ann.jsonl bob.jsonl --preferences_out pairs.jsonl

The numbers are lm-eval's: the tool prints the `lm_eval` command that gives the same values. Results go to
--output (lm-eval's results JSON); the page to --samples_output.{html,jsonl}, the judgments' summary to
--samples_output.judgments.json. docs/evaluation.md says what each number means and does not mean.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from zero_recipes.checkpointing import atomic, storage
from zero_recipes.errors import ConfigError
from zero_recipes.evaluation.harness import CHAT_TEMPLATE_MODES


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path, help="a finished train.py --output_dir, an adapter or HF model directory")
    ap.add_argument("--tasks", nargs="+", default=[], help="lm-eval task names or YAML files (shipped: eval_tasks/)")
    ap.add_argument("--output", type=Path, help="lm-eval's results JSON (default eval/<model dir name>/results.json)")
    ap.add_argument("--limit", type=float, help="at most this many examples per task (a fraction if < 1)")
    ap.add_argument("--batch_size", default="8", help="lm-eval's batch size: a number or 'auto' (default 8)")
    ap.add_argument(
        "--chat_template",
        default="auto",
        choices=CHAT_TEMPLATE_MODES,
        help="render prompts with the model's chat template: auto = when its tokenizer has one (default)",
    )
    ap.add_argument("--samples", type=Path, help="a JSONL of prompts (prompt or messages, optional reference)")
    ap.add_argument("--compare", type=Path, help="a second model answering the same prompts, e.g. the base")
    ap.add_argument("--samples_output", type=Path, help="the page's path without suffix (default eval/<name>/samples)")
    ap.add_argument("--max_new_tokens", type=int, default=64, help="generated tokens at most (default 64)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    ap.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling mass when sampling (default 1.0)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    ap.add_argument("--judgments", type=Path, nargs="+", help="judges' exports from the page (its Export button)")
    ap.add_argument("--preferences_out", type=Path, help="the judged pairs as TRL's prompt/chosen/rejected JSONL")
    ap.add_argument(
        "--keep_truncated", action="store_true", help="write pairs whose chosen answer hit --max_new_tokens too"
    )
    return ap.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    try:
        return run(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(args) -> int:
    from zero_recipes.evaluation import harness
    from zero_recipes.evaluation.model_dir import check_model_dir

    if (args.preferences_out and not args.judgments) or (args.keep_truncated and not args.preferences_out):
        raise ConfigError("--preferences_out needs --judgments FILES, and --keep_truncated needs --preferences_out")
    if not args.tasks and not args.samples and not args.judgments:
        raise ConfigError("nothing to do: give --tasks NAMES_OR_YAMLS, --samples PROMPTS.jsonl, --judgments FILES")
    if args.compare and not args.samples:
        raise ConfigError("--compare needs --samples PROMPTS.jsonl: it answers the same prompts")
    if args.judgments and args.samples:
        raise ConfigError("--judgments reads a page already judged; run --samples and --judgments one at a time")
    if args.limit is not None and args.limit <= 0:
        raise ConfigError(f"--limit must be > 0, got {args.limit}")
    # every input checked before any model loads: the tasks, the prompts, then the model directories
    selection = harness.select_tasks(args.tasks) if args.tasks else None
    prompts, decoding = check_samples(args) if args.samples else (None, None)
    for d in filter(None, (None if args.judgments and not args.tasks else args.model_dir, args.compare)):
        check_model_dir(d, then="evaluate")
    out_dir = Path("eval") / args.model_dir.resolve().name
    results = (args.output or out_dir / "results.json") if selection else None
    samples = (args.samples_output or out_dir / "samples") if prompts or args.judgments else None
    for path, flag in (
        (results, "--output"),
        (samples, "--samples_output"),
        (args.preferences_out, "--preferences_out"),
    ):
        if path is not None:  # before the evaluation, not after it: its hours are not spent to fail at the write
            storage.check_writable(path.parent, flag, given=path)
    if selection:
        with storage.guarded("writing the results", results.parent, flag="--output"):
            evaluate_tasks(args, selection, results)
    if prompts:
        with storage.guarded("writing the samples", samples.parent, flag="--samples_output"):
            write_samples(args, prompts, decoding, samples)
    if args.judgments:
        with storage.guarded("writing the judgments' summary", samples.parent, flag="--samples_output"):
            summarise_judgments(args, samples)
    return 0


def check_samples(args):
    from zero_recipes.evaluation import side_by_side

    decoding = side_by_side.Decoding(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        chat_template=args.chat_template != "off",
    )
    decoding.check()
    return side_by_side.read_prompts(args.samples), decoding


def evaluate_tasks(args, selection, output: Path) -> None:
    from zero_recipes.evaluation import harness

    chat = harness.wants_chat_template(args.chat_template, load_tokenizer(args.model_dir))
    limit = harness.limit_of(args.limit)
    print(f"lm-eval: {harness.cli_command(args.model_dir, selection, limit, args.batch_size, chat)}", file=sys.stderr)
    start = time.perf_counter()
    results = harness.run(
        "hf",
        selection,
        model_args=harness.model_args(args.model_dir),
        limit=limit,
        batch_size=args.batch_size,
        chat_template=chat,
    )
    rows = harness.scores(results)
    print(harness.table(rows))
    output.parent.mkdir(parents=True, exist_ok=True)
    results.pop("samples", None)
    atomic.write_text(output, json.dumps(results, indent=2, default=str, ensure_ascii=False))
    print(f"results: {output} ({time.perf_counter() - start:.1f} s)", file=sys.stderr)


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def write_samples(args, prompts, decoding, stem: Path) -> None:
    from zero_recipes.evaluation import side_by_side
    from zero_recipes.evaluation.model_dir import load

    columns, described = {}, {}
    for d in filter(None, (args.model_dir, args.compare)):
        model, tok = load(d)
        described[str(d)] = decoding.describe(tok)  # each column says whether its tokenizer had a template
        start = time.perf_counter()
        columns[str(d)] = side_by_side.generate(model, tok, prompts, decoding)
        print(f"samples: {len(prompts)} answers from {d} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        del model
    stem.parent.mkdir(parents=True, exist_ok=True)
    title = f"{args.model_dir}" + (f" vs {args.compare}" if args.compare else "")
    side_by_side.write_side_by_side(stem, prompts, columns, described, title, judging=bool(args.compare))
    print(f"samples: {stem}.html and {stem}.jsonl ({decoding.describe()})", file=sys.stderr)
    if args.compare:
        print(f"judge them blind: open {stem}.html, then --judgments the exported files", file=sys.stderr)


def summarise_judgments(args, stem: Path) -> None:
    """The exports read against the page they were made on: the summary printed and written beside the page,
    the page rebuilt with it, and the decisive pairs written for DPO when asked."""
    from zero_recipes.evaluation import judgments, page, sample_records

    if not Path(f"{stem}.jsonl").is_file():
        raise ConfigError(
            f"no page at {stem}.jsonl; write it with --samples PROMPTS.jsonl --compare OTHER, or give --samples_output"
        )
    records = sample_records.read_records(f"{stem}.jsonl")
    judged = judgments.read_judgments(args.judgments, records)
    summary = judgments.summarise(judged)
    print(judgments.summary_text(summary), flush=True)
    atomic.write_text(Path(f"{stem}.judgments.json"), json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    page.write_page(Path(f"{stem}.html"), records, " vs ".join(summary["models"]), judging=True, summary=summary)
    print(f"judgments: {stem}.judgments.json, and the summary on {stem}.html", file=sys.stderr)
    if args.preferences_out:
        write_pairs(judged, args.preferences_out, args.keep_truncated)


def write_pairs(judged, out: Path, keep_truncated: bool) -> None:
    from zero_recipes.evaluation import judgments

    pairs, counts = judgments.preference_pairs(judged, keep_truncated)
    left = ", ".join(f"{n} {why.replace('_', ' ')}" for why, n in counts.items() if why != "pairs" and n)
    if not pairs:
        raise ConfigError(
            f"no decisive judgment to write as a pair ({left or 'nothing judged'}); judge more prompts"
            + ("" if keep_truncated else ", or pass --keep_truncated to keep chosen answers that were cut")
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_text(out, "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in pairs))
    print(f"pairs: {len(pairs)} written to {out} (left out: {left or 'none'})", file=sys.stderr)
    print(f"train on them: deepspeed train.py --objective dpo --dataset_name {out} ...", file=sys.stderr)


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main(sys.argv[1:]))
