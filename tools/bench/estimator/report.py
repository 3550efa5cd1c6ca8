"""The estimator report: benchmarks/estimator.md, written whole from the points tools/bench/estimator/benchmark.py
measured, each against tools/estimate_memory.py's prediction: one table per kind of point (full fine-tuning, LoRA,
tensor parallel, long context), one summary, and one line per point outside the target band saying why (`REASONS`;
a miss without one is named as unexplained).
"""

from __future__ import annotations

import json

from ..common import footer

# What benchmark.py launches and this report states: the models, the target band, a point's long-context options
MODELS: dict = {  # Llama shapes with GQA and SwiGLU; "B" is ~34M parameters, "A" ~7M (held out)
    "B": {
        "hidden_size": 512,
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "intermediate_size": 1376,
        "vocab_size": 16000,
    },
    "T": {  # the embedded tiny Llama (model.TINY_LLAMA) with a 128k vocabulary: the loss region dominates
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 352,
        "vocab_size": 131072,
        "max_position_embeddings": 4096,
    },
    "A": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 688,
        "vocab_size": 8000,
    },
}
# B with room for 4096 positions (the probe's embedded base allows 1024): the long-context points
MODELS["L"] = {**MODELS["B"], "max_position_embeddings": 4096}
TARGET = {"over": 0.15, "under": 0.05}
SECTIONS = {
    "full": "Full fine-tuning",
    "lora": "LoRA (r16 on all-linear, a bf16 checkpoint loaded as train.py loads it)",
    "tp": "Tensor parallelism (AutoTP, 2 ranks a group)",
    "long": "Long context (Ulysses SP, train.py's tiled loss and MLP)",
}
# Why a point misses, for the points known to (matched on label(), precision, ranks): shown only while it does
REASONS: dict[tuple[str, str, int], str] = {}


def kind(p: dict) -> str:
    """ "long", "tp", "lora" or "full": the section a point belongs to."""
    return "long" if p.get("long") else "tp" if p.get("tp", 1) > 1 else "lora" if p.get("lora") else "full"


def long_options(long: dict | None) -> dict:
    """A point's SP size and train.py's tiling flags, defaults filled (train.py's: loss tiled, MLP not)."""
    return {"sp": 1, "tiled_loss": True, "tiled_mlp": False, **(long or {})}


def label(p: dict) -> str:
    lora = p.get("lora")
    if p.get("tp", 1) > 1:
        return f"{p['config']} + TP{p['tp']}"
    if p.get("long"):
        o = long_options(p["long"])
        return (
            p["config"]
            + (f" + SP{o['sp']}" if o["sp"] > 1 else "")
            + (" + tiled MLP" if o["tiled_mlp"] else "")
            + (f" + loss {'tiled' if o['tiled_loss'] else 'untiled'}" if "tiled_loss" in p["long"] else "")
        )
    if not lora:
        return p["config"]
    return f"{p['config']} + LoRA r{lora['r']}" + (f" (dropout {lora['dropout']:g})" if lora["dropout"] else "")


def ranks(p: dict) -> str:
    tp, sp = p.get("tp", 1), long_options(p.get("long"))["sp"]
    if sp > 1:
        return f"{p['ranks']} ({p['ranks'] // sp} dp x {sp} sp)"
    return str(p["ranks"]) if tp == 1 else f"{p['ranks']} ({p['ranks'] // tp} dp x {tp} tp)"


def inside(p: dict) -> bool:
    return -TARGET["under"] <= p["error"] <= TARGET["over"]


def in_target(points: list) -> str:
    """How many points' peak errors are inside the target band, and the worst either way."""
    errs = [p["error"] for p in points]
    return (
        f"{sum(map(inside, points))} of {len(points)} within +{TARGET['over']:.0%} / -{TARGET['under']:.0%}, "
        f"worst over {max(errs):+.1%}, worst under {min(errs):+.1%}"
    )


def table(points: list) -> list[str]:
    mb = lambda b: f"{b / 1e6:,.1f}"  # noqa: E731
    lines = [
        "| model | config | precision | ranks | micro x seq | GC | peak phase | measured MB | predicted MB | "
        "error | in target? |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        lines.append(
            f"| {p['model']} ({p['num_params'] / 1e6:.1f}M) | {label(p)} | {p['precision']} | {ranks(p)} | "
            f"{p['micro']} x {p['seq']} | {'on' if p['gc'] else 'off'} | {p['phase']} | {mb(p['measured_bytes'])} | "
            f"{mb(p['predicted_bytes'])} | {p['error']:+.1%} | {'yes' if inside(p) else '**no**'} |"
        )
    return lines


