"""Plot one or more runs' metrics.jsonl as PNGs: one chart per metric, every run on it, for comparison.

    python tools/plot_metrics.py outputs/tiny-llama                  # -> outputs/tiny-llama/plots/*.png
    python tools/plot_metrics.py runs/lr-2e-3 runs/lr-5e-4 --out cmp/   # two runs on each chart
    python tools/plot_metrics.py runs/a runs/b --json                # also a JSON summary: charts and series

Charts, each written when some run logged its data: loss.png (train loss, eval loss as markers),
eval_loss.png (perplexity on the right axis), eval_exact_match.png (SFT runs), eval_tasks.png (--eval_tasks:
each lm-eval task's metric, with the seconds each evaluation took in the legend), lr.png, grad_norm.png,
tokens_per_sec.png and memory.png (GPU max allocated, GPU allocated, CPU RSS: whichever were logged).
Runs are labelled by directory name, with parent directories added where two names are the same.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: no display needed, same output everywhere
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

MEMORY = {"mem_peak_gb": "GPU max allocated", "mem_allocated_gb": "GPU allocated", "cpu_rss_gb": "CPU RSS"}


class InputError(Exception):
    pass


def read_run(run_dir: Path) -> dict[str, dict[int, float]]:
    """{metric: {step: value}}. A step logged twice (a resumed launch redoing steps a killed one had logged:
    older files, or files joined by hand) keeps its LAST value: that launch's weights are the ones that went
    on to the export, and drawing both would fold the line back on itself. Kept per metric, so a step's
    train and eval records do not replace each other."""
    if not run_dir.is_dir():
        raise InputError(f"{run_dir} is not a directory; give a train.py --output_dir")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise InputError(f"{path} does not exist; give the --output_dir of a train.py run that has logged a step")
    series: dict[str, dict[int, float]] = {}
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (ValueError, KeyError, TypeError):
            raise InputError(
                f"{path}:{n}: not a metrics record (JSON with a 'step'): {line[:60]!r}; delete or fix "
                "that line (a launch killed mid-write can leave half a line)"
            ) from None
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                series.setdefault(key, {})[step] = float(value)
    if not series:
        raise InputError(f"{path} holds no records; train until the first --logging_steps step, then plot")
    return series


def labels_for(dirs: list[Path]) -> list[str]:
    """Directory names; where two differ but share a name, those get parent directories until they differ.
    The same directory given twice is numbered."""
    parts = [d.resolve().parts for d in dirs]
    depth = [1] * len(parts)
    while True:
        names = ["/".join(p[-k:]) for p, k in zip(parts, depth)]
        clash = [
            i
            for i, n in enumerate(names)
            if depth[i] < len(parts[i]) - 1 and any(names[j] == n and parts[j] != parts[i] for j in range(len(parts)))
        ]
        if not clash:
            break
        for i in clash:
            depth[i] += 1
    return [f"{n} ({names[:i].count(n) + 1})" if names.count(n) > 1 else n for i, n in enumerate(names)]


def chart(title, ylabel, runs, draws, y_style=None):
    """One figure: each draw(ax, label, series, colour) for each run. None when no run had anything to draw."""
    fig, ax = plt.subplots(figsize=(9, 5), layout="constrained")
    drawn = []  # the runs that had this metric
    for i, (label, series) in enumerate(runs):
        before = len(ax.lines)
        for draw in draws:
            draw(ax, label, series, f"C{i % 10}")
        drawn += [label] if len(ax.lines) > before else []
    if not drawn:
        plt.close(fig)
        return None
    ax.set(
        title=f"{title}: " + (f"{len(drawn)} runs" if len(drawn) > 1 else drawn[0]),
        xlabel="optimizer step",
        ylabel=ylabel,
    )
    ax.grid(True, alpha=0.3)
    if y_style:
        style_y(ax, y_style)
    beside = {"loc": "upper left", "bbox_to_anchor": (1.01, 1)}  # many series: beside the plot, hiding no data
    ax.legend(fontsize="small", **(beside if len(ax.lines) > 6 else {}))
    return fig


def line(key, suffix="", style="-", **kw):
    def draw(ax, label, series, colour):
        if key in series:  # a lone point gets a marker, or it would not show
            steps = sorted(series[key])
            ax.plot(
                steps,
                [series[key][s] for s in steps],
                style,
                color=colour,
                label=label + suffix,
                **({"marker": "o"} if len(series[key]) == 1 else {}),
                **kw,
            )

    return draw


OPT_IN = ("eval_tasks",)
"""Charts of what a run logs only when asked (--eval_tasks): their absence is not worth a line."""
OWN_EVAL = ("eval_loss", "eval_perplexity", "eval_exact_match", "eval_tasks_seconds", "eval_samples_seconds")


def eval_tasks(runs):
    """Every `eval_<task>_<metric>` that --eval_tasks logged (scores in [0, 1]): colour = run, style = metric;
    each run's mean seconds per evaluation in its labels, the cost of what is drawn."""
    keys = sorted({k for _, series in runs for k in series if k.startswith("eval_") and k not in OWN_EVAL})

    def draw(ax, label, series, colour):
        seconds = series.get("eval_tasks_seconds", {})
        cost = f" ({np.mean(list(seconds.values())):.1f} s per eval)" if seconds else ""
        for style, key in zip(["o-", "s--", "^:", "d-.", "v-", "x--"] * 4, keys):
            line(key, f": {key[5:]}{cost}", style)(ax, label, series, colour)

    return draw


