"""Clean a dataset file once, so many runs can train on the result: the cleaning steps of train.py.

    python tools/clean_data.py raw.jsonl --output clean.jsonl --fix_text true --drop_garbled true \
        --quality_filter gopher --dedupe near

Writes clean.jsonl (the kept documents, every field as it was except text the edits repaired) and
clean.report.json (documents removed per step and reason, with examples; each near-duplicate with the
document it repeats), and prints the same summary. The options are train.py's, with its defaults (all
off); see docs/data.md. Input: a .jsonl/.json/.csv/.parquet/.txt file or a `save_to_disk` directory, in
any of train.py's formats (text, prompt_completion, alpaca, messages).

Past one machine's memory, the same steps run as datatrove pipelines on its executors, and --output names a
directory of JSON-lines shards that train.py's --dataset_name reads (see zero_recipes/data/clean_at_scale.py):

    python tools/clean_data.py raw.jsonl --output clean/ --dedupe near --executor local --tasks 8 --workers 2
    python tools/clean_data.py raw.jsonl --output clean/ --dedupe near --executor slurm --tasks 512 --partition cpu
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from zero_recipes.config.cli import coerce
from zero_recipes.config.train_config import TrainConfig, validate_cleaning
from zero_recipes.data import clean_at_scale
from zero_recipes.data.clean_file import clean
from zero_recipes.errors import ConfigError

OPTIONS = (
    "fix_text",
    "strip_html",
    "normalize_whitespace",
    "drop_garbled",
    "quality_filter",
    "dedupe",
    "dedupe_threshold",
    "text_column",
    "dataset_format",
    "dataset_split",
    "preprocessing_num_workers",
)


def parse(argv) -> tuple[TrainConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("input", help="the dataset file (or save_to_disk directory) to clean")
    p.add_argument(
        "--output",
        required=True,
        help="where to write the kept documents (JSON lines; with --executor, a directory of shards)",
    )
    for name in OPTIONS:
        p.add_argument(f"--{name}", help=f"as train.py's --{name}")
    engine = p.add_argument_group("on datatrove's executors (a corpus larger than memory, many machines)")
    engine.add_argument("--executor", choices=clean_at_scale.ENGINES, help="run the steps as datatrove pipelines")
    engine.add_argument("--tasks", type=int, help="shares of the input (and of the output's shards); default 1")
    engine.add_argument("--workers", type=int, help="tasks running at once; default: all of them")
    engine.add_argument("--logging_dir", type=Path, help="datatrove's logs and completions; default OUTPUT.work/logs")
    engine.add_argument("--partition", help="Slurm partition (default: the cluster's default)")
    engine.add_argument("--time", default="24:00:00", help="Slurm time limit per task")
    args = p.parse_args(argv)
    values = {name: coerce(name, getattr(args, name)) for name in OPTIONS if getattr(args, name) is not None}
    cfg = TrainConfig(dataset_name=args.input, validation_split_percentage=0, **values)
    validate_cleaning(cfg)
    args.output = Path(args.output)
    given = [f"--{k}" for k in ("tasks", "workers", "logging_dir", "partition") if getattr(args, k) is not None]
    if args.executor is None and given:
        raise ConfigError(f"{given[0]} sets how datatrove's executors run; add --executor local|ray|slurm")
    return cfg, args


def main(argv=None) -> int:
    try:
        cfg, args = parse(sys.argv[1:] if argv is None else argv)
        if args.executor is None:
            clean(cfg, args.output)
            return 0
        tasks = 1 if args.tasks is None else args.tasks
        workers = tasks if args.workers is None else args.workers
        partition = clean_at_scale.check(cfg, args.output, args.executor, tasks, workers, args.partition)
        plan = clean_at_scale.Plan(cfg, args.output, tasks, args.logging_dir)
        clean_at_scale.run(plan, args.executor, workers, partition, args.time)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except clean_at_scale.StageFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
