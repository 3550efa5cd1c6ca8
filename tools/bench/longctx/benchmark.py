"""Long context on 2 ranks: per-rank peak memory against sequence length for ZeRO-3 alone, the tiled loss,
Ulysses sequence parallelism (SP=2) and both, and the longest sequence that trains within a memory budget.

    python tools/benchmark.py longctx             # benchmarks/longctx-DATE.{md,json,png} (~25 min on 2 cores)
    python tools/benchmark.py longctx --quick     # tiny blocks, 4 configurations (the test)

Every point is one train.py run through the real launcher (`deepspeed --num_gpus 2`, one sequence per rank,
a couple of optimizer steps) under tools/bench/longctx/probe.py: torch.profiler's allocator events on
every rank, read at marks placed at the start of each forward, at the final norm (where the output head and
the loss begin), when the gradient reaches it again, and at the optimizer step. Per step:
  model states  = live bytes when the forward starts (what outlives a step),
  activations   = peak from the forward to the optimizer step - model states,
  loss region   = peak from the final norm to its gradient - live bytes at the final norm.
A point's figures are the largest over ranks of its last step (the first step has no Adam states yet).

The longest sequence within the budget, per configuration: from the sweep's smallest block, doubling (or
halving) until one trains within the budget and the next does not, then bisection on multiples of
`quantum` until the bracket is within `resolution` of its lower end. "Trains within the budget": train.py
exits 0 and the measured per-rank peak of the optimizer steps is at most the budget. Runs whose peak the
measured ones predict (linear in the length) above the machine's cap are not launched. One search per budget
(the runs are shared). `--work-dir DIR` keeps the runs in DIR and reads back any run an earlier invocation with
the same model, steps and loss tile completed there, so a search at another budget reruns nothing measured.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..common import REPO, child_env, free_port, new_report, write_report
from .report import SP, SP_TILED, TILED, TODAY, GiB, budget_label, fmt_ratio, markdown, plot, render
from .search import longest, predicted_peak, trains_within

ZERO3, SP2 = "ds_configs/zero3.json", "ds_configs/sp2.json"
# name: (sequence-parallel size, tiled loss, tiled MLP)
CONFIGS: dict[str, tuple[int, bool, bool]] = {
    TODAY: (1, False, False),
    TILED: (1, True, False),
    SP: (2, False, False),
    SP_TILED: (2, True, False),
    "ZeRO-3 + SP2 + tiled loss + tiled MLP": (2, True, True),
}
GOALS = {"sp_activation": 1.8, "tiled_loss_region": 4.0, "longest": 3.0}
LONG_MODEL = {"vocab_size": 131072, "max_position_embeddings": 65536, "num_hidden_layers": 8}
SIZES = {
    # model: --model_config; blocks: the sweep; budgets: per-rank bytes, one search each (the first is the
    # goal's; 1.5 GiB was picked first, to keep the longest runs short, and sits within the runs' noise of the
    # SP configurations' fixed part, so 1.75 GiB is searched too); quantum and resolution:
    # when the bisection stops; steps: optimizer steps per run; configs: which of CONFIGS run
    "full": dict(
        model=LONG_MODEL,
        blocks=[1024, 2048, 4096, 8192],
        budgets=[1.5 * GiB, 1.75 * GiB],
        quantum=64,
        resolution=1 / 4,
        steps=2,
        loss_tile_tokens=0,
        configs=list(CONFIGS),
        search=list(CONFIGS),
        limit=16384,
    ),
    "quick": dict(
        model={"vocab_size": 32768, "num_hidden_layers": 2},
        blocks=[256],
        budgets=[0.3 * GiB],
        quantum=128,
        resolution=1.0,
        steps=2,
        loss_tile_tokens=64,
        configs=list(CONFIGS)[:4],
        search=[TODAY, SP_TILED],
        # the search starts and ends at the sweep's block: it reads back those runs instead of launching two
        # more (the doubling and bisection are unit-tested in tests/unit/tools/test_benchmark_longctx.py)
        limit=256,
    ),
}
TIMEOUT = 1800  # one run, seconds


def launch(name: str, block: int, size: dict, out: Path, probe: Path) -> list[str]:
    """The `deepspeed` command line of one configuration at one block size, under the probe."""
    sp, tiled_loss, tiled_mlp = CONFIGS[name]
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port())]
    cmd += ["--module", "bench.longctx.probe", "--deepspeed", ZERO3, *([SP2] if sp == 2 else [])]
    cmd += ["--model_config", json.dumps(size["model"]), "--block_size", str(block)]
    cmd += ["--per_device_train_batch_size", "1", "--max_steps", str(size["steps"]), "--learning_rate", "1e-3"]
    cmd += ["--tiled_loss", str(tiled_loss).lower(), "--tiled_mlp", str(tiled_mlp).lower()]
    cmd += ["--loss_tile_tokens", str(size["loss_tile_tokens"])]
    # no held-out rows: train.py's eval computes whole-sequence logits (no SP, no tiles) and would dwarf
    # the training step at long blocks; the loss of each step is in metrics.jsonl
    cmd += ["--validation_split_percentage", "0", "--eval_steps", "0", "--save_steps", "0"]
    cmd += ["--logging_steps", "1", "--report_to", "none", "--output_dir", str(out), "--probe_out", str(probe)]
    return cmd


def run(cmd: list[str], timeout: int = TIMEOUT) -> tuple[int, str]:
    """(exit code, output) of a launch from the repo root, in its own process group (a timeout ends the
    launcher's ranks too; exit code 124 then)."""
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=child_env(),  # the probe runs as `-m bench.longctx.probe`
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return 124, output


def point(ranks: list[dict]) -> dict:
    """One run's figures from its ranks' probe files: the largest over ranks, at the last complete step."""
    last = [next(s for s in reversed(r["steps"]) if s.get("complete")) for r in ranks]
    return {
        "peak_bytes": max(r["phase_peak_bytes"]["train_step"] for r in ranks),
        "peak_bytes_by_rank": [r["phase_peak_bytes"]["train_step"] for r in ranks],
        "whole_run_peak_bytes": max(r["peak_bytes"] for r in ranks),
        "states_bytes": max(s["states"] for s in last),
        "activation_bytes": max(s["activations"] for s in last),
        "activation_bytes_by_rank": [s["activations"] for s in last],
        "loss_region_bytes": max(s["loss_region"] for s in last),
    }


def measure_point(name: str, block: int, size: dict, tmp: Path) -> dict:
    """One run, or its files read back when an earlier invocation with the same settings left them in `tmp`
    (--work-dir): the probe's rank files, metrics.jsonl and the launch's output."""
    out = tmp / f"{slug(name)}-{block}"
    probe = tmp / f"{slug(name)}-{block}-probe"
    cmd = launch(name, block, size, out, probe)
    files = [Path(f"{probe}.rank{r}.json") for r in range(2)]
    log = Path(f"{out}.log")
    if all(f.exists() for f in files) and log.exists() and (out / "metrics.jsonl").exists():
        code, output, seconds, reused = 0, log.read_text(), None, True
    else:
        for f in files:
            f.unlink(missing_ok=True)
        started = time.perf_counter()
        code, output = run(cmd + ["--overwrite_output_dir", "true"])
        seconds, reused = time.perf_counter() - started, False
        log.write_text(output)
    result = {"block": block, "exit_code": code, "wall_seconds": seconds, "reused": reused}
    if code == 0 and all(f.exists() for f in files):
        result.update(point([json.loads(f.read_text()) for f in files]))
        records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        result["losses"] = [r["loss"] for r in records if "tokens_per_sec" in r]
        for child in out.iterdir():  # the checkpoint and the export: ~0.5 GB a run at a 128k vocabulary
            if child.name != "metrics.jsonl":
                shutil.rmtree(child) if child.is_dir() else child.unlink()
        line = next((x for x in output.splitlines() if x.startswith("distributed:")), "")
        result["distributed_line"] = line
    else:
        result["command"] = " ".join(f"'{c}'" if c.startswith("{") else c for c in cmd)
        result["output_tail"] = output[-3000:]
    return result


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def goals(configs: dict, searches: dict) -> dict:
    """The three goal ratios, each at the largest block where both of its runs trained:
    sp_activation: per-rank activation peak without SP / with SP=2 (untiled loss; and the tiled pair too),
    tiled_loss_region: loss region untiled / tiled (SP=1), longest: longest within the budget, SP2 + tiled
    loss (the best SP2 + tiling configuration run) / ZeRO-3 alone."""

    def pair(a, b, key):
        common = sorted(set(ok_blocks(configs.get(a, {}))) & set(ok_blocks(configs.get(b, {}))))
        if not common:
            return {"block": None, "ratio": None, "met": False, "by_block": {}}
        by = {n: ratio(configs[a][n][key], configs[b][n][key]) for n in common}
        return {"block": common[-1], "ratio": by[common[-1]], "by_block": by}

    out = {
        "sp_activation": pair(TODAY, SP, "activation_bytes"),
        "sp_activation_tiled": pair(TILED, SP_TILED, "activation_bytes"),
        "tiled_loss_region": pair(TODAY, TILED, "loss_region_bytes"),
    }
    for key in ("sp_activation", "sp_activation_tiled"):
        out[key]["goal"] = GOALS["sp_activation"]
    out["tiled_loss_region"]["goal"] = GOALS["tiled_loss_region"]
    sp_tiled = [n for n, (sp, tl, _m) in CONFIGS.items() if sp == 2 and tl and n in searches]
    best = max(sp_tiled, key=lambda n: searches[n]["longest"], default=None)
    base = searches.get(TODAY, {}).get("longest")
    out["longest"] = {
        "config": best,
        "longest": searches[best]["longest"] if best else None,
        "baseline": base,
        "ratio": ratio(searches[best]["longest"], base) if best else None,
        "goal": GOALS["longest"],
    }
    for x in out.values():
        x["met"] = x["ratio"] is not None and x["ratio"] >= x["goal"]
    return out


def ok_blocks(points: dict) -> list[int]:
    return sorted(b for b, p in points.items() if p.get("exit_code") == 0 and "peak_bytes" in p)


def slug(name: str) -> str:
    return "-".join("".join(ch if ch.isalnum() else " " for ch in name.lower()).split())


def measure(size: dict, tmp: Path, cap: float) -> tuple[dict, dict]:
    """Returns the points ({config: {block: point}}) and the searches ({budget label: {config: search}})."""
    """The sweep, then the search per configuration; runs are shared (one per configuration and length)."""
    points: dict[str, dict[int, dict]] = {name: {} for name in size["configs"]}

    def get(name: str, block: int) -> dict:
        if block not in points[name]:
            guess = predicted_peak(points[name], block)
            if guess is not None and guess > cap:
                points[name][block] = {"block": block, "skipped": f"predicted {guess / GiB:.1f} GiB per rank > cap"}
                print(f"  {name} @ {block}: skipped (predicted {guess / GiB:.1f} GiB per rank)", flush=True)
            else:
                p = points[name][block] = measure_point(name, block, size, tmp)
                state = (
                    f"peak {p['peak_bytes'] / GiB:.2f} GiB, activations {p['activation_bytes'] / GiB:.2f}, "
                    f"loss region {p['loss_region_bytes'] / GiB:.2f}"
                    if "peak_bytes" in p
                    else f"FAILED (exit {p['exit_code']})"
                )
                took = "read back" if p["reused"] else f"{p['wall_seconds']:.0f} s"
                print(f"  {name} @ {block}: {state} ({took})", flush=True)
        return points[name][block]

    for name in size["configs"]:
        for block in size["blocks"]:
            get(name, block)
    searches = {}
    for budget in size["budgets"]:
        found = searches[budget_label(budget)] = {}
        for name in size["search"]:
            found[name] = longest(
                lambda n, name=name: trains_within(get(name, n), budget),
                size["blocks"][0],
                size["quantum"],
                size["resolution"],
                size["limit"],
            )
            print(f"  {name}: longest within {budget / GiB:.2f} GiB: {found[name]['longest']}", flush=True)
    return points, searches


def loss_parity(points: dict) -> dict:
    """Tiled against untiled loss at the same SP size and block: the same rows, so the same losses (fp32)."""
    out = {}
    for a, b in ((TODAY, TILED), (SP, SP_TILED)):
        for block in sorted(set(ok_blocks(points.get(a, {}))) & set(ok_blocks(points.get(b, {})))):
            la, lb = points[a][block]["losses"], points[b][block]["losses"]
            out[f"{b} vs {a} @ {block}"] = max(abs(x - y) for x, y in zip(la, lb)) if la and lb else None
    return out


def code_state() -> dict:
    """The commit the runs used and the files that differed from it when the benchmark started."""

    def git(*a):
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout

    changed = [x[3:] for x in git("status", "--porcelain", "--untracked-files=no").splitlines() if x.strip()]
    return {"commit": git("rev-parse", "HEAD").strip(), "uncommitted": changed}


def work_dir(args, size: dict) -> Path | None:
    """The directory the runs go to (--work-dir or a new temporary one), None when it holds runs made with
    other settings (model, steps, loss tile): those must not be read back."""
    tmp = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="zr-bench-longctx-"))
    tmp.mkdir(parents=True, exist_ok=True)
    keep = {k: size[k] for k in ("model", "steps", "loss_tile_tokens")}
    saved = tmp / "settings.json"
    if saved.exists() and json.loads(saved.read_text()) != keep:
        print(f"error: {tmp} holds runs made with other settings: {saved.read_text().strip()}", file=sys.stderr)
        return None
    saved.write_text(json.dumps(keep) + "\n")
    return tmp


