"""The pipeline bubble from tools/bench/pipeline/probe.py's records: measured per step, from the textbook
formula, from the measured stage times, and from a straight-line fit of the step's span against m.

One pipeline of p stages (one rank each) runs m micro-batches per optimizer step. The step's span is the
first ForwardPass's start on any stage to the last BackwardPass's end on any stage (the fill, the steady
1F1B state and the drain; every stage's forward and backward passes fall inside it); a stage is busy while
it runs a ForwardPass or BackwardPass instruction (its layers, and on the last stage the loss). The measured
bubble is the share of the p x span stage-seconds no stage computes in: 1 - sum(busy) / (p x span), and per
stage 1 - busy / span. Waiting for a neighbour, the p2p copies and DeepSpeed's per-instruction work all count
as bubble, as they do for throughput.
"""

from __future__ import annotations

import statistics

from zero_recipes.memory.pipeline import bubble

from ..common import spread

BUSY = ("ForwardPass", "BackwardPass")
COMM = ("SendActivation", "RecvActivation", "SendGrad", "RecvGrad")


def formula(m: int, p: int) -> float:
    """The 1F1B (and GPipe) bubble with p equal stages and free communication, (p - 1) / (m + p - 1): the
    memory estimate's own (its compute estimate counts it), so the benchmark checks the figure users see."""
    return bubble(p, m)


def expected(m: int, per_micro: list[float]) -> float:
    """The bubble with the measured per-micro-batch busy seconds of each stage (unequal stages, free
    communication): the slowest stage paces the steady state and every stage adds its own time once in the
    fill and drain, so span = (m - 1) x max(t) + sum(t). Equal stages give formula(m, p)."""
    span = (m - 1) * max(per_micro) + sum(per_micro)
    return 1 - m * sum(per_micro) / (len(per_micro) * span)


def by_stage(ranks: list[dict]) -> list[dict]:
    """The probe's rank records of one pipeline, in stage order (this benchmark runs one: data-parallel 1)."""
    ordered = sorted(ranks, key=lambda r: r["stage"])
    assert [r["stage"] for r in ordered] == list(range(ordered[0]["stages"])), "one pipeline, one rank a stage"
    return ordered


def step_figures(stages: list[dict], i: int) -> dict:
    """Step i of one pipeline: its span, each stage's busy and send/recv seconds and bubble."""
    steps = [s["steps"][i] for s in stages]
    start = min(s["moments"]["first_forward"] for s in steps)
    span = max(s["moments"]["last_backward_end"] for s in steps) - start
    busy = [sum(s["seconds"].get(k, 0.0) for k in BUSY) for s in steps]
    comm = [sum(s["seconds"].get(k, 0.0) for k in COMM) for s in steps]
    return {
        "span": span,
        "busy": busy,
        "comm": comm,
        "forwards": [s["counts"].get("ForwardPass", 0) for s in steps],
        "bubble": 1 - sum(busy) / (len(busy) * span),
        "bubble_by_stage": [1 - b / span for b in busy],
    }


def overlap(start: float, end: float, intervals: list) -> float:
    """The share of [start, end] that the (name, start, end) intervals cover (they do not overlap each other:
    one stage runs one instruction at a time)."""
    return sum(max(0.0, min(end, b) - max(start, a)) for _, a, b in intervals) / (end - start)


def contention(stages: list[dict], skip: int) -> dict | None:
    """How much the stages slow each other: each stage's forward and backward passes split into those another
    stage computed through (over 90 % overlapped) and those it ran alone (under 10 %: the fill and drain), and
    per stage and kind the median duration of the first over the second (the same layers on the same
    micro-batch size). The formula assumes a pass takes one time throughout; on shared cores it need not.
    None when no kind has passes of both sorts (m = 1 never overlaps)."""
    alone: dict[str, list[float]] = {}
    together: dict[str, list[float]] = {}
    for i in range(skip, len(stages[0]["steps"])):
        busy = [s["steps"][i]["busy"] for s in stages]
        for k, mine in enumerate(busy):
            others = [x for j, b in enumerate(busy) if j != k for x in b]
            for name, a, b in mine:
                share, key = overlap(a, b, others), f"stage {k} {name}"
                if share < 0.1 or share > 0.9:
                    (together if share > 0.9 else alone).setdefault(key, []).append(b - a)
    ratios = {k: statistics.median(together[k]) / statistics.median(alone[k]) for k in alone if k in together}
    return {"ratios": ratios, "slowdown": statistics.median(ratios.values())} if ratios else None


def summarise_m(m: int, ranks: list[dict], skip: int) -> dict:
    """One micro-batch count's figures over the steps after the first `skip` (warm-up)."""
    stages = by_stage(ranks)
    p = len(stages)
    steps = [step_figures(stages, i) for i in range(skip, len(stages[0]["steps"]))]
    assert all(f == [m] * p for s in steps for f in [s["forwards"]]), f"expected {m} forward passes a stage"
    per_micro = [statistics.median(s["busy"][k] for s in steps) / m for k in range(p)]
    return {
        "m": m,
        "stages": p,
        "formula": formula(m, p),
        "measured": spread([s["bubble"] for s in steps]),
        "by_stage": [statistics.median(s["bubble_by_stage"][k] for s in steps) for k in range(p)],
        "expected_from_stage_times": expected(m, per_micro),
        "span_seconds": spread([s["span"] for s in steps]),
        "busy_per_micro_seconds": per_micro,
        "comm_share": [statistics.median(s["comm"][k] / s["span"] for s in steps) for k in range(p)],
        "contention": contention(stages, skip),
        "steps": len(steps),
    }


def fit(rows: list[dict]) -> dict | None:
    """Least squares of the median span against m: span = a + b x m. In theory b is the slowest stage's
    per-micro-batch time and a the fill and drain, (p - 1) x b for equal stages: a / b is the bubble's cost in
    micro-batch slots, and a / (a + b x m) the bubble the step time implies at each m (the slowest stage's
    idle share). None with fewer than two micro-batch counts."""
    if len({r["m"] for r in rows}) < 2:
        return None
    xs, ys = [r["m"] for r in rows], [r["span_seconds"]["median"] for r in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    return {
        "a": a,
        "b": b,
        "slots": a / b,
        "theory_slots": rows[0]["stages"] - 1,
        "by_m": {x: a / (a + b * x) for x in xs},
    }


def summarise(runs: dict[int, list[dict]], skip: int) -> dict:
    """Every micro-batch count's row, in order of m, and the fit across them."""
    rows = [summarise_m(m, runs[m], skip) for m in sorted(runs)]
    line = fit(rows)
    for r in rows:
        r["from_fit"] = line["by_m"][r["m"]] if line else None
    return {"rows": rows, "fit": line}
