"""The SFT benchmark's breakdown of time to first step, train.py against TRL, cold and cached
(bench/sft/startup_probe.py).

For each of the two runners: one launch with fresh data caches (cold) and one with the caches its timed
rounds built (cached), each stopped when its first optimizer step is done. --quick launches neither: its one timed
round's train.py and TRL launches (cold: their caches are new) are traced themselves and run on to their end.
The two ranks' records are averaged. These launches are traced
(every module's execution is timed), so their totals run a little above the untraced rounds' times, which
are the ones the ratio is taken on.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from ..common import free_port, run_checked

RUNNERS = ("train.py", "TRL SFTTrainer")
STATES = ("cold", "cached")
ORDER = ("python start", "imports", "process group", "tokenizer", "data", "model build", "deepspeed.initialize")
ORDER += ("first step", "other")


def launch(cmd_of, env_of, runner: str, tmp: Path, state: str) -> dict:
    """One traced launch; cmd_of(runner, out) is the benchmark's own command, env_of(runner, fresh) its
    environment: fresh data caches or the ones the runner's timed rounds built."""
    name = runner.replace(" ", "_").replace(".", "")
    out = tmp / "startup" / f"{name}-{state}"
    out.mkdir(parents=True)
    cmd = traced(cmd_of(runner, out), out)
    cmd[cmd.index("--master_port") + 1] = str(free_port())
    run_checked(cmd, env_of(runner, state == "cold"), 1800, f"{runner} ({state}, traced)")
    return read(out)


def traced(cmd: list[str], out: Path, keep_going: bool = False) -> list[str]:
    """A runner's launch under the start-up probe, its records at out/startup.rank<N>.json: `--module bench.X` ->
    `--module bench.sft.startup_probe --startup_out S bench.X`. keep_going: the run goes on past its first step."""
    cmd = list(cmd)
    module = cmd.index("--module")
    probe = ["bench.sft.startup_probe", *(["--startup_keep_going"] if keep_going else []), "--startup_out"]
    cmd[module + 1 : module + 1] = [*probe, str(out / "startup")]
    return cmd


def read(out: Path) -> dict:
    """One traced launch's breakdown: its ranks' records averaged."""
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("startup.rank*.json"))]
    return {
        "time_to_first_step": statistics.mean(r["time_to_first_step"] for r in ranks),
        "imports": mean_of([r["imports"] for r in ranks]),
        "phases": mean_of([r["phases"] for r in ranks]),
        "other": statistics.mean(r["other"] for r in ranks),
    }


def mean_of(records: list[dict]) -> dict:
    keys = {k for r in records for k in r}
    return {k: statistics.mean(r.get(k, 0.0) for r in records) for k in keys}


def measure(cmd_of, env_of, tmp: Path, states=STATES) -> dict:
    out = {}
    for runner in RUNNERS:
        for state in states:
            out[f"{runner}, {state}"] = x = launch(cmd_of, env_of, runner, tmp, state)
            print(f"  traced start-up, {runner} {state}: {x['time_to_first_step']:.1f} s to the first step", flush=True)
    return out


def pairs(cmd_of, env_of, tmp: Path, count: int) -> list[list[float]]:
    """`count` more cached launches of each runner, alternating which goes first, each stopped at its first step:
    [train.py, TRL] seconds to the first step a pair. A launch costs one start-up and one step, not an epoch,
    so the ratio the goal is on gets many pairs where the timed rounds give one a round."""
    out = []
    for i in range(count):
        order = RUNNERS if i % 2 == 0 else RUNNERS[::-1]
        times = {r: launch(cmd_of, env_of, r, tmp, f"cached-pair{i}")["time_to_first_step"] for r in order}
        out.append([times[r] for r in RUNNERS])
        print(f"  traced pair {i + 1}/{count}: {times[RUNNERS[0]]:.1f} / {times[RUNNERS[1]]:.1f} s", flush=True)
    return out


def rows(breakdown: dict) -> dict[str, list[float]]:
    """Table rows (seconds per column, in breakdown's order): the phases, then each heavy package's imports."""
    cols = list(breakdown.values())
    packages = sorted({p for c in cols for p in c["imports"]}, key=lambda p: -max(c["imports"].get(p, 0) for c in cols))
    table = {}
    for phase in ORDER:
        if phase == "imports":
            table["imports, all"] = [sum(c["imports"].values()) for c in cols]
            for p in packages:
                table[f"  import {p}"] = [c["imports"].get(p, 0.0) for c in cols]
        elif phase == "other":
            table["other"] = [c["other"] for c in cols]
        else:
            table[phase] = [c["phases"].get(phase, 0.0) for c in cols]
    table["time to first step"] = [c["time_to_first_step"] for c in cols]
    return table


def markdown(breakdown: dict, rounds_traced: bool = False) -> list[str]:
    """rounds_traced: the breakdown is the timed round's own launches, traced (--quick), not launches of its own."""
    if not breakdown:
        return []
    which = (
        "the round's train.py and TRL launches above, traced"
        if rounds_traced
        else "traced launches, so a little slower than the rounds above"
    )
    lines = [
        "",
        "Where the time to first step goes (seconds, mean of the two ranks; tools/bench/sft/startup_probe.py: "
        "each module's "
        "own execution time goes to its package, or to the heavy package that imported it; phases exclude the "
        f"imports inside them; {which}):",
        "",
        "| | " + " | ".join(breakdown) + " |",
        "|---" * (len(breakdown) + 1) + "|",
    ]
    for name, values in rows(breakdown).items():
        if name.startswith("  import") and max(values) < 0.05:
            continue
        label = f"&nbsp;&nbsp;{name.strip()}" if name.startswith("  ") else name
        lines.append(f"| {label} | " + " | ".join(f"{v:.2f}" for v in values) + " |")
    return lines