def report(size: dict, points: dict, searches: dict, cap: float, code: dict, started: float) -> dict:
    """The report's figures (its .json): settings, goals, searches, loss parity and every point."""
    from transformers import LlamaConfig

    from zero_recipes.modeling.model import count_params_meta

    from ..parallel.benchmark import model_fields

    fields = model_fields(size["model"])
    fields.pop("model_type", None)
    settings = {
        "model": size["model"],
        "vocab_size": fields["vocab_size"],
        "hidden_size": fields["hidden_size"],
        "blocks": size["blocks"],
        "budgets_bytes": size["budgets"],
        "cap_bytes": cap,
        "quantum": size["quantum"],
        "resolution": size["resolution"],
        "steps": size["steps"],
        "runs": sum(1 for pp in points.values() for p in pp.values() if "skipped" not in p),
        "reused": sum(1 for pp in points.values() for p in pp.values() if p.get("reused")),
        "code": code,
        "wall_seconds": time.perf_counter() - started,
    }
    return new_report(
        settings=settings,
        parameters=count_params_meta(LlamaConfig(**fields)),
        configs={n: {"sp": sp, "tiled_loss": tl, "tiled_mlp": tm} for n, (sp, tl, tm) in CONFIGS.items()},
        goals=goals(points, searches[budget_label(size["budgets"][0])]),
        longest_by_budget={label: goals(points, found)["longest"] for label, found in searches.items()},
        searches=searches,
        loss_parity=loss_parity(points),
        points={n: {str(b): p for b, p in sorted(pp.items())} for n, pp in points.items()},
    )


