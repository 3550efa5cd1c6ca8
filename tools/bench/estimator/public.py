"""The memory estimate against published GPU measurements (benchmarks/estimator-gpu-public.md).

The cases, each with its source, setup and measured figure, are data: benchmarks/estimator-gpu-public.json. For
each, the estimate is made as tools/estimate_memory.py makes it (GPU accounting, the shipped ds_configs for the
stated ZeRO stage, offload and precision, "auto" buckets as the HF Trainer fills them), then compared:

- `max_memory_allocated` (DeepSpeed's Max_MA): the goal band is +15 % / -5 %;
- `max_memory_reserved` / `nvidia-smi`: they add the allocator's cache and the CUDA context, so the estimate
  must not exceed them; the error is shown, not scored;
- `oom`: the estimator must not say "fits" (its verdict is "tight" or "no", memory/estimate.py `fit_verdict`);
  `fits`: it must not say "no".

    python tools/benchmark.py estimator-public        # regenerates the table from the data file
"""

from __future__ import annotations

import json
from pathlib import Path

from zero_recipes.memory.estimate import fit_verdict

from ..common import REPO, environment

DATA = REPO / "benchmarks" / "estimator-gpu-public.json"
BAND = {"over": 0.15, "under": 0.05}
ALLOCATED = ("max_memory_allocated",)
UPPER_BOUNDS = ("max_memory_reserved", "nvidia-smi")
# Bytes per stepped element of an optimizer's temporaries (memory/states.py `Setup.adam_temporaries`): the HF
# Trainer's default `adamw_torch` is torch AdamW without fused=True, stepping one tensor at a time (8) or as a
# foreach list (4); train.py uses fused AdamW on a GPU, DeepSpeed-Chat DeepSpeed's FusedAdam (0)
ADAM_TEMPORARIES = {"adamw_torch (single-tensor)": 8, "adamw_torch (foreach)": 4, "fused": 0}


VERDICT = {"yes": "fits", "tight": "tight", "no": "does not fit"}


def ds_files(case: dict) -> list[str]:
    """The shipped fragments for the case's stage, offload and precision."""
    files = [f"ds_configs/zero{case['zero_stage']}.json"]
    if case.get("offload_param"):
        files.append("ds_configs/offload_all.json")
    elif case.get("offload_optimizer"):
        files.append("ds_configs/offload_optimizer.json")
    files += {"bf16": ["ds_configs/bf16.json"], "fp16": ["ds_configs/fp16.json"], "fp32": []}[case["precision"]]
    return files


def estimate_case(case: dict):
    """tools/estimate_memory.py's estimate for one published setup."""
    from transformers import AutoConfig

    from zero_recipes.config.cli import parse_args
    from zero_recipes.ds import intake as ds_config
    from zero_recipes.memory import Launch, estimate
    from zero_recipes.modeling.model import hidden_size

    fields = dict(case["model_config"])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    world = case["num_gpus"] * case.get("num_nodes", 1)
    argv = ["--deepspeed", *ds_files(case), "--per_device_train_batch_size", str(case["micro_batch_size"])]
    cfg, explicit = parse_args(argv)
    # a case whose DeepSpeed JSON differs from ds_configs/ where it matters (bucket sizes left at DeepSpeed's
    # defaults, say) states those keys; they merge over the shipped files
    raw = ds_config.deep_merge(ds_config.load_fragments(cfg.deepspeed), case.get("ds_overrides", {}))
    resolved = ds_config.resolve(raw, cfg, explicit, world, hidden_size(config))
    ds = ds_config.with_steps(resolved.ds, resolved.cfg, 1000)
    launch = Launch(
        case["num_gpus"],
        case.get("num_nodes", 1),
        case["micro_batch_size"],
        case["seq_len"],
        bool(case.get("gradient_checkpointing")),
        case.get("attn_implementation") or "sdpa",
        optimizer_temporaries=ADAM_TEMPORARIES[case.get("optimizer") or "fused"],
        tiled_loss=False,  # these projects compute the whole vocabulary's logits at once; train.py tiles them
        preloaded=preloaded_of(case),
    )
    if case.get("liger"):  # as tools/estimate_memory.py --liger true; "loss": the fused cross-entropy alone
        from zero_recipes.memory.stack import use_liger

        use_liger(launch, config, kernels=case["liger"] is True)
    lora = lora_of(case)
    return estimate(config, ds, launch, gpu_memory=int(case["gpu_memory_gib"] * 2**30), lora=lora,
                    load_in_4bit=bool(case.get("load_in_4bit")))  # fmt: skip


