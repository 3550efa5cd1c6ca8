"""The estimator benchmark: tools/estimate_memory.py's prediction against real DeepSpeed runs on the CPU.

Each point launches zero_recipes/memory/probe.py through the real launcher (1, 2 or 4 CPU ranks), which
records every allocation of the CPU allocator during init, forward/backward and the optimizer step. On
the CPU accelerator device and host are one pool, so the comparison is measured peak vs the estimate's
device + host bytes of one rank, at the phase where the measurement peaked, for the most loaded rank.
The estimate runs with `accelerator="cpu"`: a CPU steps with torch's single-tensor AdamW.

LoRA points (an 8th element: r and dropout) load a pretrained base, as LoRA needs: the model saved in bf16 (as
hub checkpoints are) to a temporary directory, then `--model_name_or_path` and `--lora_r`, so the probe loads
and wraps it exactly as train.py does. `--only lora` measures just them and keeps the other points of the
existing report (their estimate is unchanged by LoRA).

Tensor-parallel points (a 9th element: AutoTP's autotp_size) add `{"tensor_parallel": {"autotp_size": N}}` as one
more --deepspeed fragment; the probe feeds each TP group the same tokens. `--only tp` measures just them.

Long-context points (a 10th element: {"sp": N, "tiled_loss": bool, "tiled_mlp": bool}) add
`{"sequence_parallel_size": N}` as one more fragment and pass train.py's --tiled_loss / --tiled_mlp; the probe
shards each row across the SP group and installs the loss and MLP as train.py does. `--only long` measures them.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from zero_recipes.config.shipped import PRECISIONS, select

from ..common import REPO, free_port, new_report, run_checked, write_report
from .report import MODELS, long_options, markdown

CONFIGS = select("zero0", "zero1", "zero2", "zero3", "zero2+offload_optimizer", "zero3+offload_all")
# (model, config, precision, ranks, micro-batch, seq len, gradient checkpointing)
POINTS = [
    ("B", c, prec, n, 1, 16, False)
    for c in ("zero0", "zero1", "zero2", "zero3")
    for prec, n in (("fp32", 1), ("bf16", 2))
]
POINTS += [("B", c, "bf16", n, 1, 16, False) for c in ("zero2+offload_optimizer", "zero3+offload_all") for n in (1, 2)]
POINTS += [("B", c, "bf16", 4, 1, 16, False) for c in ("zero2", "zero3")]
POINTS += [
    ("B", c, prec, n, 2, 512, gc)
    for c in ("zero2", "zero3")
    for prec, n, gc in (("bf16", 1, False), ("bf16", 1, True), ("fp32", 2, False))
]
POINTS += [("A", c, "bf16", 2, 4, 256, gc) for c in ("zero1", "zero3") for gc in (False, True)]
# LoRA r16 on all-linear: every ZeRO stage, fp32 and bf16, 1 and 2 ranks, offload, activations (dropout), and
# the held-out model
LORA = {"r": 16, "dropout": 0.0}
LORA_POINTS = [
    ("B", "zero0", "fp32", 1, 1, 16, False, LORA),
    ("B", "zero0", "bf16", 2, 1, 16, False, LORA),
    ("B", "zero2", "bf16", 2, 1, 16, False, LORA),
    ("B", "zero2+offload_optimizer", "bf16", 2, 1, 16, False, LORA),
    ("B", "zero3", "fp32", 1, 1, 16, False, LORA),
    ("B", "zero3", "bf16", 1, 1, 16, False, LORA),
    ("B", "zero3", "bf16", 2, 1, 16, False, LORA),
    ("B", "zero3+offload_all", "bf16", 2, 1, 16, False, LORA),
    ("B", "zero2", "bf16", 1, 2, 512, False, {"r": 16, "dropout": 0.1}),
    ("A", "zero1", "bf16", 2, 4, 256, True, LORA),
    ("A", "zero3", "bf16", 2, 4, 256, False, LORA),
]
POINTS += LORA_POINTS
# AutoTP, 2 ranks per group: TP alone on 2 ranks (ZeRO-1/2, fp32 and bf16, short and activation-heavy sequences)
# and TP2 x DP2 on 4 ranks (ZeRO-1/2 then partition over the 2 data-parallel ranks), on both models. ZeRO-3 with TP
# is left out until its estimate is: one probe of it is 23 % over (the report says so)
TP_POINTS = [
    ("B", "zero1", "fp32", 2, 1, 16, False, None, 2),
    ("B", "zero2", "bf16", 2, 1, 16, False, None, 2),
    ("B", "zero1", "bf16", 2, 2, 512, False, None, 2),
    ("B", "zero2", "fp32", 2, 2, 512, False, None, 2),
    ("A", "zero2", "bf16", 4, 4, 256, False, None, 2),
    ("A", "zero1", "fp32", 4, 4, 256, True, None, 2),
]
POINTS += TP_POINTS
# Ulysses SP and train.py's tiling: SP2 x ZeRO-3 at two lengths (the loss untiled: 512 and 1024 local tokens are
# under L's 4194-token tile), the tiny Llama at a 128k vocabulary with the loss tiled (4 tiles of 512) and not,
# SP2 with the tiled MLP (2 tiles of 512 tokens per MLP), and SP2 with the tiled loss engaged (2048 local tokens)
SP2 = {"sp": 2}
LONG_POINTS = [
    ("L", "zero3", "bf16", 2, 1, 512, False, None, 1, {"sp": 1}),  # control: SP2 at 1024's tokens per rank, no SP
    ("L", "zero3", "bf16", 2, 1, 1024, False, None, 1, SP2),
    ("L", "zero3", "bf16", 2, 1, 2048, False, None, 1, SP2),
    ("T", "zero2", "bf16", 1, 1, 2048, False, None, 1, {"tiled_loss": True}),
    ("T", "zero2", "bf16", 1, 1, 2048, False, None, 1, {"tiled_loss": False}),
    ("L", "zero3", "bf16", 2, 1, 2048, False, None, 1, {"sp": 2, "tiled_mlp": True}),
    ("T", "zero3", "bf16", 2, 1, 4096, False, None, 1, SP2),
]
POINTS += LONG_POINTS
QUICK = [("A", "zero2", "bf16", 2, 2, 128, False), ("A", "zero3", "fp32", 1, 2, 128, True)]


def pretrained(model: str, tmp: Path) -> Path:
    """A random model saved as a pretrained checkpoint in bf16, once per model: the base a LoRA point loads."""
    out = tmp / f"pretrained-{model}"
    if not out.is_dir():
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        config = AutoConfig.for_model("llama", **MODELS[model])
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(out)
    return out


def unpack(point):
    """(model, config, precision, ranks, micro, seq, gc, lora or None, tensor-parallel size, long-context options)."""
    return (*point, *(None, 1, None)[len(point) - 7 :])


def tp_fragment(tp: int, tmp: Path) -> list[str]:
    """The --deepspeed fragment that turns AutoTP on, none for tp 1."""
    if tp == 1:
        return []
    out = tmp / f"tp{tp}.json"
    out.write_text(json.dumps({"tensor_parallel": {"autotp_size": tp}}) + "\n")
    return [str(out)]


def sp_fragment(sp: int, tmp: Path) -> list[str]:
    """The --deepspeed fragment that turns Ulysses on (as ds_configs/spN.json), none for sp 1."""
    if sp == 1:
        return []
    out = tmp / f"sp{sp}.json"
    out.write_text(json.dumps({"sequence_parallel_size": sp}) + "\n")
    return [str(out)]


def probe(point, tmp: Path) -> dict:
    model, config, precision, ranks, micro, seq, gc, lora, tp, long = unpack(point)
    opts = long_options(long)
    files = [*CONFIGS[config], *PRECISIONS[precision], *tp_fragment(tp, tmp), *sp_fragment(opts["sp"], tmp)]
    if lora:
        source = ["--model_name_or_path", str(pretrained(model, tmp))]
        source += ["--lora_r", str(lora["r"]), "--lora_dropout", str(lora["dropout"])]
    else:
        source = ["--model_config", json.dumps(MODELS[model])]
    out = tmp / f"probe-{abs(hash(json.dumps(point)))}.json"
    launcher = (
        [sys.executable, "-m"]
        if ranks == 1
        else [
            "deepspeed",
            "--num_gpus",
            str(ranks),
            "--master_port",
            str(free_port(os.environ.get("ZERO_RECIPES_TEST_PORT_RANGE"))),
            "--module",
        ]
    )
    cmd = (
        launcher
        + [
            "zero_recipes.memory.probe",
            "--deepspeed",
            *files,
            *source,
            "--per_device_train_batch_size",
            str(micro),
            "--block_size",
            str(seq),
            "--probe_out",
            str(out),
        ]
        + (["--gradient_checkpointing", "true"] if gc else [])
        + ["--tiled_loss", str(opts["tiled_loss"]).lower(), "--tiled_mlp", str(opts["tiled_mlp"]).lower()]
    )
    run_checked(cmd, None, 900, f"memory probe {point}")
    return json.loads(out.read_text())


def predict(point, measured: dict) -> dict:
    from transformers import AutoConfig

    from zero_recipes.memory import Launch, estimate, rank_total

    model, _config, _precision, ranks, micro, seq, gc, lora, _tp, long = unpack(point)
    opts = long_options(long)
    config = AutoConfig.for_model("llama", **MODELS[model])
    launch = Launch(
        ranks,
        1,
        micro,
        seq,
        gc,
        "sdpa",
        accelerator="cpu",
        tiled_loss=opts["tiled_loss"],
        tiled_mlp=opts["tiled_mlp"],
    )  # the SP size is in the probe's resolved DeepSpeed config, as in train.py's
    e = estimate(config, measured["ds_config"], launch, lora=lora_config_of(lora))
    rank = max(measured["ranks"], key=lambda r: max(r["peak"].values()))
    phase = max(rank["peak"], key=rank["peak"].get)
    got, want = rank_total(e, phase), rank["peak"][phase]
    return {
        "measured_bytes": want,
        "predicted_bytes": got,
        "phase": phase,
        "error": got / want - 1,
        "num_params": rank["num_params"],
        "predicted_params_per_rank": e.params_per_rank,
        "activations_bytes": e.phases["forward_backward"]["activations_bytes"],
        "phase_errors": {ph: rank_total(e, ph) / rank["peak"][ph] - 1 for ph in rank["peak"]},
    }


def lora_config_of(lora: dict | None):
    """The peft LoraConfig train.py would build for these options (zero_recipes.adapters.lora.lora_config)."""
    if not lora:
        return None
    import dataclasses

    from zero_recipes.adapters.lora import lora_config
    from zero_recipes.config.train_config import TrainConfig

    return lora_config(dataclasses.replace(TrainConfig(), lora_r=lora["r"], lora_dropout=lora["dropout"]))


def kind(point_or_row) -> str:
    """ "long", "tp", "lora" or "full": what `--only` selects, and the order of the report's sections."""
    if isinstance(point_or_row, dict):
        lora, tp, long = point_or_row.get("lora"), point_or_row.get("tp", 1), point_or_row.get("long")
    else:
        _m, _c, _p, _n, _b, _s, _g, lora, tp, long = unpack(point_or_row)
    return "long" if long else "tp" if tp > 1 else "lora" if lora else "full"


