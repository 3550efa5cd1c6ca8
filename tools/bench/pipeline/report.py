"""The pipeline-parallelism report: benchmarks/pipeline-DATE.md from the figures tools/bench/pipeline/benchmark.py
measured, one function per section."""

from __future__ import annotations

from .. import paired
from ..common import footer, yes

PP = "PP2 (ZeRO-1)"
PARITY_TOL = 1e-5  # fp32, the same rows per step: only the summation order differs
CONTENTION = 1.10  # a pass slower than this with the other stage computing: the stages slow each other
MODEL = {  # ~17M parameters: 8 blocks split 4 + 4, compute-bound at micro-batch 1 x 256 tokens on one core
    "hidden_size": 384,
    "num_hidden_layers": 8,
    "num_attention_heads": 6,
    "num_key_value_heads": 6,
    "intermediate_size": 1024,
}
GPU_MODEL = {  # ~0.84B parameters (the embedded 4,096-token vocabulary): 16 blocks, 8 a stage
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "intermediate_size": 5632,
}
_ALL = ("ZeRO-1", "ZeRO-2", PP)
SIZES = {
    # batch: the global batch in sequences; pp_micro: PP2's micro-batch (batch / pp_micro micro-batches a step);
    # rounds: timed rounds of `steps` steps, `skip` left out; profiled_steps: steps of the profiled runs (0:
    # none); bubble_ms: the sweep's micro-batch counts, each one probed run of bubble_steps, bubble_skip left out
    "cpu": dict(model=MODEL, block=256, batch=8, pp_micro=1, steps=6, skip=2, rounds=2, profiled_steps=3)
    | dict(bubble_ms=(1, 2, 4, 8), bubble_steps=8, bubble_skip=2, configs=_ALL),
    "quick": dict(model=None, block=64, batch=2, pp_micro=1, steps=3, skip=1, rounds=0, profiled_steps=3)
    | dict(bubble_ms=(), bubble_steps=0, bubble_skip=1, configs=("ZeRO-1", PP)),
    "gpu": dict(model=GPU_MODEL, block=1024, batch=32, pp_micro=4, steps=30, skip=10, rounds=2, profiled_steps=0)
    | dict(bubble_ms=(1, 2, 4, 8, 16), bubble_steps=20, bubble_skip=5, configs=_ALL),
}


def mib(b: float) -> str:
    return f"{b / 2**20:,.0f}"


def markdown(r: dict) -> str:
    lines = [f"# Pipeline parallelism vs ZeRO, and the bubble, {r['date']}", "", f"Command: `{r['command']}`", ""]
    lines += throughput(r) + bubble(r) + reading(r) + method(r) + bubble_method(r) + gpu_run(r)
    lines += ["", *footer(r)]
    return "\n".join(lines) + "\n"


def vs_cell(x: dict, base: str) -> str:
    return paired.text(x["vs"][base]) if base in x["vs"] else "—"