def lora_of(case: dict):
    """A case's `"lora"` block as the peft LoraConfig train.py would build (r, alpha, dropout, target_modules,
    modules_to_save); None for full fine-tuning."""
    block = case.get("lora")
    if not block:
        return None
    from peft import LoraConfig

    targets = block.get("target_modules", "all-linear")
    return LoraConfig(r=block["r"], lora_alpha=block.get("alpha", block["r"]), lora_dropout=block.get("dropout", 0.0),
                      target_modules=targets, modules_to_save=block.get("modules_to_save"), task_type="CAUSAL_LM")  # fmt: skip


def preloaded_of(case: dict):
    """A case whose script builds the model before DeepSpeed (`"zero_init": false`), with the DeepSpeed it ran."""
    from zero_recipes.memory.preloaded import Preloaded, version_tuple

    if case.get("zero_init", True):
        return None
    return Preloaded(version_tuple(case["deepspeed_version"]), load_bytes=case.get("load_bytes", 4))


def score(case: dict, estimate_bytes: int) -> dict:
    """The estimate's error against the measurement, and whether it meets the goal for that kind of figure."""
    kind = case["measured"]["kind"]
    est = estimate_bytes / 2**30
    out = {"estimate_gib": round(est, 2), "error": None}
    gib = case["measured"].get("gib")
    if kind in ALLOCATED + UPPER_BOUNDS:
        out["error"] = est / gib - 1
    if kind in ALLOCATED:
        out["ok"] = -BAND["under"] <= out["error"] <= BAND["over"]
    elif kind in UPPER_BOUNDS:
        out["ok"] = est <= gib
    elif kind in ("oom", "fits"):
        out["verdict"] = fit_verdict(estimate_bytes, int(case["gpu_memory_gib"] * 2**30), case["zero_stage"])
        if out["verdict"] == "yes" and case.get("uncertain"):
            # the source leaves a setting open that moves the figure (the length that failed, say): a
            # verdict on the settings assumed is at best "tight", with the reason shown
            out["verdict"] = "tight"
            out["uncertain"] = case["uncertain"]
        out["ok"] = out["verdict"] != ("yes" if kind == "oom" else "no")
    else:
        raise ValueError(f"{case['id']}: unknown measured.kind {kind!r}")
    return out


def setup_text(case: dict) -> str:
    offload = "+".join(k.split("_")[1] for k in ("offload_optimizer", "offload_param") if case.get(k)) or "none"
    gc = {True: "GC", False: "no GC", None: "GC ?"}[case.get("gradient_checkpointing")]
    extra = ""
    if case.get("lora"):
        extra += f"{'QLoRA' if case.get('load_in_4bit') else 'LoRA'} r {case['lora']['r']}, "
    if case.get("liger"):
        extra += "Liger, " if case["liger"] is True else "Liger's loss, "
    if case.get("zero_init") is False:
        extra += f"model built first (DeepSpeed {case['deepspeed_version']}), "
    return extra + (
        f"{case['num_gpus'] * case.get('num_nodes', 1)}x {case['gpu']}, ZeRO-{case['zero_stage']}, offload {offload}, "
        f"{case['precision']}, mb {case['micro_batch_size']} x {case['seq_len']}, {gc}, "
        f"attn {case.get('attn_implementation') or '? (sdpa assumed)'}, optimizer {case.get('optimizer') or '? (fused)'}"
    )


def measured_text(case: dict) -> str:
    m = case["measured"]
    if m["kind"] in ("oom", "fits"):
        return f"{m['kind'].upper()} on {case['gpu_memory_gib']} GiB"
    return f"{m['gib']} GiB {m['kind']}" + (f" ({m['phase']})" if m.get("phase") else "")


