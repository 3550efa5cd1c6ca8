"""Benchmarks that measure the real code (nothing mocked) and write dated reports to benchmarks/.

    # data pipeline: prep throughput vs run_clm.py, time to first step cold vs cached, packing utilisation
    python tools/benchmark.py data                      # ~10M-token corpus, 3 A/B pairs
    python tools/benchmark.py data --quick --out-dir /tmp/bench   # 1 corpus copy, 1 pair (the test)

    # one timed preparation in a fresh cache, printed as JSON (what `data` runs per repetition)
    HF_DATASETS_CACHE=$(mktemp -d) python tools/benchmark.py prep-once ours corpus.jsonl --num-proc 2

    # data cleaning: near-duplicate recall/precision, garbled recall, clean documents kept (EN, ZH), docs/s, memory
    python tools/benchmark.py cleaning                  # 100,000 documents; --quick: 2,000 (the test)

    # peak host memory of tools/export_hf.py on 2-rank ZeRO-2/3 checkpoints of a ~91M-parameter model
    python tools/benchmark.py export                    # --quick: a ~7M-parameter model

    # tools/estimate_memory.py against real DeepSpeed runs on the CPU (benchmarks/estimator.md)
    python tools/benchmark.py estimator                 # --quick: 2 points

    # tools/estimate_memory.py against published GPU measurements (benchmarks/estimator-gpu-public.md)
    python tools/benchmark.py estimator-public          # from benchmarks/estimator-gpu-public.json

    # ZeRO-3 on a model built before DeepSpeed: the gathered weights torch's linear keeps (2 ranks, CPU)
    python tools/benchmark.py estimator-preloaded       # --quick: one setting

    # where the step's time goes (torch.profiler): train.py with per-tensor and fused AdamW vs the HF Trainer
    python tools/benchmark.py profile                   # 100M Llama; --quick: tiny model, 6 steps

    # overlap_comm and bucket sizes: tokens/s and loss parity against the shipped configs
    python tools/benchmark.py settings                  # --quick: tiny model, 4 steps

    # TP2 x ZeRO-1 (2 ranks) and TP2 x DP2 (4 ranks) against ZeRO-2/3: tokens/s, per-rank peak, loss parity
    python tools/benchmark.py parallel                  # --quick: tiny model, 3 steps; --gpu: bf16 on 4 GPUs

    # PP2 x ZeRO-1 against ZeRO-1/2 on 2 ranks (tokens/s, per-rank peak, loss parity); the bubble against m
    python tools/benchmark.py pipeline                  # --quick: tiny model, ZeRO-1 and PP2 once; --gpu: bf16, 2 GPUs

    # a mixture of experts under ZeRO-2, ZeRO-3 and ZeRO-2 + EP2 (AutoEP) on 2 ranks: tokens/s, per-rank peak, loss
    python tools/benchmark.py moe                       # --quick: tiny Mixtral, 3 steps; --gpu: bf16, 2 GPUs

    # DPO on 2 ranks, ZeRO-2 and ZeRO-3: pairs/s, peak RSS, first step vs TRL's DPOTrainer (live and precomputed reference)
    python tools/benchmark.py dpo                       # --quick: tiny model, 8 pairs, 1 round (the test)

    # long context on 2 ranks: per-rank peak vs length for ZeRO-3, tiled loss, SP=2 and both; longest in a budget
    python tools/benchmark.py longctx                   # --quick: tiny blocks, 4 configurations (the test)

    # Muon against AdamW (ZeRO-3, 2 ranks): loss at equal steps, optimizer state bytes (allocator probe), tokens/s
    python tools/benchmark.py optimizers                # tiny and 100M, 2 rounds; --quick: tiny, 5 steps (the test)

Each subcommand writes benchmarks/<name>-YYYY-MM-DD.{md,json} (longctx also a .png) with the date, versions
and machine. The code lives in tools/bench/, one folder per benchmark (the package `bench`, imported from this
script's folder; not installed with zero_recipes).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Each subcommand and the bench module that defines it (its add_parsers), in --help's order. Only the named
# command's module is imported, so a command imports no package it does not use: `gpu` runs on a machine without
# the cleaning benchmark's ftfy and datatrove. --help, or no command, imports them all to list them.
COMMANDS = {
    "data": "data.benchmark",
    "prep-once": "data.benchmark",
    "cleaning": "cleaning.benchmark",
    "export": "export.benchmark",
    "estimator": "estimator.benchmark",
    "estimator-public": "estimator.public",
    "estimator-preloaded": "estimator.preloaded",
    "mfu": "speed.benchmark",
    "train": "speed.benchmark",
    "profile": "speed.profile",
    "sft": "sft.benchmark",
    "dpo": "dpo.benchmark",
    "settings": "settings.benchmark",
    "gpu": "gpu.benchmark",
    "lora": "lora.benchmark",
    "parallel": "parallel.benchmark",
    "pipeline": "pipeline.benchmark",
    "moe": "moe.benchmark",
    "longctx": "longctx.benchmark",
    "optimizers": "optimizers.benchmark",
}


# What refuses to start on a busy host: the commands that time something on this machine. The others measure
# memory, accuracy or a published figure (their reports still record the host), and `gpu` runs on a lent machine
# whose minutes are counted. --quick proves a code path, not a speed: it never refuses.
TIMED = {"data", "cleaning", "mfu", "train", "profile", "sft", "dpo", "settings", "lora", "parallel", "pipeline"}
TIMED |= {"moe", "optimizers"}


def modules_for(argv: list[str]) -> list[str]:
    """The bench modules to import for this command line: the command's own, or all of them."""
    chosen = COMMANDS.get(argv[0]) if argv else None
    return [chosen] if chosen else list(dict.fromkeys(COMMANDS.values()))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in modules_for(argv):
        importlib.import_module(f"bench.{name}").add_parsers(sub)
    for command in sub.choices.values():
        command.add_argument(
            "--allow-loaded",
            action="store_true",
            help="measure even when other processes keep the host busy (the report is marked loaded)",
        )
    args = parser.parse_args(argv)
    from bench import host_load

    if args.command in TIMED and not args.allow_loaded and not getattr(args, "quick", False):
        if busy := host_load.check_quiet():
            print(
                f"error: the host is busy: {busy}. Timings now would measure the contention: wait until it is quiet, "
                "or pass --allow-loaded to measure anyway (the report says it was loaded)",
                file=sys.stderr,
            )
            return 2
    host_load.start(args.allow_loaded)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
