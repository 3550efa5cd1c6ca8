"""Timing ratios with an interval: runners alternate in rotated rounds, windows pair up within a round, and a
bootstrap over the paired ratios gives the median's 95 % interval.

On a shared machine the load drifts by more than the differences worth measuring (±8 % between windows
here), but it drifts slowly: two runs launched back to back see nearly the same machine. So runner A's
window i is divided by runner B's window i from the same round, and only those paired ratios are summarised.
Rotating the order (A B C, B C A, C A B, ...) keeps any runner from always following the same one. The
bootstrap resamples rounds and then the pairs within each drawn round (a two-level, "cluster" bootstrap),
because windows of one round share that round's machine state and are not independent draws.
"""

from __future__ import annotations

import random
import statistics


def rotations(names: list[str], rounds: int) -> list[list[str]]:
    """The launch order of each round: round r starts r places further along the list."""
    n = len(names)
    return [[names[(r + i) % n] for i in range(n)] for r in range(rounds)]


def window_rates(starts: list[float], tokens: list[float], windows: int, warmup: int) -> list[float]:
    """Tokens/s over `windows` consecutive windows of equal step counts, after `warmup` steps (allocation,
    first-touch, JIT). `starts[i]` is when step i began and `tokens[i]` what it trained; step i ends when step
    i+1 begins, so the last step (no end) is never in a window. Runners whose steps differ in size (a padded
    batch vs a packed row) still pair up: window i is the i-th share of each run's epoch."""
    size = (len(starts) - 1 - warmup) // windows
    if size < 1:
        raise ValueError(f"{len(starts)} steps cannot make {windows} windows after {warmup} warm-up steps")
    out = []
    for w in range(windows):
        a, b = warmup + w * size, warmup + (w + 1) * size
        out.append(sum(tokens[a:b]) / (starts[b] - starts[a]))
    return out


def paired_ratios(rounds: list[dict[str, list[float]]], a: str, b: str) -> list[list[float]]:
    """Per round, rate_a[i] / rate_b[i] for each window i both runs have."""
    return [[x / y for x, y in zip(r[a], r[b])] for r in rounds]


def bootstrap(groups: list[list[float]], draws: int = 10000, level: float = 0.95, seed: int = 0) -> dict:
    """Median of all the ratios and its percentile interval from a two-level bootstrap (rounds, then pairs
    within each drawn round). Also the interval's half-width relative to the median, the larger side."""
    groups = [g for g in groups if g]
    flat = [x for g in groups for x in g]
    if not flat:
        raise ValueError("no paired windows to summarise")
    rng = random.Random(seed)
    medians = []
    for _ in range(draws):
        sample = []
        for g in rng.choices(groups, k=len(groups)):
            sample.extend(rng.choices(g, k=len(g)))
        medians.append(statistics.median(sample))
    medians.sort()
    lo = medians[int((1 - level) / 2 * draws)]
    hi = medians[min(draws - 1, int((1 + level) / 2 * draws))]
    med = statistics.median(flat)
    return {
        "median": med,
        "low": lo,
        "high": hi,
        "half_width": max(med - lo, hi - med) / med,
        "pairs": len(flat),
        "rounds": len(groups),
    }


def ratio(rounds: list[dict[str, list[float]]], a: str, b: str, **kw) -> dict:
    """Runner a's rate over runner b's, paired within rounds, as bootstrap() summarises it."""
    return bootstrap(paired_ratios(rounds, a, b), **kw)


def text(r: dict) -> str:
    """'1.012 (0.998–1.027, ±1.5 %)'."""
    return f"{r['median']:.3f} ({r['low']:.3f}–{r['high']:.3f}, ±{r['half_width']:.1%})"