def render(cases: list[dict], results: list[dict], env: dict) -> str:
    lines = [
        "# Memory estimate vs published GPU measurements",
        "",
        "Regenerated by `python tools/benchmark.py estimator-public` from "
        "[estimator-gpu-public.json](estimator-gpu-public.json) (the cases and their sources). Each estimate is "
        "`tools/estimate_memory.py`'s peak per GPU for the stated setup, with the shipped `ds_configs/` for its "
        'ZeRO stage, offload and precision (bucket sizes as the HF Trainer fills `"auto"`). Goal: within '
        f"+{BAND['over']:.0%} / -{BAND['under']:.0%} of `max_memory_allocated`; never above an `nvidia-smi` or "
        "`max_memory_reserved` figure (those include the allocator cache and the CUDA context); never the verdict "
        '"fits" where the source ran out of memory, never "does not fit" where it ran. The verdict is "tight" when '
        "the allocated peak fits the card but not with 1 GiB for the CUDA context and NCCL plus the "
        'allocator\'s fragmentation (5 % of the peak, 20 % under ZeRO-3; `fit_verdict` in zero_recipes/memory/estimate.py), and at best "tight" where the '
        "source leaves open a setting that moves the figure (the reason is shown). A case whose script builds the "
        "model before DeepSpeed is estimated with `--zero_init false` and the DeepSpeed it ran (memory/preloaded.py).",
        "",
        "| case | source | model | setup | measured | estimate | error | goal met |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for case, r in zip(cases, results):
        error = f"verdict: {VERDICT[r['verdict']]}" if "verdict" in r else f"{r['error']:+.1%}"
        if r.get("uncertain"):
            error += f" (settings uncertain: {r['uncertain']})"
        lines.append(
            f"| {case['id']} | [{case['source']['kind']}]({case['source']['url'].split()[0]}) | {case['model']} | "
            f"{setup_text(case)} | {measured_text(case)} | {r['estimate_gib']:.2f} GiB | {error} | "
            f"{'yes' if r['ok'] else '**no**'} |"
        )
    scored = [r["error"] for c, r in zip(cases, results) if c["measured"]["kind"] in ALLOCATED]
    lines += ["", f"{sum(r['ok'] for r in results)} of {len(results)} cases meet the goal."]
    if scored:
        over, under = max(scored), min(scored)
        lines.append(
            f"On `max_memory_allocated` figures ({len(scored)} case(s)): worst over-estimate "
            f"{f'{over:+.1%}' if over > 0 else 'none'}, worst under-estimate {f'{under:+.1%}' if under < 0 else 'none'}."
        )
    missed = [(c, r) for c, r in zip(cases, results) if not r["ok"]]
    if missed:
        lines += ["", "## Where the goal is missed", ""]
        lines += [f"- **{c['id']}**: {c.get('explanation') or 'not explained yet.'}" for c, _ in missed]
    lines += ["", "## Assumptions, per case", ""]
    lines += [f"- **{c['id']}** ({c.get('confidence', '?')}): {c.get('assumptions') or 'none stated'}" for c in cases]
    v = env["versions"]
    lines += ["", f"Estimated with DeepSpeed {v['deepspeed']}, transformers {v['transformers']}, torch {v['torch']}."]
    return "\n".join(lines) + "\n"


def cmd_estimator_public(args) -> int:
    data = json.loads(Path(args.data).read_text())
    cases = data["cases"]
    results = []
    for case in cases:
        e = estimate_case(case)
        results.append(score(case, e.per_gpu["peak_bytes"]))
        print(f"{case['id']}: {measured_text(case)} vs estimate {results[-1]['estimate_gib']} GiB", flush=True)
    out = Path(args.out)
    out.write_text(render(cases, results, environment()))
    print(f"wrote {out}")
    return 0


def add_parsers(sub) -> None:
    e = sub.add_parser("estimator-public", help="memory estimate vs published GPU measurements")
    e.add_argument("--data", default=str(DATA), help="the cases (JSON)")
    e.add_argument("--out", default=str(DATA.with_suffix(".md")), help="the report (Markdown)")
    e.set_defaults(func=cmd_estimator_public)
