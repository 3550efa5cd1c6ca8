"""The estimator report: benchmarks/estimator.md from the points tools/bench/estimator/benchmark.py measured, each
against tools/estimate_memory.py's prediction, with a summary per kind of point (LoRA, TP, long context).
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
TARGET = {"over": 0.10, "under": 0.05}


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


def tp_summary(points: list) -> str:
    tp = [p for p in points if p.get("tp", 1) > 1]
    if not tp:
        return "- No tensor-parallel points in this run."
    same = sum(p.get("predicted_params_per_rank") == p["num_params"] for p in tp)
    return (
        f'- Tensor parallelism (AutoTP, `{{"tensor_parallel": {{"autotp_size": 2}}}}` as one more fragment; '
        "`--only tp` remeasures these): "
        f"{in_target(tp)}. "
        "The model column counts one rank's parameters after AutoTP split them; the estimate's count (DeepSpeed's "
        f"own reading of the model's TP plan on the meta model) equals the probe's on {same} of {len(tp)} points. "
        "ZeRO partitions over the data-parallel ranks alone. The 4-rank points (TP2 x DP2, 4 processes on 2 cores) "
        "are the least repeatable: one rank, a different one in each run, holds 9 to 25 MB that the others do not "
        "through forward/backward and the step, and the table compares that rank; two more runs of the ZeRO-2 "
        "point gave three ranks within 1 % of the estimate in forward/backward (173.8 and 175.4 MB against "
        "174.5) and one rank 24.6 MB over. ZeRO-3 with TP is not modelled beyond dividing the parameters: one "
        "probe (B, bf16, TP2 on 2 ranks, 1 x 16) peaked at 488.7 MB in the step against 602.1 MB estimated "
        "(+23 %), so it is not among these points."
    )


def target_counts(points: list) -> tuple[int, list[float]]:
    """The points' peak errors, and how many lie inside the target band."""
    errs = [p["error"] for p in points]
    return sum(-TARGET["under"] <= e <= TARGET["over"] for e in errs), errs


def in_target(points: list) -> str:
    """How many points' peak errors are inside the target band, and the worst either way."""
    inside, errs = target_counts(points)
    return f"{inside} of {len(errs)} in target at their peak, worst over {max(errs):+.1%}, worst under {min(errs):+.1%}"


def long_summary(points: list) -> str:
    long = [p for p in points if p.get("long")]
    if not long:
        return "- No long-context points in this run."
    return (
        '- Long context (`--only long` remeasures these): Ulysses SP (`{"sequence_parallel_size": 2}` as one more '
        "fragment; the probe cuts each row as train.py does and registers DeepSpeed's Ulysses attention) and train.py's "
        "tiled loss and MLP (zero_recipes.modeling.lm_loss installed as train.py installs it): "
        f"{in_target(long)}. "
        "The estimate traces one rank at s/2 tokens with Ulysses' all-to-all shapes around sdpa, and the loss and MLP "
        "through lm_loss itself. The SP2 ZeRO-3 misses are ZeRO-3's on 2 ranks, not SP's: the control without SP at "
        "the same 512 tokens per rank misses by as much (624.7 MB measured against SP2's 628.9), the absolute miss "
        "stays ~60 MB from 1024 to 2048 tokens while the activations double (measured +169.9 MB, predicted +172.2), "
        "and the full fine-tuning ZeRO-3 rows on 2 ranks above miss by -5 % to -9 % too; the same SP2 point measured "
        "581.2 and 620.6 MB in two earlier runs (-2.3 %, -8.5 %). With the loss tiled the head's gradient is reduced "
        "inside the last tile's backward, so its in-flight bytes (states.py's 2p per head parameter plus its p/N "
        "partition) add to that tile's region (estimate.tiled_head_gradient). That term was read off the 128k ZeRO-2 "
        "tiled point's residual (-6.8 % without it, 100 MB = 6 B per head parameter), so that point is no independent "
        "check; the ZeRO-3 SP2 128k point is, and is +5.3 % with it (-1.1 % without): on ZeRO-3 the term is not "
        "confirmed. The tiled-MLP point saves 94.7 MB against the SP2 2048 point measured, 67.6 MB predicted."
    )


