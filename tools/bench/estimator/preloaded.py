"""The gathered weights a model built before DeepSpeed keeps under ZeRO-3 (zero_recipes/memory/preloaded.py),
measured on the CPU: real ZeRO-3 on 2 ranks, a model passed to deepspeed.initialize already built, one
forward+backward read by the allocator probe with DeepSpeed 0.19.8's linear wrapper and with torch's own linear
put back (DeepSpeed before 0.19.4). The difference is the retained term; the estimate's is beside it.

    python tools/benchmark.py estimator-preloaded            # 4 settings, a launch each; --quick: 1 setting
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from ..common import REPO, footer, free_port, new_report, run_checked, write_report

# (checkpointing, the live cap and reuse distance in elements): nothing kept gathered, or about a sixth of the
# model kept, as 1e9 of an 8B model is
SETTINGS = [(False, 0), (False, 5_000_000), (True, 0), (True, 5_000_000)]
# (model, sequence length): the estimator benchmark's model B at 512 tokens; --quick's one setting on its model A
# (~7M parameters) at 128 tokens, where the kept bytes equal the estimate's term to the byte as on B (the term is
# the linear weights' bytes, whatever the size), in a launch 14 s and 16 CPU-s shorter on 2 busy cores
RUN, QUICK_RUN = ("B", 512), ("A", 128)


def measure(checkpointing: bool, live: int, tmp: Path, run: tuple[str, int] = RUN) -> dict:
    """One 2-rank launch: the peak with DeepSpeed's linear wrapper, then with torch's linear put back."""
    out = tmp / f"{int(checkpointing)}-{live}.json"
    port = free_port(os.environ.get("ZERO_RECIPES_TEST_PORT_RANGE"))  # the suite's range for this worker, if any
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(port), "--module", "bench.estimator.preloaded_rank",
           "--live", str(live), "--out", str(out), "--model", run[0], "--seq", str(run[1])]  # fmt: skip
    run_checked(cmd + (["--checkpointing"] if checkpointing else []), None, 1200, " ".join(cmd))
    return json.loads(out.read_text())


def estimated_extra(checkpointing: bool, live: int, run: tuple[str, int] = RUN) -> int:
    """The estimate's forward/backward with the model built before DeepSpeed 0.14 less built under zero.Init."""
    from transformers import AutoConfig

    from zero_recipes.memory import Launch, estimate
    from zero_recipes.memory.preloaded import Preloaded

    from .preloaded_rank import MICRO, ds_config
    from .report import MODELS

    config = AutoConfig.for_model("llama", **MODELS[run[0]])
    ds = ds_config(live)

    def fwd_bwd(pre):
        launch = Launch(2, 1, MICRO, run[1], checkpointing, tiled_loss=False, preloaded=pre)
        return estimate(config, ds, launch).phases["forward_backward"]["device_bytes"]

    return fwd_bwd(Preloaded((0, 14, 2))) - fwd_bwd(None)


def markdown(report: dict) -> str:
    mb = lambda b: f"{b / 1e6:,.1f}"  # noqa: E731
    lines = [f"# A model built before DeepSpeed: the gathered weights torch's linear keeps, {report['date']}", "",
             f"Command: `{report['command']}`", "", __doc__.split("\n\n")[0].replace("\n", " "), "",
             "| checkpointing | live cap (elements) | wrapped MB | torch's linear MB | kept MB | estimated MB |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in report["rows"]:
        lines.append(f"| {'on' if r['checkpointing'] else 'off'} | {r['live']:,} | {mb(r['wrapped'])} | "
                     f"{mb(r['torch'])} | {mb(r['torch'] - r['wrapped'])} | {mb(r['estimated'])} |")  # fmt: skip
    m = report["rows"][0]
    lines += ["", f"The model (the estimator benchmark's {m['model']}, {m['seq']} tokens a row): {m['params']:,} parameters, {m['linear_params']:,} of them in linear weights "
              f"({m['head_params']:,} the head); bf16, so 2 bytes each.", "",
              "With nothing kept gathered (live cap 0), torch's linear keeps 2 B of every linear weight without "
              "checkpointing, and of the head alone with it. With a cap, ZeRO-3 keeps its last layers gathered into "
              "the backward either way, so less is added; the estimate subtracts its own count of what the cap holds "
              "(states_gpu.py `gathered`), which is below what DeepSpeed keeps, since it fetches a whole parameter "
              "past the cap (here the 8.2M-element head past a 5M cap), so the estimate is over there.", ""]  # fmt: skip
    return "\n".join(lines + footer(report)) + "\n"


def cmd_preloaded(args) -> int:
    settings, run = (SETTINGS[:1], QUICK_RUN) if args.quick else (SETTINGS, RUN)
    rows = []
    with tempfile.TemporaryDirectory(prefix="zr-preloaded-") as tmp:
        for gc, live in settings:
            rows.append({"checkpointing": gc, "live": live, "model": run[0], "seq": run[1],
                         "estimated": estimated_extra(gc, live, run), **measure(gc, live, Path(tmp), run)})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    report = new_report(rows=rows)
    name = f"estimator-preloaded-{report['date']}"
    write_report(args.out_dir, name, report, markdown(report))
    return 0


def add_parsers(sub) -> None:
    e = sub.add_parser("estimator-preloaded", help="ZeRO-3's gathered weights kept for a model built first (CPU)")
    e.add_argument("--quick", action="store_true", help="one setting (for tests)")
    e.add_argument("--out-dir", default=str(REPO / "benchmarks"))
    e.set_defaults(func=cmd_preloaded)
