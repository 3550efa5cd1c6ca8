"""DeepSpeed 0.19.8's GPU-only knobs, prepared as fragments and refused where they cannot run.

- ZenFlow (`zero_optimization.zenflow`, ds_configs/zenflow.json): ZeRO-Offload whose important gradient columns
  are updated on the GPU at once and the rest on the CPU, asynchronously.
- SuperOffload (`zero_optimization.offload_optimizer.super_offload`, ds_configs/superoffload.json): ZeRO-3
  offload for Superchips (GH200, GB200).
- DeepCompile (`"compile": {"deepcompile": true}`, ds_configs/deepcompile.json): ZeRO's collectives put into the
  compiled graph by `engine.compile()`, which train.py calls under --torch_compile.
- Activation offload (`compile.offload_activation`, ds_configs/offload_activations.json): DeepCompile's ZeRO-3
  pass that moves saved activations to pinned host memory. DeepSpeed's other activation offload,
  CheckpointHiddenStatesOffload (runtime/activation_checkpointing/offload_activations.py), has no config key:
  it is a Python context manager a training loop wraps around forward and backward, and it offloads nothing on a
  synchronized device such as the CPU (`_ActivationOffloadEngine._should_skip`).

`resolve` is pure (the config alone; the machine is not asked): it fills what these blocks leave to the recipe
and refuses in one line what DeepSpeed 0.19.8 rejects inside `deepspeed.initialize` (on every rank, after the
process group and the model) or accepts and then ignores. `machine_problems` is the machine's side, given the
device name: ds/checks.machine_problems calls it, and train.py refuses its lines before any process group, in
--dry_run too. Each rule cites the DeepSpeed 0.19.8 code it was read from.
"""

from __future__ import annotations

from zero_recipes.errors import ConfigError

AUTO = "auto"
# An optimizer DeepSpeed builds itself: ZenFlow steps DeepSpeed's ZenFlowCPUAdam, which DeepSpeed makes only for
# an `optimizer` block (runtime/engine.py `get_optimizer_configuration`: `ZenFlowCPUAdam if self.zenflow`);
# train.py's own DeepSpeedCPUAdam has no `step(step_id=...)`, which ZenFlowZeroOptimizerSequential calls
# (runtime/zenflow/zenflow_stage_1_and_2.py `zenflow_cpu_optimizer_step`). Its "auto"s are filled as any
# optimizer block's are (intake._resolve_optimizer), with the recipe's AdamW settings.
DEEPSPEED_ADAMW = {"type": "AdamW", "params": {"lr": AUTO, "betas": AUTO, "eps": AUTO, "weight_decay": AUTO}}

# Other tools' spellings of the same switches, moved to DeepSpeed's place: (where found, where it goes).
# axolotl's config option `deepcompile: true` is DeepSpeed's compile.deepcompile.
SPELLINGS = (
    (("deepcompile",), ("compile", "deepcompile")),
    (("zenflow",), ("zero_optimization", "zenflow")),
    (("zero_optimization", "super_offload"), ("zero_optimization", "offload_optimizer", "super_offload")),
)


def resolve(ds: dict, r) -> list[str]:
    """Check and fill the GPU-only blocks of a merged, normalised config (before its batch sizes and optimizer are
    filled). `r`: the intake's Resolver (for the recipe's values, what it set explicitly, adoptions and
    conflicts). Returns notes for --dry_run; raises ConfigError (one line) for what DeepSpeed rejects or ignores."""
    notes = _spellings(ds)
    return notes + _zenflow(ds, r) + _superoffload(ds, r) + _deepcompile(ds, r)


def _stage(ds: dict) -> int:
    z = ds.get("zero_optimization")
    stage = z.get("stage", 0) if isinstance(z, dict) else 0
    return int(stage) if isinstance(stage, (int, float)) and not isinstance(stage, bool) else 0


def _optimizer_offload(ds: dict):
    block = (ds.get("zero_optimization") or {}).get("offload_optimizer")
    device = block.get("device") if isinstance(block, dict) else None
    return None if device in (None, "none") else device


