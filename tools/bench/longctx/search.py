"""The search for the longest sequence that trains within a memory budget (tools/bench/longctx/benchmark.py runs
it): doubling, then bisection, on whether one run at a length trained within the budget; and the linear
prediction of a run's peak that keeps runs over the machine's cap from being launched.
"""

from __future__ import annotations


def trains_within(p: dict | None, budget: float) -> bool:
    """A run trains within the budget: it exited 0 and its per-rank peak is at most the budget."""
    return bool(p) and p.get("exit_code") == 0 and "peak_bytes" in p and p["peak_bytes"] <= budget


def predicted_peak(points: dict[int, dict], block: int) -> float | None:
    """The per-rank peak at `block`, linear in the length through the two measured blocks nearest below it
    (None with fewer than two)."""
    known = sorted(b for b, p in points.items() if "peak_bytes" in p and b < block)
    if len(known) < 2:
        return None
    b1, b2 = known[-2:]
    p1, p2 = points[b1]["peak_bytes"], points[b2]["peak_bytes"]
    return p2 + (p2 - p1) / (b2 - b1) * (block - b2)


def longest(fits, start: int, quantum: int, resolution: float, limit: int) -> dict:
    """The longest multiple of `quantum` for which fits(length) holds, assuming it holds below some length
    and not above: doubling from `start` (or halving while it fails) to a bracket [lo, hi), then bisection
    until hi - lo <= max(quantum, lo * resolution). `limit`: the longest length tried (hi is then None when
    every length up to it fits). Returns lo (0 if not even `quantum` fits), hi and the lengths tried in order."""
    tried = []

    def ok(n):
        tried.append(n)
        return fits(n)

    lo, hi = 0, None
    n = start
    if ok(n):
        lo = n
        while n * 2 <= limit:
            n *= 2
            if not ok(n):
                hi = n
                break
            lo = n
    else:
        hi = n
        while n // 2 >= quantum and n // 2 % quantum == 0:
            n //= 2
            if ok(n):
                lo = n
                break
            hi = n
        if lo == 0:
            return {"longest": 0, "shortest_failing": hi, "tried": tried}
    while hi is not None and hi - lo > max(quantum, lo * resolution):
        mid = (lo + hi) // 2 // quantum * quantum
        if mid <= lo:
            break
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return {"longest": lo, "shortest_failing": hi, "tried": tried}