SECTIONS = ("full", "lora", "tp", "long")


def measure_row(point, tmp: Path) -> dict:
    """One point launched and probed: its settings, the probe's own record (kept, so a later estimate can be
    compared with the same measurement: `--repredict`), and the estimate against it."""
    measured = probe(point, tmp)
    keys = ("model", "config", "precision", "ranks", "micro", "seq", "gc", "lora", "tp", "long")
    row = dict(zip(keys, unpack(point)))
    row["probe"] = {"ranks": measured["ranks"], "world": measured["world"], "ds_config": measured["ds_config"]}
    return predicted_row(row)


def predicted_row(row: dict) -> dict:
    """The row's estimate recomputed from its stored probe record (the estimator as it is now)."""
    keys = ("model", "config", "precision", "ranks", "micro", "seq", "gc", "lora", "tp", "long")
    point = tuple(row[k] for k in keys)
    row.update(predict(point, row["probe"]))
    if row["lora"]:
        row["trainable_params"] = max(r["trainable_params"] for r in row["probe"]["ranks"])
    return row


def cmd_estimator(args) -> int:
    if args.repredict:  # the same measurements, today's estimate: no launch
        old = json.loads(Path(args.repredict).read_text())
        rows = [predicted_row(r) for r in old["points"]]
        result = {**old, "points": rows, "predicted_with": " ".join(["python", "tools/benchmark.py"] + sys.argv[1:])}
        write_report(args.out_dir, "estimator", result, markdown(result))
        return 0
    points = QUICK if args.quick else [p for p in POINTS if kind(p) == args.only] if args.only else POINTS
    tmp = Path(tempfile.mkdtemp(prefix="zr-bench-estimator-"))
    rows = []
    for i, point in enumerate(points):
        row = measure_row(point, tmp)
        rows.append(row)
        (tmp / "rows-so-far.json").write_text(json.dumps(rows) + "\n")  # what a stopped run completed
        print(
            f"  [{i + 1}/{len(points)}] {point}: measured {row['measured_bytes'] / 1e6:.1f} MB, predicted "
            f"{row['predicted_bytes'] / 1e6:.1f} MB ({row['error']:+.1%}) at {row['phase']} ({tmp})",
            flush=True,
        )
    if args.only:  # keep the report's other points, measured before
        previous = json.loads((Path(args.out_dir) / "estimator.json").read_text())["points"]
        rows = [p for p in previous if kind(p) != args.only] + rows
        rows.sort(key=lambda p: SECTIONS.index(kind(p)))  # stable: each section keeps its order
    result = new_report(points=rows)
    write_report(args.out_dir, "estimator" if not args.quick else "estimator-quick", result, markdown(result))
    return 0


def add_parsers(sub) -> None:
    e = sub.add_parser("estimator", help="memory estimate vs real DeepSpeed runs on the CPU (benchmarks/estimator.md)")
    e.add_argument("--quick", action="store_true", help="2 points on the small model (for tests)")
    e.add_argument(
        "--only",
        choices=["full", "lora", "tp", "long"],
        help="measure only the full fine-tuning, LoRA, tensor-parallel or long-context (SP, tiling) points; the report keeps "
        "the others as measured before",
    )
    e.add_argument(
        "--repredict",
        metavar="JSON",
        help="no launch: recompute every point's estimate from the probe records an earlier run stored in JSON "
        "(an estimator.json) and rewrite the report",
    )
    e.add_argument("--out-dir", default=str(REPO / "benchmarks"), help="where estimator.{md,json} go")
    e.set_defaults(func=cmd_estimator)