def _spellings(ds: dict) -> list[str]:
    notes = []
    for src, dst in SPELLINGS:
        parent = ds
        for key in src[:-1]:
            parent = parent.get(key) if isinstance(parent, dict) else None
        if not isinstance(parent, dict) or src[-1] not in parent:
            continue
        value = parent.pop(src[-1])
        node = ds
        for key in dst[:-1]:
            node = node.setdefault(key, {})
        if dst[-1] in node and node[dst[-1]] != value:
            raise ConfigError(
                f"the DeepSpeed config sets {'.'.join(dst)} = {node[dst[-1]]!r} and {'.'.join(src)} = {value!r}, "
                "two names for one DeepSpeed setting; keep one"
            )
        node[dst[-1]] = value
        notes.append(f"renamed {'.'.join(src)} to {'.'.join(dst)} (where DeepSpeed reads it)")
    return notes


# ---- ZenFlow ------------------------------------------------------------------------------------------------


def _zenflow(ds: dict, r) -> list[str]:
    z = ds.get("zero_optimization")
    zf = z.get("zenflow") if isinstance(z, dict) else None
    if zf is None:
        return []
    if not isinstance(zf, dict):
        raise ConfigError(f"zero_optimization.zenflow = {zf!r} must be an object like ds_configs/zenflow.json's")
    stage = _stage(ds)
    if stage == 0:  # runtime/engine.py `_configure_zero_optimizer` builds ZenFlow's optimizer; ZeRO-0 has none
        raise ConfigError(
            "zero_optimization.zenflow needs ZeRO-1, 2 or 3; at ZeRO-0 DeepSpeed ignores it. Use "
            "ds_configs/zero2.json with ds_configs/zenflow.json"
        )
    # zenflow_stage_1_and_2.py `_configure_zenflow`: "Zenflow must be used with cpu offload"
    if _optimizer_offload(ds) != "cpu":
        raise ConfigError(
            "zero_optimization.zenflow needs the optimizer offloaded to cpu (DeepSpeed refuses it otherwise: "
            '"Zenflow must be used with cpu offload"); ds_configs/zenflow.json sets offload_optimizer.device "cpu"'
        )
    notes = _zenflow_intervals(ds, zf, r)
    if zf.get("offload") and not z.get("overlap_comm"):  # zenflow_stage_1_and_2.py ZenFlowZeroOptimizer.__init__
        raise ConfigError(
            "zero_optimization.zenflow.offload = true needs zero_optimization.overlap_comm = true (DeepSpeed asserts "
            '"offload selective optimizer should be used with overlap_comm"); set it, or offload false'
        )
    opt = ds.get("optimizer")
    if opt is None:
        ds["optimizer"] = {"type": DEEPSPEED_ADAMW["type"], "params": dict(DEEPSPEED_ADAMW["params"])}
        notes.append(
            "optimizer: DeepSpeed builds its ZenFlowCPUAdam (an AdamW block with the recipe's settings), which "
            "ZenFlow steps; train.py's own DeepSpeedCPUAdam cannot be"
        )
    elif not isinstance(opt, dict) or str(opt.get("type", "")).lower() not in ("adam", "adamw"):
        name = opt.get("type") if isinstance(opt, dict) else opt
        raise ConfigError(
            f"optimizer.type = {name!r} with zero_optimization.zenflow: ZenFlow runs DeepSpeed's ZenFlowCPUAdam only "
            '(runtime/engine.py get_optimizer_configuration, for Adam and AdamW); use "AdamW", or drop '
            "ds_configs/zenflow.json"
        )
    return notes


