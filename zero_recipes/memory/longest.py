"""tools/estimate_memory.py --table's last part, the longest sequence that fits (`longest_sequence`).

It answers another question than the table's: with Ulysses sequence parallelism over every GPU of a node
(`sequence_parallel_size` = GPUs, ZeRO-3, the table's precision, train.py's tiled loss), how many tokens can one
sequence have, with and without gradient checkpointing? Found by bisection over the estimate itself: doubling from
1024 tokens until it no longer fits, then splitting the gap between the last length that fits and the first that
does not (where the peak interpolated between them meets the memory), in multiples of 1024, until it is under 1/32
of the length. Each length is a trace of the activations (seconds at long sequences, most of them in train.py's
tiled loss, traced tile by tile), which makes this search most of the table's time for a large model.
"""

from __future__ import annotations

from pathlib import Path

from zero_recipes.config import shipped

# The longest sequence: sequence parallelism over all GPUs of one node, at these counts, under ZeRO-3
LONGEST_GPUS = (1, 2, 4, 8)
LONGEST_CONFIG = "zero3"
LONGEST_STEP = 1024  # lengths are multiples of this (so every SP size up to 1024 divides them)
LONGEST_CAP = 2**24  # 16M tokens: the search stops there and reports "at least"


def longest_sequence(config, ds: dict, launch, gpu_memory: int, shape=None, progress=None) -> dict:
    """The longest multiple of LONGEST_STEP tokens whose estimate fits `gpu_memory` (verdict "yes") for this
    DeepSpeed config and launch (its seq_len is what is searched). Bracketed from LONGEST_STEP upwards, each try
    where the line through the peaks of the last two lengths that fit meets the memory (the activations are close
    to linear in the length under sdpa/flash, so this lands next to the answer); then the bracket is split where
    the line between its ends meets it (the midpoint when that would not split it), and the split point's
    neighbour one resolution away closes it, until the bracket is within 1/32 of the length (or LONGEST_STEP).
    Returns {"seq_len": N, or None when even LONGEST_STEP does not fit, "peak_bytes", "at_cap": True when it
    still fits at LONGEST_CAP, "estimates": how many were made}. `progress(seq)` hears each length before it is
    estimated (each a trace, seconds at a long sequence)."""
    import dataclasses

    from zero_recipes.ds.facts import zero_stage

    from .estimate import OUTSIDE_ALLOCATOR_BYTES, Precomputed, estimate, fragmentation

    shape = shape or _shape(config)
    tried = {}
    target = (gpu_memory - OUTSIDE_ALLOCATOR_BYTES) / (
        1 + fragmentation(zero_stage(ds))
    )  # the most a "yes" may peak at

    def peak(seq: int) -> int:
        if seq not in tried:
            if progress:
                progress(seq)
            launched = dataclasses.replace(launch, seq_len=seq)
            tried[seq] = estimate(config, ds, launched, gpu_memory, precomputed=Precomputed(shape))
        return tried[seq].per_gpu["peak_bytes"]

    def fits(seq: int) -> bool:
        peak(seq)
        return bool(tried[seq].fits)

    def resolution(seq: int) -> int:
        return max(LONGEST_STEP, seq // 32 // LONGEST_STEP * LONGEST_STEP)

    def meets(a: int, b: int) -> int:
        """Where the line through the peaks at a and b reaches the target, in whole steps (0: it never does)."""
        slope = (peak(b) - peak(a)) / (b - a)
        return int(a + (target - peak(a)) / slope) // LONGEST_STEP * LONGEST_STEP if slope > 0 else 0

    if not fits(LONGEST_STEP):
        return {"seq_len": None, "peak_bytes": peak(LONGEST_STEP), "at_cap": False, "estimates": len(tried)}
    lo, hi, below = LONGEST_STEP, None, None
    while hi is None and lo < LONGEST_CAP:  # bracket: try where the line through the last two fits meets it
        guess = meets(below, lo) if below else 2 * lo
        guess = min(max(guess, lo + resolution(lo)), LONGEST_CAP) if guess else min(2 * lo, LONGEST_CAP)
        if fits(guess):
            below, lo = lo, guess
        else:
            hi = guess
    while hi is not None and hi - lo > resolution(lo):  # split the bracket where the line between its ends meets it
        mid = meets(lo, hi)
        mid = mid if lo < mid < hi else (lo + hi) // 2 // LONGEST_STEP * LONGEST_STEP
        if fits(mid):
            lo, near = mid, min(mid + resolution(mid), hi)
        else:
            hi, near = mid, max(mid - resolution(mid), lo)
        if lo < near < hi:
            lo, hi = (near, hi) if fits(near) else (lo, near)
    return {"seq_len": lo, "peak_bytes": peak(lo), "at_cap": lo >= LONGEST_CAP, "estimates": len(tried)}


def _shape(config):
    from .shape import ModelShape

    return ModelShape.of(config)


def longest_rows(
    args, cfg, config, precision: str, extra: list, fragment, load, gpu_memory: int, counts=LONGEST_GPUS, progress=None
) -> dict:
    """longest_sequence for `counts` GPUs per node x gradient checkpointing off and on: sequence parallelism
    over all of a node's GPUs, ZeRO-3, the run's precision, micro-batch and loss/MLP tiling. A GPU count train.py
    would refuse as an SP size (heads it does not divide, LoRA) is a row with its reason. Returns the table's
    "longest_sequence": what was searched, the rows, and notes about them."""
    import tempfile

    from ..errors import ConfigError
    from . import stack

    shape = _shape(config)
    rows = []
    with tempfile.TemporaryDirectory(prefix="zr-longest-") as tmp:
        for n in counts:
            files = [*shipped.COMBINATIONS[LONGEST_CONFIG], *extra, fragment, sp_fragment(Path(tmp), n)]
            try:
                _, _, ds_n, _ = load(args, files, n * args.num_nodes)
            except ConfigError as err:
                for gc in (False, True):
                    rows.append({"num_gpus": n, "sequence_parallel": n, "gradient_checkpointing": gc,
                                 "seq_len": None, "refused": str(err).split(";")[0]})  # fmt: skip
                continue
            for gc in (False, True):
                launch = stack.launch_of(args, cfg, config, n, gc)
                said = f"longest sequence on {n} GPU(s), checkpointing {'on' if gc else 'off'}: trying"
                told = progress and (lambda seq, said=said: progress(f"{said} {seq:,} tokens"))
                found = longest_sequence(config, ds_n, launch, gpu_memory, shape, told)
                rows.append({"num_gpus": n, "sequence_parallel": n, "gradient_checkpointing": gc, **found})
    notes = []
    positions = getattr(config.get_text_config(), "max_position_embeddings", None)
    if positions and any((r.get("seq_len") or 0) > positions for r in rows):
        notes.append(
            f"beyond the model's max_position_embeddings ({positions:,}) a sequence needs RoPE scaling or "
            "training at that length; the memory is what the table shows"
        )
    return {
        "config": LONGEST_CONFIG,
        "precision": precision,
        "micro_batch_size": cfg.per_device_train_batch_size,
        "tiled_loss": cfg.tiled_loss,
        "tiled_mlp": cfg.tiled_mlp,
        "rows": rows,
        "notes": notes,
    }


def sp_fragment(tmp: Path, sp: int) -> str:
    """A --deepspeed fragment setting Ulysses' size (1: none)."""
    import json

    out = tmp / f"sequence_parallel_{sp}.json"
    out.write_text(json.dumps({"sequence_parallel_size": sp}) + "\n")
    return str(out)
