"""The long-context report: benchmarks/longctx-DATE.{md,png} from the figures tools/bench/longctx/benchmark.py
measured (its .json), one function per section of the .md.

    python tools/benchmark.py longctx --render benchmarks/longctx-DATE.json   # the .md and .png again
"""

from __future__ import annotations

import json
from pathlib import Path

from ..common import footer, write_report, yes

# The four configurations the goals compare, by the names longctx.CONFIGS runs them under (it adds the tiled MLP)
TODAY, TILED, SP, SP_TILED = "ZeRO-3 (today)", "ZeRO-3 + tiled loss", "ZeRO-3 + SP2", "ZeRO-3 + SP2 + tiled loss"
GiB = 2**30


def budget_label(budget: float) -> str:
    return f"{budget / GiB:.2f} GiB"


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, pts in r["points"].items():
        xs = [int(b) for b in sorted(pts, key=int) if "peak_bytes" in pts[b]]
        if xs:
            ax.plot(xs, [pts[str(b)]["peak_bytes"] / GiB for b in xs], marker="o", label=name)
    for budget, style in zip(r["settings"]["budgets_bytes"], ("--", ":", "-.")):
        ax.axhline(budget / GiB, color="grey", linestyle=style, label=f"budget {budget_label(budget)}")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _pos: f"{x:,.0f}"))
    ax.set_xlabel("sequence length (tokens per sequence)")
    ax.set_ylabel("per-rank peak, GiB (allocator events)")
    ax.set_title(f"Per-rank peak vs sequence length, 2 ranks, V = {r['settings']['vocab_size']:,}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def growth(points: dict) -> dict | None:
    """Peak per 1,024 tokens and the intercept at 0, through the two longest blocks in the sweep that trained
    (points keyed by block, as ints or strings)."""
    ok = sorted((int(b), p["peak_bytes"]) for b, p in points.items() if p.get("exit_code") == 0 and "peak_bytes" in p)
    if len(ok) < 2:
        return None
    (b1, p1), (b2, p2) = ok[-2:]
    slope = (p2 - p1) / (b2 - b1)
    return {"per_1024": slope * 1024, "intercept": p2 - slope * b2, "blocks": [b1, b2]}


def states_spread(points: dict) -> dict:
    """The widest range of the model states over one configuration's runs (they do not depend on the length,
    so the range is the runs' noise): {bytes, config, min, max}."""
    best = {"bytes": 0, "config": None, "min": None, "max": None}
    for name, pp in points.items():
        states = [p["states_bytes"] for p in pp.values() if "states_bytes" in p]
        if states and max(states) - min(states) >= best["bytes"]:
            best = {"bytes": max(states) - min(states), "config": name, "min": min(states), "max": max(states)}
    return best


def gib(b: float | None) -> str:
    return "—" if b is None else f"{b / GiB:.2f}"


def fmt_ratio(x: dict) -> str:
    return "—" if x["ratio"] is None else f"{x['ratio']:.2f}x"


def markdown(r: dict, png: str) -> str:
    pts = r["points"]
    blocks = sorted({int(b) for p in pts.values() for b in p})
    lines = intro(r) + goals_table(r) + ["", f"![per-rank peak vs sequence length]({png})"]
    lines += memory_tables(pts, blocks) + growth_table(pts) + searches_table(r) + method(r) + failed_runs(pts)
    lines += ["", *footer(r)]
    return "\n".join(lines) + "\n"


def intro(r: dict) -> list[str]:
    """The title, the command, and the model, budgets and runs of this invocation."""
    s = r["settings"]
    code = s.get("code", {"commit": "unknown", "uncommitted": []})
    lines = [f"# Long context: tiled loss and sequence parallelism, {r['date']}", "", f"Command: `{r['command']}`", ""]
    lines += [
        f"Model: the embedded tiny Llama with `--model_config '{json.dumps(s['model'])}'` "
        f"({r['parameters']:,} parameters), fp32, ZeRO-3 on 2 ranks, one sequence per rank (under SP=2 the two "
        f"ranks share one sequence, each holding half of it), {s['steps']} optimizer steps per run. Budgets for "
        f"the search: {', '.join(budget_label(b) for b in s['budgets_bytes'])} per rank. This invocation: "
        f"{s['wall_seconds'] / 60:.1f} min, {s['runs']} runs, {s.get('reused', 0)} of them read back from earlier "
        "invocations into its work directory (same model, steps and loss tile; their commits are not recorded "
        f"here). Code of this invocation: commit {code['commit'][:10]}"
        + (f" with uncommitted changes in {', '.join(code['uncommitted'])}" if code["uncommitted"] else "")
        + ".",
    ]
    return lines


def goals_table(r: dict) -> list[str]:
    """The goal ratios against their targets, then each ratio by block."""
    s, g = r["settings"], r["goals"]
    lines = [
        "",
        "## Goals",
        "",
        "| goal | measured | target | met |",
        "|---|---|---|---|",
    ]
    a, at, b = g["sp_activation"], g["sp_activation_tiled"], g["tiled_loss_region"]
    lines += [
        f"| (a) SP=2 cuts the per-rank activation peak, same length (untiled loss: {TODAY} / {SP}, at {a['block']}) "
        f"| {fmt_ratio(a)} | ≥ {a['goal']}x | {yes(a['met'])} |",
        f"| (a') the same with the tiled loss ({TILED} / {SP_TILED}, at {at['block']}) | {fmt_ratio(at)} | "
        f"≥ {at['goal']}x | {yes(at['met'])} |",
        f"| (b) tiled loss cuts the loss region at V = {s['vocab_size']:,} ({TODAY} / {TILED}, at {b['block']}) | "
        f"{fmt_ratio(b)} | ≥ {b['goal']}x | {yes(b['met'])} |",
    ]
    for label, c in r["longest_by_budget"].items():
        lines.append(
            f"| (c) longest trainable sequence within {label} per rank: {c['config']} ({c['longest']}) / {TODAY} "
            f"({c['baseline']}) | {fmt_ratio(c)} | ≥ {c['goal']}x | {yes(c['met'])} |"
        )
    lines += [
        "",
        "Each ratio is taken at the longest block where both of its runs trained; by block: "
        + "; ".join(
            f"{k} " + ", ".join(f"{n}: {v:.2f}x" for n, v in g[k]["by_block"].items() if v)
            for k in ("sp_activation", "sp_activation_tiled", "tiled_loss_region")
        )
        + ".",
    ]
    return lines


def cell(p, key):
    if p is None:
        return ""
    if "skipped" in p:
        return "not run (over cap)"
    if key not in p:
        return f"**failed** (exit {p['exit_code']})"
    return gib(p[key])


def memory_tables(pts: dict, blocks: list[int]) -> list[str]:
    """One table per figure of a point (configurations by block length)."""
    lines = []
    for key, title in (
        ("peak_bytes", "Per-rank peak of the optimizer steps, GiB (largest over the 2 ranks)"),
        ("states_bytes", "Model states (live bytes when a forward starts), GiB"),
        ("activation_bytes", "Activation peak (peak from forward to optimizer step - model states), GiB"),
        (
            "loss_region_bytes",
            "Loss region (head + loss: peak from the final norm to its gradient - live bytes there), GiB",
        ),
    ):
        lines += ["", f"## {title}", "", "| configuration | " + " | ".join(str(n) for n in blocks) + " |"]
        lines += ["|---|" + "---|" * len(blocks)]
        for name, p in pts.items():
            lines.append(f"| {name} | " + " | ".join(cell(p.get(str(n)), key) for n in blocks) + " |")
    return lines


def growth_table(pts: dict) -> list[str]:
    lines = [
        "",
        "## Per-token growth",
        "",
        "Per-rank peak added per 1,024 more tokens of sequence, between the two longest lengths each configuration "
        "trained (sweep or search), and the peak those two points extrapolate to at length 0 (the fixed part: model "
        "states, ZeRO-3's gathered weights, one loss tile).",
        "",
        "| configuration | GiB per 1,024 tokens | fixed part, GiB | between |",
        "|---|---|---|---|",
    ]
    for name, pp in pts.items():
        g2 = growth(pp)
        if g2:
            lines.append(
                f"| {name} | {g2['per_1024'] / GiB:.3f} | {gib(g2['intercept'])} | {g2['blocks'][0]}–{g2['blocks'][1]} |"
            )
    return lines


def searches_table(r: dict) -> list[str]:
    lines = [
        "",
        "## Longest sequence within the budget",
        "",
        "| budget per rank | configuration | longest that trained within the budget | shortest that did not | "
        "lengths tried, in order |",
        "|---|---|---|---|---|",
    ]
    for label, found in r["searches"].items():
        for name, x in found.items():
            lines.append(
                f"| {label} | {name} | {x['longest']} | {x['shortest_failing'] or '—'} | "
                f"{', '.join(map(str, x['tried']))} |"
            )
    return lines


def method(r: dict) -> list[str]:
    s, pts = r["settings"], r["points"]
    spread = states_spread(pts)
    spread["matrix"] = s["vocab_size"] * s.get("hidden_size", 128) * 4
    parity = r["loss_parity"]
    return [
        "",
        "## Method",
        "",
        "- Each point: `deepspeed --num_gpus 2` running train.py's main() under "
        "tools/bench/longctx/probe.py (torch.profiler, profile_memory, every rank): the running sum of "
        "the CPU allocator's events is the live torch bytes (exact for tensors; not the Python heap or "
        "libraries). The peak is that of the optimizer steps (train.py's runner.train_step); the export at the "
        "end is left out. No held-out split (`--validation_split_percentage 0`): train.py's eval would compute "
        "whole-sequence logits on every rank.",
        "- The split: model states = live bytes when the step's forward starts; activation peak = the step's "
        "peak from there to the optimizer step minus the model states (this includes ZeRO-3's gathered "
        "weights of the layer running, e.g. the 64 MiB head at V = 128k, and the head's weight gradient); loss "
        "region = peak from the final norm's output to the arrival of its gradient minus the live bytes at the "
        "norm (logits or tiles of them, their fp32 log-softmax and gradients). The last step is used (the "
        "first has no Adam states yet); each figure is the larger of the two ranks'.",
        f"- Search: from the sweep's shortest block, doubling (or halving) then bisection on multiples of "
        f"{s['quantum']} tokens until the bracket is within {s['resolution']:.0%} of its lower end; a length "
        "trains within the budget when train.py exits 0 and the measured peak is at most the budget. Runs the "
        f"measured peaks predict over {gib(s['cap_bytes'])} GiB per rank (the machine's cap, linear in the "
        "length) are not launched.",
        f"- Run-to-run noise: the model states do not depend on the length, yet over the runs of one "
        f"configuration they spread by up to {gib(spread['bytes'])} GiB ({spread['config']}: "
        f"{gib(spread['min'])}–{gib(spread['max'])} GiB), in steps of about one {spread['matrix'] / 2**20:.0f} MiB "
        "vocabulary x hidden fp32 matrix (the size of the embedding, the head and their gradients) that is alive at "
        "some steps' start and not at others'. A peak within that distance of the budget could land on the "
        "other side of it in a rerun; the activation peaks and loss regions (differences within one step) do "
        "not move this way.",
        "- Loss check, tiled against untiled on the same rows (fp32): max |Δloss| "
        + ", ".join(f"{k}: {v:.2g}" for k, v in parity.items() if v is not None)
        + ".",
        "- train.py's mesh lines: "
        + "; ".join(
            f"{n}: `{next((p['distributed_line'] for p in pp.values() if p.get('distributed_line')), '')}`"
            for n, pp in pts.items()
        )
        + ".",
    ]


def failed_runs(pts: dict) -> list[str]:
    """Each run that did not exit 0: its command and the end of its output (none: no section)."""
    failed = [(n, b, p) for n, pp in pts.items() for b, p in pp.items() if p.get("exit_code") not in (None, 0)]
    lines = []
    if failed:
        lines += ["", "## Failed runs", ""]
        for name, block, p in failed:
            tail = "\n".join(p.get("output_tail", "").splitlines()[-12:])
            lines += [
                f"{name} at {block} (exit {p['exit_code']}): `{p.get('command', '')}`",
                "",
                "```",
                tail,
                "```",
                "",
            ]
    return lines


def render(path: Path) -> int:
    """The .md and .png again from a report's .json (after a change to their layout; nothing is rerun)."""
    result = json.loads(path.read_text())
    plot(result, path.with_suffix(".png"))
    write_report(str(path.parent), path.stem, result, markdown(result, path.with_suffix(".png").name))
    return 0