def _zenflow_intervals(ds: dict, zf: dict, r) -> list[str]:
    """ZenFlow's update_interval replaces the run's gradient accumulation: runtime/zenflow/engine.py
    `configure_zenflow` ends with `engine._config.gradient_accumulation_steps = engine.update_interval` (0 for
    "auto", whose boundaries DeepSpeed then picks as it trains). train.py feeds gradient_accumulation_steps
    micro-batches per step and counts tokens, steps and the schedule by it, so the two must be one number."""
    interval = zf.get("update_interval", AUTO)
    if interval == AUTO or not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
        raise ConfigError(
            f"zero_optimization.zenflow.update_interval = {interval!r}: DeepSpeed makes ZenFlow's update interval the "
            "run's gradient accumulation (\"auto\" sets it to 0 and picks each step's end as it trains), which "
            "train.py's steps, batch and schedule cannot follow; give it a whole number, which becomes "
            "gradient_accumulation_steps (ds_configs/zenflow.json: 4)"
        )
    notes = []
    gas = ds.get("gradient_accumulation_steps", AUTO)
    recipe = r.cfg.gradient_accumulation_steps
    if gas == AUTO and "gradient_accumulation_steps" in r.explicit and recipe != interval:
        raise ConfigError(
            f"zero_optimization.zenflow.update_interval = {interval} with gradient_accumulation_steps {recipe}: ZenFlow "
            f"overwrites the accumulation with its update interval (runtime/zenflow/engine.py configure_zenflow); "
            f"set update_interval to {recipe}, or --gradient_accumulation_steps {interval}"
        )
    if gas == AUTO:
        ds["gradient_accumulation_steps"] = interval  # the intake adopts it into the recipe (_resolve_batch)
        notes.append(
            f"gradient_accumulation_steps={interval}: ZenFlow's update_interval, which DeepSpeed makes the accumulation"
        )
    elif gas != interval:
        raise ConfigError(
            f"gradient_accumulation_steps = {gas!r} with zero_optimization.zenflow.update_interval = {interval}: ZenFlow "
            f"overwrites the accumulation with its update interval (runtime/zenflow/engine.py configure_zenflow); set "
            f'both to one number, or gradient_accumulation_steps "auto"'
        )
    # zenflow_stage_1_and_2.py `_configure_zenflow` (engine_stage3.py alike): "auto" and "epoch" re-select once per
    # epoch of the engine's dataloader, which train.py does not hand DeepSpeed (it builds its own batches):
    # steps_per_epoch stays None, select_interval becomes 0 and the columns are selected once, never again.
    strategy, select = zf.get("select_strategy", AUTO), zf.get("select_interval", AUTO)
    if strategy in (AUTO, "epoch"):
        raise ConfigError(
            f'zero_optimization.zenflow.select_strategy = "{strategy}" re-selects the important columns once an epoch '
            "of DeepSpeed's own dataloader, which train.py does not use: ZenFlow would select them once and never "
            'again; set "select_strategy": "step" and "select_interval" N (ds_configs/zenflow.json)'
        )
    if not isinstance(select, int) or isinstance(select, bool) or select < interval:
        raise ConfigError(
            f'zero_optimization.zenflow.select_interval = {select!r} with select_strategy "step": DeepSpeed needs a whole '
            f"number of steps at least update_interval ({interval}); set one"
        )
    return notes


# ---- SuperOffload -------------------------------------------------------------------------------------------


def _superoffload(ds: dict, r) -> list[str]:
    block = (ds.get("zero_optimization") or {}).get("offload_optimizer")
    if not isinstance(block, dict) or not block.get("super_offload"):
        return []
    stage = _stage(ds)
    if stage != 3:  # runtime/engine.py `_configure_zero_optimizer` reads super_offload in its ZeRO-3 branch only
        raise ConfigError(
            f"offload_optimizer.super_offload needs ZeRO-3; at ZeRO-{stage} DeepSpeed ignores it and runs plain "
            "ZeRO-Offload. Use ds_configs/zero3.json with ds_configs/superoffload.json"
        )
    if block.get("device") != "cpu":
        raise ConfigError(
            "offload_optimizer.super_offload needs the optimizer offloaded to cpu (its CPU Adam runs there); "
            'ds_configs/superoffload.json sets device "cpu"'
        )
    # superoffload_stage3.py `partition_grads` starts a sub-group's CPU step during the backward only
    # `if ... not self.clip_grad`; with clipping every CPU step waits for the whole backward (`step`)
    clip = ds.get("gradient_clipping", AUTO)
    clip = r.cfg.max_grad_norm if clip == AUTO else clip
    if isinstance(clip, (int, float)) and clip:
        return [
            f"SuperOffload with gradient_clipping {clip:g}: DeepSpeed 0.19.8 starts its CPU optimizer steps during "
            "the backward only without clipping, so each waits for the backward as in ZeRO-Offload; --max_grad_norm 0 "
            "gives the overlap its blog measures"
        ]
    return []