def cmd_longctx(args) -> int:
    if args.render:
        return render(Path(args.render))
    size = dict(SIZES["quick" if args.quick else "full"])
    if args.budget_gib:
        size["budgets"] = [b * GiB for b in args.budget_gib]
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cap = 0.35 * ram  # per rank: two ranks and the launcher stay within the machine's RAM
    started = time.perf_counter()
    code = code_state()
    tmp = work_dir(args, size)
    if tmp is None:
        return 2
    print(f"runs and logs in {tmp}", flush=True)
    points, searches = measure(size, tmp, cap)
    result = report(size, points, searches, cap, code, started)
    name = f"longctx-{result['date']}"
    out = Path(args.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    plot(result, out / f"{name}.png")
    write_report(args.out_dir, name, result, markdown(result, f"{name}.png"))
    for key, x in [*result["goals"].items(), *result["longest_by_budget"].items()]:
        print(f"{key}: {fmt_ratio(x)} (goal {x['goal']}x: {'met' if x['met'] else 'NOT met'})")
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("longctx", help="tiled loss and Ulysses SP=2 on 2 ranks: per-rank peak vs length, longest")
    p.add_argument("--quick", action="store_true", help="tiny blocks, 4 configurations (for tests)")
    p.add_argument(
        "--budget-gib", type=float, nargs="+", help="per-rank budgets, one search each (default: 1.5 1.75; quick 0.3)"
    )
    p.add_argument("--work-dir", help="keep the runs here; a run already complete there is read back, not relaunched")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks"), help="where longctx-DATE.{md,json,png} go")
    p.add_argument("--render", metavar="JSON", help="rewrite the .md and .png of an existing report; runs nothing")
    p.set_defaults(func=cmd_longctx)