def lora_summary(points: list) -> str:
    lora = [p for p in points if p.get("lora")]
    if not lora:
        return "- No LoRA points in this run."
    others = [e for p in lora for ph, e in p["phase_errors"].items() if ph != p["phase"]]
    return (
        f"- LoRA (r16 on all-linear; the base a bf16 checkpoint loaded as train.py loads it, wrapped by "
        f"zero_recipes.adapters.lora.wrap; `--only lora` remeasures these and keeps the other points as measured before): "
        f"{in_target(lora)}. "
        f"The phases that are not the peak range {min(others):+.0%} to {max(others):+.0%} (estimator.json, "
        "phase_errors): on two ZeRO-3 ranks the rank compared is the one with the largest peak, not rank 0, "
        "the only rank transformers' ZeRO-3 load reads the checkpoint on, so its init is over; the frozen base's "
        "~1.2p B/param kept gathered between steps (measured for full fine-tuning) is partly released by the "
        "step. The one-rank ZeRO-3 bf16 run is not repeatable to 16 MB: its init peak was 167.9, 169.3 and "
        "185.7 MB in three runs (an embedding-sized temporary of the load outlives it or not, and then stays "
        "through the later phases)."
    )


def markdown(r: dict) -> str:
    mb = lambda b: f"{b / 1e6:,.1f}"  # noqa: E731
    lines = [
        f"# Memory estimate vs measured, {r['date']}",
        "",
        f"Command: `{r['command']}`",
        "",
        "Measured: peak live bytes of the CPU allocator on the most loaded rank (torch profiler, "
        "`zero_recipes/memory/probe.py`), real DeepSpeed on the CPU accelerator. Predicted: "
        "`zero_recipes.memory.estimate` for that phase, device + host of one rank (one pool on a CPU). "
        f"Target: within +{TARGET['over']:.0%} / -{TARGET['under']:.0%}.",
        "",
        "| model | config | precision | ranks | micro x seq | GC | peak phase | measured MB | predicted MB | "
        "error | in target? |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in r["points"]:
        ok = -TARGET["under"] <= p["error"] <= TARGET["over"]
        lines.append(
            f"| {p['model']} ({p['num_params'] / 1e6:.1f}M) | {label(p)} | {p['precision']} | {ranks(p)} | "
            f"{p['micro']} x {p['seq']} | {'on' if p['gc'] else 'off'} | {p['phase']} | {mb(p['measured_bytes'])} | "
            f"{mb(p['predicted_bytes'])} | {p['error']:+.1%} | {'yes' if ok else '**no**'} |"
        )
    inside, errs = target_counts(r["points"])
    lines += [
        "",
        f"- {inside} of {len(errs)} points in target; worst over {max(errs):+.1%}, worst under {min(errs):+.1%}.",
        "- Misses: "
        + (
            "; ".join(
                f"{label(p)} {p['precision']} on {p['ranks']} rank(s), {p['error']:+.1%}"
                for p in r["points"]
                if not -TARGET["under"] <= p["error"] <= TARGET["over"]
            )
            or "none"
        )
        + ". ZeRO-3 on several ranks is the least repeatable: with overlap_comm its "
        "gathers and releases run asynchronously, and the same run's peak moved by up to ~15 % between "
        "repetitions (measured), on the most loaded rank, which also differs from rank 0 by up to ~1.5 B/param.",
        lora_summary(r["points"]),
        tp_summary(r["points"]),
        long_summary(r["points"]),
        "- Models: Llama with GQA and SwiGLU; B " + json.dumps(MODELS["B"]) + "; A (held out: the "
        "estimate's measured constants came from B) "
        + json.dumps(MODELS["A"])
        + "; L (B with room for 4096 positions, the long-context points); T (the embedded tiny Llama at a 128k "
        "vocabulary) " + json.dumps(MODELS["T"]) + ".",
        *footer(r),
    ]
    return "\n".join(lines) + "\n"