# ---- DeepCompile --------------------------------------------------------------------------------------------


def _deepcompile(ds: dict, r) -> list[str]:
    block = ds.get("compile")
    if not isinstance(block, dict):
        return []
    stage, deepcompile = _stage(ds), block.get("deepcompile") is True
    if block.get("offload_activation") and not deepcompile:  # compile/config.py: a DeepCompile field
        raise ConfigError(
            "compile.offload_activation is a DeepCompile pass; without compile.deepcompile DeepSpeed ignores it. Use "
            "ds_configs/zero3.json with ds_configs/offload_activations.json"
        )
    if not deepcompile:
        return []
    if stage == 0:  # runtime/engine.py `get_deepcompile_backend`: "Falling back to the torch compiler", at INFO
        raise ConfigError(
            "compile.deepcompile needs ZeRO-1, 2 or 3; at ZeRO-0 DeepSpeed falls back to plain torch.compile. Use "
            "ds_configs/zero3.json with ds_configs/deepcompile.json"
        )
    if block.get("offload_activation"):
        _offload_activation(ds, block, stage)
    if block.get("offload_opt_states") and _optimizer_offload(ds):  # compile/init_z3.py `init_z3` raises
        raise ConfigError(
            "compile.offload_opt_states with zero_optimization.offload_optimizer: both manage the optimizer states "
            "and DeepSpeed refuses the pair; keep one"
        )
    notes = []
    if not r.cfg.torch_compile:  # DeepCompile runs inside engine.compile(), which train.py calls under --torch_compile
        if "torch_compile" in r.explicit:
            r.conflicts.append("compile.deepcompile=True but torch_compile=False")
        else:
            r.adopt("torch_compile", True, "compile.deepcompile")
    return notes


def _offload_activation(ds: dict, block: dict, stage: int) -> None:
    if stage != 3:  # compile/init_z1_and_2.py never reads it; compile/init_z3.py schedules the pass
        raise ConfigError(
            f"compile.offload_activation is DeepCompile's ZeRO-3 pass; at ZeRO-{stage} DeepSpeed ignores it. Use "
            "ds_configs/zero3.json with ds_configs/offload_activations.json"
        )
    z = ds.get("zero_optimization") or {}
    both_cpu = _optimizer_offload(ds) == "cpu" and (z.get("offload_param") or {}).get("device") == "cpu"
    other = [k for k in ("offload_parameters", "offload_opt_states") if block.get(k)]
    if both_cpu and not other:  # runtime/engine.py get_deepcompile_backend turns offload_parameters on for these
        other = ["offload_parameters (DeepSpeed sets it when offload_param and offload_optimizer are both on cpu)"]
    if other:  # compile/init_z3.py `init_z3`: "cannot be combined with offload_parameters or offload_opt_states"
        raise ConfigError(
            f"compile.offload_activation with compile.{other[0]}: DeepSpeed refuses two DeepCompile offload targets in "
            "one run; keep one (drop ds_configs/offload_all.json, or ds_configs/offload_activations.json)"
        )