def throughput(r: dict) -> list[str]:
    """One row per configuration: tokens/s, its paired ratios, per-rank peaks and loss parity."""
    s, c = r["settings"], r["configs"]
    lines = [
        f"## PP2 against ZeRO-1 and ZeRO-2: {s['batch']} sequences x {s['block']} tokens a step, 2 ranks",
        "",
        "| configuration | micro-batch x micro-batches a step (per rank) | tokens/s (median) | min–max | n | "
        "vs ZeRO-1 (paired median, 95 % interval) | vs ZeRO-2 | per-rank peak, MiB: whole run | within the "
        "optimizer steps | max abs Δloss vs ZeRO-1 | loss parity |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, x in c.items():
        t = x["tokens_per_sec"]
        if "peak_bytes_by_rank" in x:
            peak = " / ".join(mib(b) for b in x["peak_bytes_by_rank"])
            step = " / ".join(mib(b) for b in x["train_step_peak_bytes_by_rank"])
        else:  # a GPU run: rank 0's torch.cuda.max_memory_allocated
            peak, step = f"rank 0: {x['mem_peak_gb_rank0']['max'] * 1024:,.0f}", "—"
        lines.append(
            f"| {name} | {x['micro_batch']} x {x['accumulation']} | {t['median']:,.0f} | {t['min']:,.0f}–{t['max']:,.0f} "
            f"| {t['n']} | {vs_cell(x, 'ZeRO-1')} | {vs_cell(x, 'ZeRO-2')} | {peak} | {step} | "
            f"{x['max_abs_loss_delta_vs_zero1']:.2g} | {yes(x['loss_parity'])} |"
        )
    return lines


def stages(values: list[float], fmt: str) -> str:
    return " / ".join(format(v, fmt) for v in values)


def bubble(r: dict) -> list[str]:
    """The bubble table: measured against the formula, the stage times' prediction and the span fit."""
    b = r["bubble"]
    lines = [
        "",
        f"## The bubble against (p − 1) / (m + p − 1), PP2 (p = 2), micro-batch {r['settings']['pp_micro']}",
        "",
        "| m | (p − 1) / (m + p − 1) | measured bubble (median over steps) | min–max | stage 0 / stage 1 | "
        "expected from the measured stage times | implied by the span fit | span, s (median) | "
        "forward + backward per micro-batch, s: stage 0 / 1 | send + recv share of the span: stage 0 / 1 | "
        "a pass's time with the other stage computing / alone |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in b["rows"]:
        q = x["measured"]
        fit = "—" if x["from_fit"] is None else f"{x['from_fit']:.3f}"
        lines.append(
            f"| {x['m']} | {x['formula']:.3f} | {q['median']:.3f} | {q['min']:.3f}–{q['max']:.3f} | "
            f"{stages(x['by_stage'], '.3f')} | {x['expected_from_stage_times']:.3f} | {fit} | "
            f"{x['span_seconds']['median']:.3f} | {stages(x['busy_per_micro_seconds'], '.3f')} | "
            f"{stages(x['comm_share'], '.1%')} | {slowdown_cell(x['contention'])} |"
        )
    if b["fit"]:
        f = b["fit"]
        lines += [
            "",
            f"Span fit over m: span = {f['a']:.3f} s + {f['b']:.3f} s x m, so the fill and drain cost "
            f"{f['slots']:.2f} micro-batch slots (the formula's p − 1 = {f['theory_slots']}).",
        ]
    return lines


def slowdown_cell(c: dict | None) -> str:
    return "—" if c is None else f"{c['slowdown']:.2f}"


def interval_words(q: dict) -> str:
    """'faster', 'slower' or 'not distinguishable' from a paired ratio's 95 % interval."""
    if q["low"] > 1:
        return "faster"
    return "slower" if q["high"] < 1 else "not distinguishable (the interval holds 1)"


def reading(r: dict) -> list[str]:
    return ["", "## What the figures say", ""] + throughput_reading(r) + bubble_reading(r) + memory_reading(r)


def throughput_reading(r: dict) -> list[str]:
    c = r["configs"]
    pp, lines = c.get(PP), []
    if not pp or not pp["vs"]:
        return lines
    words = "; ".join(f"{paired.text(q)} x {base}: {interval_words(q)}" for base, q in pp["vs"].items())
    rates = [x["tokens_per_sec"] for x in c.values()]
    row = next((x for x in r["bubble"]["rows"] if x["m"] == pp["accumulation"]), None)
    widest = max(t["max"] / t["min"] for t in rates)
    drift = max(max(x["round_medians"]) / min(x["round_medians"]) for x in c.values())
    lines.append(
        f"- Throughput, PP2 against the ZeRO layouts on the same global batch: {words}. Within single runs the "
        f"per-step rate moved by up to {widest:.1f}x (min–max columns)"
        + (f" and one configuration's median by up to {drift:.2f}x from round to round" if drift > 1 else "")
        + ": the machine's load (other work shares it), which pairing within a round cancels only when it drifts "
        "slowly. On 2 cores PP2 does the same FLOPs per rank as "
        "data parallelism (half the layers on the whole batch instead of every layer on half the batch) and "
        f"idles for the bubble; the bubble table's m = {pp['accumulation']} row is its share"
        + (
            f": {row['measured']['median']:.3f}, so against a layout that never idles and communicates for free "
            f"PP2 would reach {1 - row['measured']['median']:.2f}x."
            if row
            else "."
        )
    )
    return lines


def bubble_reading(r: dict) -> list[str]:
    rows, fit = r["bubble"]["rows"], r["bubble"]["fit"]
    measured = [x["measured"]["median"] for x in rows]
    falls = all(a > b for a, b in zip(measured, measured[1:]))
    trend = (
        "" if len(rows) < 2 else "it falls with m as the formula does. " if falls else "it does not fall at every m. "
    )
    lines = [
        f"- Bubble: measured {', '.join(format(v, '.3f') for v in measured)} at m = "
        f"{', '.join(str(x['m']) for x in rows)} against the formula's "
        f"{', '.join(format(x['formula'], '.3f') for x in rows)}"
        + (f": {trend}" if trend else ". ")
        + split_sentence(rows[-1]),
    ]
    lines += contention_sentence(rows)
    if fit:
        slow = [max(x["busy_per_micro_seconds"]) for x in rows]
        lines.append(
            f"- The span fit (step time against m across the {len(rows)} runs) puts the fill and drain at "
            f"{fit['slots']:.2f} slots against p − 1 = {fit['theory_slots']}, but it assumes the machine ran at "
            f"one speed through all the runs: the slowest stage's time per micro-batch ranged "
            f"{min(slow):.3f}–{max(slow):.3f} s ({max(slow) / min(slow):.2f}x) between them. The within-step "
            "figure (busy against span in the same step, on the same machine state) does not depend on that and "
            "is the measurement; the fit is a cross-check."
        )
    return lines


def split_sentence(x: dict) -> str:
    """The largest m's gap to the formula: what the unequal stages account for, and the remainder."""
    t = x["busy_per_micro_seconds"]
    heavier = max(range(len(t)), key=lambda k: t[k])
    why = (
        " (the `parameters` partition weighs the embedding, whose lookup costs nearly nothing, like the head, "
        "whose matmul does not)"
        if heavier == len(t) - 1
        else ""
    )
    return (
        f"At m = {x['m']} it is {x['measured']['median'] - x['formula']:+.3f} from the formula. Stage {heavier} "
        f"computes {max(t) / min(t):.2f}x the other's time per micro-batch{why}, and the formula with the "
        f"measured stage times gives {x['expected_from_stage_times']:.3f}; what remains, "
        f"{x['measured']['median'] - x['expected_from_stage_times']:+.3f}, is the p2p copies and DeepSpeed's "
        "per-instruction work (which add to the bubble) less whatever the stages' slowing each other hides (below). "
        "The lighter stage idles most: it waits for the heavier one in every steady-state slot."
    )


def imbalance_explains(x: dict) -> bool:
    """Whether the formula with the measured stage times closes most of the measured gap to the formula."""
    gap = x["measured"]["median"] - x["formula"]
    return gap > 0 and abs(x["measured"]["median"] - x["expected_from_stage_times"]) < gap / 2


def contention_sentence(rows: list[dict]) -> list[str]:
    found = [(x["m"], x["contention"]["slowdown"]) for x in rows if x["contention"]]
    if not found:
        return []
    ratios = ", ".join(f"{v:.2f}x at m = {m}" for m, v in found)
    head = (
        f"- While the other stage computes, a forward or backward pass takes {ratios} its time alone (per stage "
        "and kind the median pass of each sort, then the median of those ratios): "
    )
    if max(v for _, v in found) < CONTENTION:
        return [
            head + "the two ranks hardly slow each other on this machine's 2 cores, so the formula's premise "
            "that a pass takes one time throughout holds"
            + (
                ", and the stages' imbalance accounts for most of the gap to the formula."
                if imbalance_explains(rows[-1])
                else "."
            )
        ]
    below = [str(x["m"]) for x in rows if x["measured"]["median"] < x["formula"]]
    return [
        head + "the stages slow each other (2 ranks share the 2 cores, their caches and memory, with each other "
        "and with other work). The formula assumes a pass takes one time throughout; here the fill and drain "
        "run alone and fast, the steady state together and slow, which pulls the measured share of idle "
        "stage-time down" + (f", below the formula at m = {', '.join(below)}" if below else "") + ". On GPUs "
        "each stage has a device of its own and this effect is largely absent."
    ]


def memory_reading(r: dict) -> list[str]:
    c = r["configs"]
    pp, z1 = c.get(PP, {}), c.get("ZeRO-1", {})
    if "peak_bytes_by_rank" not in pp or "peak_bytes_by_rank" not in z1:
        return []
    step = pp["train_step_peak_bytes_by_rank"]
    return [
        f"- Memory: within the optimizer steps PP2's stages peak at {' / '.join(mib(b) for b in step)} MiB against "
        f"ZeRO-1's {' / '.join(mib(b) for b in z1['train_step_peak_bytes_by_rank'])} MiB: a stage holds its own "
        "layers' weights, gradients and Adam moments (ZeRO-1 holds every weight and gradient and half the "
        "moments) and the activations of at most p micro-batches of 1. " + export_sentence(r, pp),
    ] + zero2_note(c)


def export_sentence(r: dict, pp: dict) -> str:
    """Where PP2's whole-run peak falls: in the export's gather of every stage's weights, or not."""
    step, whole, gather = (
        pp[k] for k in ("train_step_peak_bytes_by_rank", "peak_bytes_by_rank", "export_gather_peak_bytes_by_rank")
    )
    head = f"PP2's whole-run peak ({' / '.join(mib(b) for b in whole)} MiB) is "
    inside = f"inside PipelinedCausalLM.full_state_dict the ranks peak at {' / '.join(mib(b) for b in gather)} MiB"
    if max(gather) < max(whole):
        return head + f"not the export's gather ({inside})."
    model = f", {mib(4 * r['parameters'])} MiB in fp32" if r["settings"]["precision"] == "fp32" else ""
    return (
        head + f"the export's: {inside}, {' / '.join(mib(g - a) for a, g in zip(step, gather))} MiB above the "
        "steps'. It all-gathers every stage's weights to every rank (torch.distributed.all_gather_object) and "
        f"all but rank 0 drop them, so each rank briefly holds the whole model's CPU copy{model}, pickled and "
        "unpickled; a gather to rank 0 alone would spare the others."
    )


def zero2_note(c: dict) -> list[str]:
    """Why ZeRO-2 can peak above ZeRO-1 on a small model (DeepSpeed's gradient bucket), when it does."""
    z1, z2 = c.get("ZeRO-1", {}), c.get("ZeRO-2", {})
    if "train_step_peak_bytes_by_rank" not in z2 or max(z2["train_step_peak_bytes_by_rank"]) <= max(
        z1["train_step_peak_bytes_by_rank"]
    ):
        return []
    extra = max(z2["train_step_peak_bytes_by_rank"]) - max(z1["train_step_peak_bytes_by_rank"])
    return [
        f"- ZeRO-2 peaks {mib(extra)} MiB above ZeRO-1 although it shards the gradients too: with "
        "contiguous_gradients DeepSpeed (zero/stage_1_and_2.py) allocates a gradient bucket of "
        "reduce_bucket_size elements, and zero2.json's 5e7 (191 MiB in fp32, chosen for speed: "
        "benchmarks/settings-2026-11-30.md) is larger than all of this model's gradients."
    ]


def method(r: dict) -> list[str]:
    s, c = r["settings"], r["configs"]
    timed = s["rounds"] > 0
    return [
        "",
        "## Method",
        "",
        f"- Model: {s['model']} ({r['parameters'] / 1e6:.1f}M parameters); {s['precision']}; the embedded corpus; "
        "train.py's lines: "
        + "; ".join(f"{n}: `{x['distributed_line']}`" for n, x in c.items())
        + "."
        + (f" `{c[PP]['pipeline_line']}`." if c.get(PP, {}).get("pipeline_line") else ""),
        (
            f"- Throughput: {s['rounds']} timed rounds of {s['steps']} steps, the order rotated each round ("
            + "; ".join(" ".join(o) for o in s["orders"])
            + f"); the first {s['skip']} steps of each run left out. Ratios: step i of one configuration over "
            "step i of the other in the same round, the median of those pairs and its 95 % interval from a "
            "two-level bootstrap (rounds, then pairs: bench/paired.py)."
            if timed
            else "- No timed rounds (--quick): tokens/s comes from the profiled runs (the profiler slows the steps; "
            "a smoke run, not a measurement)."
        )
        + f" Whole benchmark: {s['wall_seconds'] / 60:.1f} min wall time.",
        f"- Per-rank peak memory: one more run per configuration ({s['profiled_steps']} steps) under "
        "torch.profiler with profile_memory (bench/runners/profiled_train.py; PP2's through bench/pipeline/probe.py, "
        "the same profiling): the running sum of each rank's CPU allocator events, torch tensors only, the whole "
        "run (model build, steps, save, export), within the optimizer steps and, for PP2, within the export's "
        "gather of every stage's weights (PipelinedCausalLM.full_state_dict, marked by the probe).",
        f"- Loss parity: every run's per-step loss against ZeRO-1's in the same round, tolerance {PARITY_TOL:g}.",
    ]


def bubble_method(r: dict) -> list[str]:
    s = r["settings"]
    source = (
        f"One launch per m, {s['bubble_steps']} steps each, the first {s['bubble_skip']} left out; the range is "
        "over the steps of that launch"
        if s["bubble_source"] == "sweep"
        else "No sweep (--quick): the one row is PP2's profiled run, its schedule timed under the allocator "
        "profiler (which slows every op)"
    )
    return [
        "- Bubble: PP2 through bench/pipeline/probe.py, train.py's main with the engine's `_INSTRUCTION_MAP` "
        "replaced (on that engine only) by wrappers that read a clock around each of DeepSpeed's own "
        "instruction methods, on every rank: nothing else in the run changes. Per step: the span from the "
        "first ForwardPass's start on any stage to the last BackwardPass's end on any stage (one clock, "
        "CLOCK_MONOTONIC, for all processes of the machine), each stage's busy time (its ForwardPass and "
        "BackwardPass instructions, the loss included on the last), and the bubble 1 − Σ busy / (p x span), "
        "the share of the stage-seconds in which no layer runs (per stage: 1 − busy / span). The optimizer "
        "step is outside the span (it does not grow with m). Send + recv share: the time in the p2p "
        f"instructions, which includes waiting for the neighbour. {source}.",
        "- DeepSpeed's own timers (`wall_clock_breakdown: true`) were the first choice and cannot be used: with "
        "pipeline stages DeepSpeed 0.19.8 starts `bwd_microstep` in PipelineEngine._exec_backward_pass and "
        "again in the engine's backward hook, and every stage but the last dies at its first backward "
        "(AssertionError: bwd_microstep timer has already been started).",
        "- Expected from the measured stage times: span = (m − 1) x max(t) + Σ t with t each stage's median "
        "busy time per micro-batch (the slowest stage paces the steady state; each stage passes once through "
        "the fill and drain), bubble = 1 − m Σ t / (p x span); equal stages give (p − 1) / (m + p − 1). Span "
        "fit: least squares of the median span against m, span = a + b m; a / b is the fill and drain in "
        "micro-batch slots (p − 1 in theory) and a / (a + b m) the bubble the step time implies.",
        "- A pass's time with the other stage computing / alone: each ForwardPass and BackwardPass's start and "
        "end are kept; a pass the other stage's passes cover for over 90 % of its time counts as together, "
        "under 10 % as alone (the fill and drain); per stage and kind the median of each, their ratio, then "
        "the median over stages and kinds that have both.",
    ]


def gpu_run(r: dict) -> list[str]:
    g = SIZES["gpu"]
    return [
        "",
        "## The GPU run (prepared, not run here)",
        "",
        f"`python tools/benchmark.py pipeline --gpu` runs the same in bf16 on 2 GPUs: block {g['block']}, "
        f"{g['batch']} sequences a step (ZeRO micro-batch {g['batch'] // 2} per GPU; PP2 {g['pp_micro']} x "
        f"{g['batch'] // g['pp_micro']}), {g['steps']} steps, {g['rounds']} rotated rounds, and the bubble at "
        f"micro-batch {g['pp_micro']}, m = {', '.join(map(str, g['bubble_ms']))}. The same launches by hand:",
        "",
        "```",
        *r["gpu_commands"],
        "```",
    ]
