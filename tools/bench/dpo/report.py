"""The DPO benchmark's page: per ZeRO stage, each runner's figures and train.py's ratios against both TRL forms."""

from __future__ import annotations

from .. import paired
from ..common import footer, yes

STAGE = {"zero2": "ZeRO-2", "zero3": "ZeRO-3"}


def markdown(r: dict, goals: dict, runners: dict) -> str:
    s, d = r["settings"], r["data"]
    lines = [
        f"# DPO speed, {r['date']}",
        "",
        f"Command: `{r['command']}`",
        "",
        f"{s['pairs']:,} generated conversational pairs (tools/bench/dpo/data.py): prompt tokens 5/50/95/100 % "
        + "/".join(str(v) for v in d["prompt_tokens"].values())
        + ", answer tokens "
        + "/".join(str(v) for v in d["answer_tokens"].values())
        + f" (through the chat template); {d['pair_tokens']:,} tokens with each prompt once, {d['side_tokens']:,} "
        f"with it twice. A {d['parameters'] / 1e6:.1f}M-parameter Llama (train.py's seeded init, saved once; the "
        f"policy's start and the reference), fp32, {s['micro']} pairs per rank x 2 ranks a step, torch AdamW, "
        f"sigmoid loss, beta 0.1, max_length {s['max_length']} a side, one epoch; {s['rounds']} rotated round(s) per "
        "stage. Every launch starts with empty caches: its tokenisation and reference pass are in its time to first "
        "step.",
        "",
    ]
    for stage, x in r["stages"].items():
        lines += stage_lines(STAGE.get(stage, stage), x, goals)
    lines += [
        "- pairs/s: the median over rounds of each run's steady windows ("
        f"{s['windows']} per run after {s['warmup']} warm-up steps); a ratio is the median of window i of train.py over "
        "window i of the other runner in the same round, 95 % interval from a bootstrap over rounds and pairs "
        "(tools/bench/paired.py). Memory and first-step ratios pair the runs of each round.",
        "- tokens computed: positions the policy's training forwards ran over (input_ids' size), per pair; TRL lays "
        "a pair out as prompt+chosen and prompt+rejected, two rows padded to the batch's longest; train.py as one "
        "stretch, the prompt once and no padding. Padding: the share of computed positions that were padding. TRL's "
        "live reference runs a forward over the same rows again on every step.",
        "- reference: train.py's pass (its own log line) and TRL's precompute (`_precompute_ref_logps`) run before "
        "the first step, their share is of reference + epoch; TRL live's is the sum of its reference model's forwards "
        "inside the steps, its share of the epoch.",
        "- peak RSS: each rank's ru_maxrss (what the SFT benchmark reads), the larger rank's in the ratio; on a CPU it "
        "holds the model states, activations, the imported libraries and the data.",
        "- time to first step: process start to the end of the first optimizer step.",
        "",
        *footer(r),
    ]
    return "\n".join(lines) + "\n"


def stage_lines(title: str, x: dict, goals: dict) -> list[str]:
    out = [
        f"## {title}",
        "",
        "| runner | pairs/s | steps | tokens computed a pair | padding | reference s (share) | time to first step s "
        "| epoch s | peak RSS per rank GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, v in x["runners"].items():
        out.append(
            f"| {name} | {v['pairs_per_sec']:.2f} | {v['steps']} | {v['computed_per_pair']:.0f} | "
            f"{v['padding_share']:.1%} | {v['reference_seconds']:.1f} ({v['reference_share']:.0%}) | "
            f"{v['time_to_first_step']:.1f} | {v['epoch_seconds']:.1f} | "
            + " / ".join(f"{g:.2f}" for g in v["max_rss_gib"])
            + " |"
        )
    q = x["ratios"]
    out += [
        "",
        "| train.py against | median (95 % interval) | goal | met? |",
        "|---|---|---|---|",
        row("TRL live: pairs/s", q["vs_trl_live"], goals["vs_trl_live"], True),
        row("TRL precompute: pairs/s", q["vs_trl_precompute"], goals["vs_trl_precompute"], True),
        row("TRL live: peak RSS", q["memory_vs_trl_live"], goals["memory_vs_trl"], False),
        row("TRL precompute: peak RSS", q["memory_vs_trl_precompute"], goals["memory_vs_trl"], False),
        row("TRL live: time to first step", q["first_step_vs_trl_live"], goals["first_step_vs_trl"], False),
        row("TRL precompute: time to first step", q["first_step_vs_trl_precompute"], goals["first_step_vs_trl"], False),
        "",
    ]
    return out


def row(what: str, x: dict, goal: float, at_least: bool) -> str:
    met = x["median"] >= goal if at_least else x["median"] <= goal
    return f"| {what} | {paired.text(x)} | {'>=' if at_least else '<='} {goal} | {yes(met)} |"
