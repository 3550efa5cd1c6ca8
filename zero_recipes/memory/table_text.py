"""tools/estimate_memory.py --table as text, from the dict table.py makes (--json prints that dict as it is).

One row per config (the name the recommendation gives), two columns per GPU count: the peak per GPU without and
with gradient checkpointing. A row is what a user picks, so rows grow down the screen and only the GPU counts
asked for widen it: up to 4 counts fit in WIDTH columns; more wrap into blocks of 4 below each other, each with
the config names again (--wide: one block, as wide as it takes). Prose lines wrap at WIDTH in both.
"""

from __future__ import annotations

import textwrap

WIDTH = 120
LABEL = 24  # "zero3+offload_optimizer", the longest config name, and a space
CELL = 10  # "1,254.00*": a peak in GiB with its mark, right-aligned
MARK = {"yes": "*", "tight": "~", "no": " "}


def gb(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


def wrap(text: str, indent: int = 2) -> list[str]:
    return textwrap.wrap(text, WIDTH, subsequent_indent=" " * indent, break_on_hyphens=False) or [""]


def render(t: dict, wide: bool = False) -> list[str]:
    """The table's lines: the precision first, then the model and legend, the grid, the recommendation per GPU
    count and the longest sequence."""
    lora = f", LoRA r {t['lora_r']}" if t["lora_r"] else ""
    lines = wrap(t["precision_statement"])
    lines += wrap(
        f"model: {t['num_params'] / 1e9:.3f}B parameters{lora}, micro-batch {t['micro_batch_size']} x {t['seq_len']} "
        f"tokens, {t['num_nodes']} node(s) of the GPUs below; peak per GPU in GiB, GC: gradient checkpointing"
    )
    lines += wrap(
        f"* fits in {gb(t['gpu_memory'])}; ~ tight: the allocated peak fits, not with the CUDA context, NCCL and "
        "fragmentation" + ("; - where the TP size or stage count does not divide the GPUs" if tried_any(t) else "")
    )
    if t["lora_tried"]:
        lines += wrap(
            f"+lora{t['lora_tried']['r']}: LoRA r {t['lora_tried']['r']} on all-linear (not set: tried before any offload)"
        )
    if t["tensor_parallel_tried"]:
        lines += wrap(
            "+tpN: AutoTP with N GPUs per group, tried where N divides the GPUs per node (never across nodes); "
            "ZeRO partitions over the GPUs / N data-parallel ranks"
        )
    if t.get("pipeline_parallel_tried"):
        m = t["micro_batches"]
        bubbles = ", ".join(f"{100 * (n - 1) / (m + n - 1):.0f} % at {n}" for n in t["pipeline_parallel_tried"])
        lines += wrap(
            "+ppN: N pipeline stages (ZeRO-0/1 only), tried where N divides the GPUs of all nodes; each GPU holds "
            f"its stage's layers, the peak is the worst stage's (the first holds the most micro-batches in flight, the "
            "last the whole logits); "
            f"{m} micro-batch(es) a step (--gradient_accumulation_steps) leave the GPUs idle {bubbles} stages"
        )
    for note in t["notes"]:
        lines += wrap(f"note: {note}")
    lines += grid(t, wide)
    lines.append("")
    for n in t["gpu_counts"]:
        b = t["recommended"].get(n)
        lines += wrap(f"{n:>3d} GPU(s): " + (recommendation(b, t["lora_r"]) if b else "nothing fits"), 13)
    if t["longest_sequence"]:
        lines += longest(t["longest_sequence"], t["gpu_memory"])
    return lines


def grid(t: dict, wide: bool) -> list[str]:
    """The configs' rows in blocks of as many GPU counts as fit WIDTH (all of them when `wide`)."""
    rows = t["rows"] + t["lora_rows"] + t["tp_rows"] + t.get("pp_rows", [])
    keys = list(dict.fromkeys(_key(r) for r in rows))
    label = {
        k: k[0]
        + (f"+lora{k[1]}" if t["lora_tried"] and k[1] else "")
        + (f"+tp{k[2]}" if k[2] > 1 else "")
        + (f"+pp{k[3]}" if k[3] > 1 else "")
        for k in keys
    }
    cells = {(*_key(r), r["num_gpus"], r["gradient_checkpointing"]): r for r in rows}
    counts = t["gpu_counts"]
    per_block = len(counts) if wide else max(1, (WIDTH - LABEL) // (2 * CELL))
    out = []
    for start in range(0, len(counts), per_block):
        block = counts[start : start + per_block]
        out.append("")
        out.append((" " * LABEL + "".join(f"{n} GPU{'s' if n > 1 else ''}".center(2 * CELL) for n in block)).rstrip())
        out.append(f"{'config':<{LABEL}}" + f"{'GC off':>{CELL}}{'GC on':>{CELL}}" * len(block))
        for k in keys:
            line = f"{label[k]:<{LABEL}}"
            for n in block:
                for gc in (False, True):
                    c = cells.get((*k, n, gc))  # none where a TP size or stage count does not divide the count
                    text = f"{c['peak_bytes'] / 2**30:,.2f}{MARK[c['fit']]}" if c else "- "
                    line += f"{text:>{CELL}}"
            out.append(line.rstrip())
    return out


def _key(row: dict) -> tuple:
    """A grid row's identity: (config, lora_r, tensor-parallel size, pipeline stages)."""
    return row["config"], row["lora_r"], row["tensor_parallel"], row.get("pipeline_parallel", 1)


def tried_any(t: dict) -> bool:
    return bool(t["tensor_parallel_tried"] or t.get("pipeline_parallel_tried"))


def recommendation(b: dict, lora_given: int) -> str:
    lora = f" + LoRA r{b['lora_r']}" if b["lora_r"] and not lora_given else ""
    tp, pp = b.get("tensor_parallel", 1), b.get("pipeline_parallel", 1)
    return (
        f"{b['config']}{lora}{f' + tensor parallel {tp} (within a node)' if tp > 1 else ''}"
        f"{f' + pipeline parallel {pp} stages' if pp > 1 else ''}"
        f"{' + gradient checkpointing' if b['gradient_checkpointing'] else ''}"
        f" ({gb(b['peak_bytes'])}; micro-batch up to {b['max_micro_batch_size']})"
        + (" (LoRA: full fine-tuning fits only with offload or not at all)" if lora else "")
    )


def longest(ls: dict, gpu_memory: int) -> list[str]:
    """The longest sequence per GPU count (Ulysses over all of them), checkpointing off and on."""
    lines = [""]
    lines += wrap(
        f"longest sequence that fits in {gb(gpu_memory)} (tokens; {ls['config']}, {ls['precision']}, sequence "
        f"parallel over all GPUs of the node, micro-batch {ls['micro_batch_size']}, loss "
        f"{'tiled' if ls['tiled_loss'] else 'untiled'}{', MLP tiled' if ls['tiled_mlp'] else ''}):"
    )
    lines.append(f"{'GPUs':>5s} {'SP':>3s} {'GC off':>14s} {'GC on':>14s}")
    for n in dict.fromkeys(r["num_gpus"] for r in ls["rows"]):
        cells = {r["gradient_checkpointing"]: r for r in ls["rows"] if r["num_gpus"] == n}
        if any("refused" in r for r in cells.values()):
            lines += wrap(f"{n:>5d} {n:>3d}  refused: {cells[False]['refused']}", 11)
            continue

        def cell(r):
            if r["seq_len"] is None:
                return "nothing fits"
            return (">= " if r["at_cap"] else "") + f"{r['seq_len']:,}"

        lines.append(f"{n:>5d} {n:>3d} {cell(cells[False]):>14s} {cell(cells[True]):>14s}")
    for note in ls["notes"]:
        lines += wrap(f"note: {note}")
    return lines
