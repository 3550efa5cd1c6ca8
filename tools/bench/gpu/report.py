"""The GPU benchmark's report page (tools/bench/gpu/benchmark.py writes it beside the JSON)."""

from __future__ import annotations

import json

from .. import paired
from ..common import footer

TRAIN_PARTS = ("ZeRO-2", "LoRA", "MoE", "ZeRO-3")  # in the order they run


def size(b: float | None) -> str:
    if b is None:
        return "-"
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def not_ok(name: str, r: dict) -> str:
    if r["status"] == "skipped":
        return f"skipped: {r['reason']}"
    return f"**failed** after {r['seconds']:.0f} s (see Failures)"


def training_table(parts: dict, s: dict) -> list[str]:
    dense = "Llama-3.2-1B shape" if s["dense"] else "embedded tiny Llama"
    what = {"ZeRO-2": dense, "ZeRO-3": dense, "LoRA": f"{dense}, LoRA r 16 all-linear", "MoE": "Mixtral (below)"}
    lines = [
        "| part | model | tokens/s | MFU | measured peak | estimate | estimate error | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in TRAIN_PARTS:
        r = parts.get(name)
        if r is None:
            continue
        if r["status"] != "ok":
            lines.append(f"| {name} | {what[name]} | {not_ok(name, r)} | | | | | |")
            continue
        lines.append(
            f"| {name} | {what[name]} | {r['tokens_per_sec']:,.0f} | {r['mfu']:.1%} | {size(r['peak_bytes'])} | "
            f"{size(r['estimate_bytes'])} ({r['estimate_phase']}) | {pct(r['estimate_error'])} | {r['seconds']:.0f} |"
        )
    return lines


def shapes_table(r: dict | None) -> list[str]:
    if r is None:
        return []
    head = ["## TP2, SP2, PP2: one rank's compute at the split shapes", ""]
    if r["status"] != "ok":
        return head + [not_ok("TP/SP/PP shapes", r), ""]
    lines = head + [
        f"Device {r['device']}, peak {r['peak_flops'] / 1e12:.2f} TFLOP/s ({r['peak_source']}).",
        "",
        "| shape | tokens | heads | layers | MLP width | fwd+bwd ms | vs full | tokens/s | MFU | activation peak | "
        "estimate | error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, x in r["shapes"].items():
        lines.append(
            f"| {name} | {x['micro']} x {x['seq']} | {x['heads']} | {x['layers']} | {x['intermediate_size']} | "
            f"{x['step_seconds'] * 1e3:.1f} | {x['step_vs_full']:.2f} | {x['tokens_per_sec']:,.0f} | {x['mfu']:.1%} | "
            f"{size(x['activation_peak_bytes'])} | {size(x['activation_estimate_bytes'])} | {pct(x['estimate_error'])} |"
        )
    return lines + [
        "",
        "What ran: the full model, then each shape built in one process on one device and timed over forward+"
        "backward passes on random tokens (no optimizer; each gradient dropped as made, as ZeRO takes it). TP2 "
        "rank: heads, key-value heads and MLP width halved (AutoTP's split; embeddings, norms and the head whole), "
        "without its 2 all-reduces per layer forward and 5 backward. SP2 rank: half the tokens with every head; a "
        "real Ulysses rank attends over all tokens with half the heads (twice this attention) and adds 4 "
        "all-to-alls per layer. PP2 stage: half the layers with both the embedding and the head (a real stage has "
        "one), no sends, no bubble. `vs full` is the step time over the full model's: 0.5 is a perfect split. "
        "Activation estimate: zero_recipes.memory.activation_bytes of the shape that ran (untiled loss).",
        "",
    ]


def sft_section(r: dict | None) -> list[str]:
    if r is None:
        return []
    head = ["## SFT: train.py vs TRL SFTTrainer, label tokens/s", ""]
    if r["status"] != "ok":
        return head + [not_ok("SFT vs TRL", r), ""]
    s = r["settings"]
    lines = head + [
        f"sft/benchmark.py's workload on one device: {s['conversations']:,} generated conversations "
        f"({r['data_tokens']:,} "
        f"tokens), {r['model']}, rows of {s['block']} tokens, micro-batch {s['micro']}, ZeRO-2"
        f"{' + ' + ', '.join(s['fragments']) if s.get('fragments') else ''}, one epoch, one round.",
        "",
        "| runner | label tokens/s | real tokens/s | padding | steps | first step s | held-out loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, x in r["runners"].items():
        loss = f"{x['eval_loss']:.3f}" if x["eval_loss"] is not None else "-"
        lines.append(
            f"| {name} | {x['label_tokens_per_sec']:,.0f} | {x['real_tokens_per_sec']:,.0f} | {x['padding_share']:.1%} "
            f"| {x['steps']} | {x['time_to_first_step']:.1f} | {loss} |"
        )
    return lines + ["", f"train.py / TRL, label tokens/s (window-paired): {paired.text(r['vs_trl'])}.", ""]


def dpo_section(r: dict | None) -> list[str]:
    if r is None:
        return []
    head = ["## DPO at the 8B shape: train.py, one rank", ""]
    if r["status"] != "ok":
        return head + [not_ok("DPO 8B", r), ""]
    return head + [
        f"`{r['recipe']}` with `--objective dpo` on {r['model']} (random init, saved as the base: "
        f"{r['base_seconds']:.0f} s), {r['pairs']} generated pairs (prompts 100-300 tokens, answers 50-200), "
        f"{r['steps']} steps of {r['pairs_per_step']} pairs.",
        "",
        "| pairs/s | tokens/s | MFU | peak | reference pass | time to first step s | wall s |",
        "|---|---|---|---|---|---|---|",
        f"| {r['pairs_per_sec']:.2f} | {r['tokens_per_sec']:,.0f} | {r['mfu']:.1%} | {size(r['peak_bytes'])} "
        f"({r['peak_source']}) | {r['reference_seconds']:.1f} s for {r['reference_pairs']} pairs | "
        f"{r['time_to_first_step']:.1f} | {r['seconds']:.0f} |",
        "",
        "Pairs/s: each step's pairs over its time (bench/dpo/probe.py), the first step left out; the reference "
        "pass (train.py's, once, before step 1) is not in it and its seconds are train.py's own log line.",
        "",
    ]


def error_line(error: str) -> str:
    """The error's first line (what failed, or timed out) and its last (the child's last words), the full text
    in the JSON."""
    lines = [x.strip() for x in error.splitlines() if x.strip() and not x.startswith("----")] or ["?"]
    return " … ".join(f"`{x}`" for x in dict.fromkeys([lines[0], lines[-1]]))


def partial(pending: list | None) -> list[str]:
    """The line a report written mid-run carries: it is rewritten as each part ends, and a run killed at the
    device's command limit leaves this one."""
    if not pending:
        return []
    return [
        f"**Partial**: written as each part ends; not finished (still running, or killed): {', '.join(pending)}.",
        "",
    ]


def markdown(r: dict) -> str:
    s, parts, plan = r["settings"], r["parts"], r["plan"]
    planned = (plan["total_seconds"] + plan.get("overhead_seconds", 0)) / 60
    lines = [
        f"# GPU benchmark{' (--quick, CPU)' if s['quick'] else ''}, {r['date']}",
        "",
        f"Command: `{r['command']}`. Planned about {planned:.1f} min, "
        + (
            f"{r['wall_seconds'] / 60:.1f} min so far."
            if r.get("pending")
            else f"took {r['wall_seconds'] / 60:.1f} min."
        ),
        "",
        *partial(r.get("pending")),
        "## Training runs: train.py on one rank",
        "",
        *training_table(parts, s),
        "",
        f"Dense runs: {json.dumps(s['dense']) if s['dense'] else 'the embedded tiny Llama'}; {s['precision']}, "
        f"sequence {s['block']}, micro-batch {s['micro']}, {s['steps']} steps logged every {s['window']} (the first "
        "window left out; medians of the rest). MoE: "
        f"{json.dumps(s['moe_model'])} ({(parts.get('MoE') or {}).get('parameters', '-')}), sequence "
        f"{s['moe_block']}, micro-batch {s['moe_micro']}; MFU on active FLOPs. Measured peak: "
        "`torch.cuda.max_memory_allocated` as train.py logs it (`mem_peak_gb`) on a GPU; on the CPU the allocator "
        "events' peak over the whole run (tools/bench/runners/profiled_train.py). Estimate: "
        "tools/estimate_memory.py's for "
        "the same flags (zero_recipes.memory.for_run, as train.py logs it), its peak phase in brackets.",
        "",
        *shapes_table(parts.get("TP/SP/PP shapes")),
        *sft_section(parts.get("SFT vs TRL")),
        *dpo_section(parts.get("DPO 8B")),
        "## Failures",
        "",
    ]
    failed = {n: x for n, x in parts.items() if x["status"] == "failed"}
    lines += [f"- {n} after {x['seconds']:.0f} s: {error_line(x['error'])}" for n, x in failed.items()] or ["none"]
    lines += ["", "## Not measured here", ""] + [f"- {x['what']}: {x['why']}." for x in r["skipped"]]
    if s["quick"]:
        lines.append("- GPU figures: --quick runs the same code on the CPU with tiny shapes; a smoke run, not a measurement.")  # fmt: skip
    return "\n".join(lines + ["", *footer(r)]) + "\n"
