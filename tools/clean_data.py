"""Clean a dataset file once, so many runs can train on the result: the cleaning steps of train.py.

    python tools/clean_data.py raw.jsonl --output clean.jsonl --fix_text true --drop_garbled true \
        --quality_filter gopher --dedupe near

Writes clean.jsonl (the kept documents, every field as it was except text the edits repaired) and
clean.report.json (documents removed per step and reason, with examples; each near-duplicate with the
document it repeats), and prints the same summary. The options are train.py's, with its defaults (all
off); see docs/data.md. Input: a .jsonl/.json/.csv/.parquet/.txt file or a `save_to_disk` directory, in
any of train.py's formats (text, prompt_completion, alpaca, messages).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from zero_recipes.config.cli import coerce
from zero_recipes.config.train_config import TrainConfig, validate_cleaning
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


def parse(argv) -> tuple[TrainConfig, Path]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("input", help="the dataset file (or save_to_disk directory) to clean")
    p.add_argument("--output", required=True, help="where to write the kept documents (JSON lines)")
    for name in OPTIONS:
        p.add_argument(f"--{name}", help=f"as train.py's --{name}")
    args = p.parse_args(argv)
    values = {name: coerce(name, getattr(args, name)) for name in OPTIONS if getattr(args, name) is not None}
    cfg = TrainConfig(dataset_name=args.input, validation_split_percentage=0, **values)
    validate_cleaning(cfg)
    return cfg, Path(args.output)


def main(argv=None) -> int:
    try:
        cfg, output = parse(sys.argv[1:] if argv is None else argv)
        clean(cfg, output)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