def misses(points: list) -> list[str]:
    """One line per point outside the band, with its reason."""
    out = []
    for p in points:
        if inside(p):
            continue
        why = REASONS.get((label(p), p["precision"], p["ranks"]), "not explained yet")
        out.append(f"- {label(p)}, {p['precision']}, {ranks(p)} rank(s), {p['micro']} x {p['seq']}: "
                   f"{p['error']:+.1%}. {why}")  # fmt: skip
    return out or ["- None."]


def phase_notes(points: list) -> list[str]:
    """The phases that are not a point's peak, which the band does not judge."""
    others = [(ph, e) for p in points for ph, e in p["phase_errors"].items() if ph != p["phase"]]
    init = [e for ph, e in others if ph == "init"]
    rest = [e for ph, e in others if ph != "init"]
    return [
        f"- Phases other than a point's peak (estimator.json, phase_errors): init {min(init):+.0%} to "
        f"{max(init):+.0%}, over on most points because its estimate counts the whole fp32-built model beside the "
        "engine's first buffers, which the measured runs never hold together; forward/backward and the step "
        f"{min(rest):+.0%} to {max(rest):+.0%}.",
    ]


NOTES = [
    "- What the estimate counts is in docs/dev/memory-derivations.md, each buffer with the DeepSpeed function that "
    "allocates it; the allocator probe with Python stacks (the live allocations at each peak) checked ZeRO-1/2/3 "
    "with and without offload on model B to the byte on 1 and 2 ranks.",
    "- The largest overs: ZeRO-2 without offload (+7.5 % on 1 rank fp32 and 2 ranks bf16, by 2 x p x the 8.19M "
    "head exactly) counts the grad in flight and its copy into the bucket, which these 16-token runs no longer "
    "hold at their peak, the bucket's reduce at the backward's end; ZeRO-3 on 4 ranks (+5.9 %), with offload on "
    "2 (+3.3 %) and the 128k-vocabulary SP2 point (+6.8 %) count every parameter gathered at once (the live cap "
    "is above these models), where fewer are at the measured peak.",
    "- Known run-to-run variation: ZeRO-2 offload on 2 ranks reads 572.0 MB, or 637.6 MB when gloo frees "
    "`allreduce_bucket`'s flat copy after the norm's fp64 copy exists (+11.5 % then, inside the band; seen once, "
    "under load). The 4-rank TP2 x DP2 points (4 processes on 2 cores) are the least repeatable: in earlier runs "
    "one rank, a different one each time, held 9 to 25 MB the others did not.",
    "- ZeRO-3 with TP is not among the points: the estimate only divides the parameters there (one probe, B bf16 "
    "TP2 on 2 ranks 1 x 16, peaked at 488.7 MB against 602.1 MB estimated, +23 %).",
]


def markdown(r: dict) -> str:
    pts = r["points"]
    lines = [
        f"# Memory estimate vs measured, {r['date']}",
        "",
        f"Measured by: `{r['command']}`"
        + (
            f"; estimate recomputed by `{r['predicted_with']}` from the stored probe records (the same measurements)"
            if r.get("predicted_with")
            else ""
        ),
        "",
        "Measured: peak live bytes of the CPU allocator on the most loaded rank (the torch profiler's allocation "
        "events, every thread's frees counted: `zero_recipes/memory/probe.py`), real DeepSpeed on the CPU "
        "accelerator, 3 steps. Predicted: `zero_recipes.memory.estimate` for the phase where the measurement "
        "peaked, device + host of one rank (one pool on a CPU; a GPU's split is states_gpu.py's). "
        f"Target: within +{TARGET['over']:.0%} / -{TARGET['under']:.0%}.",
        "",
        f"**{in_target(pts)}.**",
        "",
    ]
    for key, title in SECTIONS.items():
        part = [p for p in pts if kind(p) == key]
        if part:
            lines += [f"## {title}: {in_target(part)}", "", *table(part), ""]
    lines += ["## Misses", "", *misses(pts), "", "## Notes", "", *phase_notes(pts), *NOTES]
    lines += [
        "- Models: Llama with GQA and SwiGLU; B " + json.dumps(MODELS["B"]) + "; A (held out: the estimate's "
        "measured constants came from B) " + json.dumps(MODELS["A"]) + "; L (B with room for 4096 positions, the "
        "long-context points); T (the embedded tiny Llama at a 128k vocabulary) " + json.dumps(MODELS["T"]) + ".",
        *footer(r),
    ]
    return "\n".join(lines) + "\n"