def memory(runs):  # colour = run, line style = field; styles go to the fields some run logged, solid first
    logged = [key for key in MEMORY if any(key in series for _, series in runs)]

    def draw(ax, label, series, colour):
        for style, key in zip(["-", "--", ":"], logged):
            line(key, f": {MEMORY[key]}", style)(ax, label, series, colour)

    return draw


def style_y(ax, kind: str) -> None:
    """How a chart's y axis reads."""
    if kind == "perplexity":
        to_ppl, to_loss = (lambda x: np.exp(np.clip(x, -50, 50))), (lambda p: np.log(np.clip(p, 1e-12, None)))
        ax.secondary_yaxis("right", functions=(to_ppl, to_loss)).set_ylabel("eval perplexity (e^loss)")
    elif kind in ("zero", "rate"):  # from 0, so a 2 % dip does not look like a halving; headroom above the top
        top = max((y for ln in ax.lines for y in ln.get_ydata() if np.isfinite(y)), default=0)
        ax.set_ylim(0, top * 1.1 if top > 0 else 1.0)
        if kind == "rate":
            ax.yaxis.set_major_formatter(matplotlib.ticker.EngFormatter())  # 8 k, not 8000 or 8e3
    elif kind == "percent":
        ax.set_ylim(-0.02, 1.02)
        ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    elif kind == "sci":
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3), useMathText=True)  # 2.0 ×10⁻³, not 0.00200
    elif kind == "log":  # labelled 0.4 and 1, not 4×10⁻¹ and 10⁰; minor ticks too where it spans under 2 decades
        ax.set_yscale("log")
        plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
        ax.yaxis.set_major_formatter(plain)
        low, high = ax.get_ylim()
        if high / low < 100:
            ax.yaxis.set_minor_locator(matplotlib.ticker.LogLocator(subs=(2, 3, 5)))
            ax.yaxis.set_minor_formatter(plain)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("output_dirs", nargs="+", type=Path, metavar="OUTPUT_DIR", help="train.py --output_dir(s)")
    ap.add_argument("--out", type=Path, help="folder for the PNGs (default: the first OUTPUT_DIR's plots/)")
    ap.add_argument("--json", action="store_true", help="also print {chart: {path, title, series}} as one JSON line")
    args = ap.parse_args(argv)
    try:
        runs = list(zip(labels_for(args.output_dirs), [read_run(d) for d in args.output_dirs]))
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    specs = [  # file name, title, y label, what each run draws, y axis style
        (
            "loss",
            "Training loss (eval loss as markers)",
            "loss (nats/token)",
            [line("loss", " train"), line("eval_loss", " eval", "o--", markersize=5)],
            None,
        ),
        ("eval_loss", "Eval loss", "eval loss (nats/token)", [line("eval_loss", "", "o-")], "perplexity"),
        (
            "eval_exact_match",
            "Eval exact match (SFT; greedy answer is exactly right)",
            "eval examples exactly right",
            [line("eval_exact_match", "", "o-")],
            "percent",
        ),
        ("eval_tasks", "lm-eval tasks on the live model", "score", [eval_tasks(runs)], "percent"),
        ("lr", "Learning rate", "learning rate", [line("lr")], "sci"),
        ("grad_norm", "Gradient norm (before clipping)", "global L2 norm (log scale)", [line("grad_norm")], "log"),
        ("tokens_per_sec", "Throughput, all ranks", "tokens/s", [line("tokens_per_sec")], "rate"),
        ("memory", "Memory (rank 0)", "GiB", [memory(runs)], "zero"),
    ]
    out = args.out or args.output_dirs[0] / "plots"
    summary = {}
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, title, ylabel, draws, y_style in specs:
            fig = chart(title, ylabel, runs, draws, y_style)
            if fig is None:
                if name not in OPT_IN:
                    print(f"skipped {name}.png: no run logged it", file=sys.stderr)
                continue
            path = out / f"{name}.png"
            fig.savefig(path, dpi=110)
            ax = fig.axes[0]
            summary[name] = {
                "path": str(path),
                "title": ax.get_title(),
                "series": [t.get_text() for t in ax.get_legend().get_texts()],
            }
            plt.close(fig)
            print(path)
    except OSError as e:
        print(
            f"error: cannot write the plots to {out}: {e.strerror or e}; pass --out a writable folder", file=sys.stderr
        )
        return 2
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