def compiler_line(ds: dict, deepcompile_active: bool, backend: str) -> str:
    """Which compiler --torch_compile ran, for the launch log: DeepSpeed's engine.compile() runs DeepCompile when the
    config asks for it (and it could start), plain torch.compile otherwise."""
    if deepcompile_active:
        block = ds.get("compile") or {}
        passes = "activation offload" if block.get("offload_activation") else "ZeRO collectives in the graph"
        return (
            f"compile: compiled with DeepCompile ({passes}, ZeRO-{_stage(ds)}, {backend}) via DeepSpeed "
            "engine.compile(); the first steps include compilation and DeepCompile's profiling"
        )
    return (
        f"compile: compiled with torch.compile ({backend}) via DeepSpeed engine.compile(); the first step includes "
        "compilation"
    )


# ---- this machine -------------------------------------------------------------------------------------------


def machine_problems(ds: dict, device: str, fused_lion: bool) -> list[str]:
    """What a machine whose accelerator is `device` (DeepSpeed's device_name(): 'cuda', 'cpu', ...) cannot run of
    these knobs; `fused_lion`: whether it has DeepSpeed's FusedLion op. One line each, naming the alternative."""
    here = f"on this {device}" if device != "cpu" else "on this CPU"
    z = ds.get("zero_optimization") or {}
    problems = []
    if device != "cuda" and isinstance(z.get("zenflow"), dict):
        # runtime/zenflow/engine_stage3.py allocates its buffers on device='cuda'; DeepSpeed's own ZenFlow tests
        # (tests/unit/runtime/zenflow/test_zf.py run_training_distributed) return at once on a CPU
        problems.append(
            "ZenFlow (zero_optimization.zenflow) needs CUDA GPUs (DeepSpeed 0.19.8 runs it only there: its ZeRO-3 path "
            f"allocates on 'cuda' and its tests skip the CPU); {here} use ds_configs/offload_optimizer.json "
            "(ZeRO-Offload) without ds_configs/zenflow.json"
        )
    if device != "cuda" and (z.get("offload_optimizer") or {}).get("super_offload"):
        # runtime/superoffload/superoffload_stage3.py `_validate_superoffload_accelerator` asserts device 'cuda'
        problems.append(
            "SuperOffload (offload_optimizer.super_offload) needs NVIDIA CUDA GPUs (DeepSpeed 0.19.8 asserts it); "
            f"{here} use ds_configs/offload_optimizer.json (ZeRO-Offload) without ds_configs/superoffload.json"
        )
    block = ds.get("compile") or {}
    if device != "cuda" and block.get("deepcompile") is True:
        # compile/util.py `is_deepcompile_supported`: torch >= 2.6 and device 'cuda'; its op (csrc/compile/
        # deepcompile.cpp) runs its collectives on NCCL
        what, fragment, fix = (
            ("DeepCompile's activation offload (compile.offload_activation)", "offload_activations.json",
             "--gradient_checkpointing true to save activation memory")
            if block.get("offload_activation")
            else ("DeepCompile (compile.deepcompile)", "deepcompile.json", "--torch_compile true (plain torch.compile)")
        )  # fmt: skip
        problems.append(
            f"{what} needs CUDA GPUs (DeepSpeed 0.19.8 enables DeepCompile only on cuda, and its op talks NCCL); "
            f"{here} drop ds_configs/{fragment} (or compile.deepcompile) and use {fix}"
        )
    opt = ds.get("optimizer")
    if (
        isinstance(opt, dict)
        and str(opt.get("type", "")).lower() == "lion"
        and not fused_lion
        and not _optimizer_offload(ds)
    ):
        # runtime/engine.py `_configure_basic_optimizer`: Lion is DeepSpeedCPULion under optimizer offload, else
        # FusedLion, whose op this accelerator lacks (the CPU accelerator maps FusedLionBuilder to its
        # NotImplementedBuilder)
        problems.append(
            f"the Lion optimizer {here} needs optimizer offload: DeepSpeed 0.19.8 has no FusedLion here, only "
            "DeepSpeedCPULion for offload_optimizer; add ds_configs/offload_optimizer.json (ZeRO-1/2/3), or use AdamW"
        )
    return problems
