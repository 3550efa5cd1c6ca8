"""Train a Hugging Face causal LM with DeepSpeed ZeRO. One run, top to bottom:
setup (plan -> distributed -> data -> model) -> resume -> fit -> export.

    # the embedded default (tiny Llama, offline tokenizer and corpus), CPU or GPU
    deepspeed train.py --deepspeed ds_configs/zero3.json

    # a recipe, with overrides; fragments merge left to right
    deepspeed --num_gpus 8 train.py --recipe recipes/tiny-llama.yaml \
        --deepspeed ds_configs/zero3.json ds_configs/offload_all.json ds_configs/bf16.json --learning_rate 1e-4

    # torchrun works the same; so does srun (tools/slurm) and deepspeed --hostfile for many nodes
    torchrun --nproc_per_node 2 train.py --deepspeed ds_configs/zero2.json

    # check a config without training
    python train.py --recipe recipes/tiny-llama.yaml --deepspeed ds_configs/zero3.json --dry_run

`python train.py --help` lists every option; recipes use the same names.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from dataclasses import dataclass

# torch._dynamo and transformers' model code must be imported before any zero.Init (measured: importing
# them inside it breaks); model.causal_lm_class() imports the model code itself.
import torch
import torch._dynamo  # noqa: F401

from zero_recipes import data
from zero_recipes.checkpointing import checkpoint, resume as resuming, run_dir, storage
from zero_recipes.checkpointing.export import partitioned, verify_export
from zero_recipes.config.cli import help_text
from zero_recipes.distributed import deepspeed_logs, launcher_env, process_group
from zero_recipes.distributed.lost_peer import lost_peer
from zero_recipes.distributed.preemption import StopRequest
from zero_recipes.ds import checks as ds_checks, gpu_only, jit_ops
from zero_recipes.errors import ConfigError
from zero_recipes.evaluation import in_training
from zero_recipes.modeling import lm_loss, model as modeling, moe, packed_attention
from zero_recipes.parallel.mesh import picture as mesh_picture
from zero_recipes.plan import RunPlan
from zero_recipes.training import flops, loop, metrics_log
from zero_recipes.training.engine import make_engine, muon_split

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# DeepSpeed still calls the c10d collectives torch renamed; the warning is theirs, repeated every step.
warnings.filterwarnings("ignore", message=r".*(all_gather_into_tensor|reduce_scatter_tensor).*deprecated")


@dataclass(frozen=True)
class CheckedInputs:
    """What check_inputs found before any process group starts (and what --dry_run reports of it)."""

    report_to: list  # the trackers metrics.jsonl also reports to (metrics_log.report_targets)
    resume_request: str | None  # run_dir.check_output_dir's decision: "auto", a checkpoint path, or None
    live_tasks: list  # the lm-eval tasks to run at each evaluation (in_training.check)
    sampled: list  # a line per dataset sampled (under --dry_run)


@dataclass(frozen=True)
class RunData:
    """The tokenizer and the data as this rank reads them."""

    tokenizer: object
    prepared: object  # data.Prepared, or a stream's: eval rows, pad id, whether labels are SFT-masked
    order: object  # data.BatchOrder over this rank's rows, or the stream itself (next_batch, per_rank)


def main(argv: list[str], instrument=None) -> int:
    """One run. The modes (parallel axes, adapter, runner) are picked in the plan and the set-up; nothing
    below asks which one this run has. `instrument`: a benchmark's hook, given the assembled loop.Loop before
    it runs, returning the Loop to run (tools/bench/runners/profiled_train.py wraps its runner and checkpointer)."""
    # ---- setup: the plan is resolved and the inputs checked before any process group starts ----------
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    plan = RunPlan.from_args(argv)
    rank = launcher_env.rank_info().rank
    log = print if rank == 0 else (lambda *a, **k: None)
    if plan.cfg.dry_run:
        return dry_run(plan, log)
    inputs = check_before_start(plan)
    stop = start_processes(plan, log)
    run_data = load_data(plan, rank, log)
    # the step count, known once the data is, completes the config that zero.Init reads
    plan = plan.complete(plan.steps_to_train(run_data.order.per_rank), run_data.tokenizer)
    run_dir.start_run(plan, rank)
    warn_if_too_big(plan, rank, log)
    model = build_model(plan, rank, log)

    # ---- resume --------------------------------------------------------------------------------------
    resume = resuming.plan_resume(inputs.resume_request, plan, rank, log)
    engine = start_engine(plan, model, resume.engine_config(plan.ds) if resume else plan.ds, log)
    step = resuming.restore(engine, resume, run_data.order, plan, rank, log) if resume else 0

    # ---- fit -----------------------------------------------------------------------------------------
    run = assemble_loop(plan, engine, run_data, inputs, stop, rank, log, resumed_at=step if resume else None)
    # (a preference run's reference log-probs are read, or computed once by this engine, as its runner is made)
    outcome = loop.fit(instrument(run) if instrument else run, step)
    if not outcome.finished:
        run.log_file.close()
        return outcome.exit_code

    # ---- export: output_dir itself becomes a complete HF model (or PEFT adapter) directory -------------
    with run_dir.recording(plan.output_dir, rank):  # what the export writes is this run's (run_files.json)
        plan.adapter.export(engine, run_data.tokenizer, plan.output_dir, rank, DTYPES[plan.precision], log)
    if plan.cfg.verify_export:
        diff = check_export(engine, run.runner, plan, run_data, rank)
        if rank == 0:
            log(f"export check: max |logits(reloaded) - logits(engine)| = {diff:.3g}")
            run.log_file.write({"step": outcome.step, "export_max_abs_logit_diff": diff})
    run.log_file.close()
    return 0


def check_before_start(plan: RunPlan) -> CheckedInputs:
    """The checks that need the machine, then the inputs: refused here, before any rank waits on another."""
    if problems := ds_checks.machine_problems(plan.ds, plan.cfg.tf32):  # kernels, NVMe
        raise ConfigError("; ".join(problems))
    if plan.cfg.tf32 is not None:  # what the HF Trainer's --tf32 sets (transformers' enable_tf32, torch >= 2.9)
        torch.backends.fp32_precision = "tf32" if plan.cfg.tf32 else "ieee"
    return check_inputs(plan)


def start_processes(plan: RunPlan, log) -> StopRequest:
    """The DeepSpeed ops, then the process group and the axes' groups. Returns the preemption signal's catcher."""
    jit_ops.prepare(plan.ds)  # after the refusals, before any rank loads (and could wait forever on) a DeepSpeed op
    threads = launcher_env.set_threads(launcher_env.rank_info().local_world_size)
    process_group.init(plan.cfg.ddp_timeout)
    deepspeed_logs.quiet_deepspeed()
    stop = StopRequest()
    for note in plan.notes:
        log(f"config: {note}")
    log(f"distributed: {plan.mesh.describe()}, backend {torch.distributed.get_backend()}, {threads} thread(s) per rank")
    plan.parallelism.before_build(plan.cfg, plan.model_config, log)  # collective: Ulysses' attention, its groups
    return stop


def load_data(plan: RunPlan, rank: int, log) -> RunData:
    """The tokenizer and the data, built by rank 0 while the others wait, then read by everyone. The rows are
    sharded by data-parallel rank: the ranks of a tensor- or sequence-parallel group train on the same batch."""
    cfg, mesh = plan.cfg, plan.mesh
    tokenizer = process_group.rank0_first(rank, in_cache(cfg, lambda: data.load_tokenizer(cfg)))
    dp_rank, dp = mesh.dp_rank(rank), mesh.dp
    if cfg.streaming:
        prepared = in_cache(cfg, lambda: data.prepare_stream(cfg, tokenizer, dp_rank, dp, log))()
        return RunData(tokenizer, prepared, order=prepared.train)
    prepare = plan.objective.prepare_data  # language modelling's rows, or preference pairs
    prepared = process_group.rank0_first(rank, in_cache(cfg, lambda: prepare(cfg, tokenizer, log)))
    order = data.BatchOrder(prepared.train, cfg.per_device_train_batch_size, dp_rank, dp, cfg.seed, prepared.pad_id)
    return RunData(tokenizer, prepared, order)


def in_cache(cfg, fn):
    """`fn`, whose writes go to the data cache: storage that refuses them (a full disk, a cache_dir this user
    cannot write) is one line, which rank0_first raises on every rank. The cache holds whole entries only."""

    def run():
        with storage.guarded("preparing the data", data.cache_root(cfg), flag="--cache_dir"):
            return fn()

    return run


def check_inputs(plan: RunPlan) -> CheckedInputs:
    """What needs no process group, checked before one starts (and by --dry_run): the trackers installed, every
    dataset found (under --dry_run a sample of its rows read and checked against the format), output_dir and
    the resume rules, the live eval's tasks."""
    cfg = plan.cfg
    report_to = metrics_log.report_targets(cfg.report_to)  # a tracker asked for but not installed fails here
    sampled = plan.objective.check_data(cfg, sample=cfg.dry_run)  # a missing file or bad mixture fails here
    resume_request = run_dir.check_output_dir(
        plan.output_dir, plan.signature, cfg.overwrite_output_dir, cfg.resume_from_checkpoint
    )
    resuming.check_resume_layout(resume_request, plan)
    live_tasks = in_training.check(plan)  # --eval_tasks / --eval_samples: refused here, names checked here
    plan.objective.check_inputs(plan)  # a preference run's given reference file
    return CheckedInputs(report_to, resume_request, live_tasks, sampled)


def build_model(plan: RunPlan, rank: int, log):
    """Under ZeRO-3 the model is built inside zero.Init, straight into partitions: transformers does that
    while an HfDeepSpeedConfig is alive. Then train.py's loss where it applies, then the adapter."""
    from transformers.integrations import HfDeepSpeedConfig

    cfg, model_config = plan.cfg, plan.model_config
    if cfg.attn_implementation == "sdpa" and not plan.parallelism.owns_attention:  # packed rows: one sdpa call
        packed_attention.install()  # per example, not a masked row (1.7x a step here); Ulysses wraps it itself
    hf_ds = HfDeepSpeedConfig(plan.parallelism.zero_init_config(plan.ds))  # noqa: F841 -- alive while building
    modeling.causal_lm_class(model_config)
    load_dtype = torch.bfloat16 if (plan.precision == "bf16" and cfg.model_name_or_path) else torch.float32
    model = modeling.build_model(cfg, model_config, load_dtype, rank, plan.adapter.load_kwargs(load_dtype))
    if plan.zero_stage == 3:  # experts kept as separate modules (remote code): gathered whole, or ZeRO-3 hangs
        moe.mark_leaves(model, log)
    n_params = modeling.num_params(model)
    lm_loss.install_for_run(model, plan, log)
    model = plan.adapter.wrap(model, log)
    model = plan.parallelism.split(model, plan.ds, log)  # a pipeline: this rank's stage of the layers
    if partitioned(model):
        log(
            f"model: built under zero.Init; rank {rank} holds {modeling.partition_numel(model)} of {n_params} "
            "parameters"
        )
    log(
        f"model: {model_config.model_type}, {moe.parameters_in_words(model_config, n_params)}, ZeRO stage "
        f"{plan.zero_stage}, {plan.precision_words}, attention {cfg.attn_implementation}"
    )
    return model


def start_engine(plan: RunPlan, model, ds: dict, log):
    """`deepspeed.initialize` with the run's axes as its mpu; compiled when asked."""
    engine = make_engine(plan.cfg, model, ds, plan.total_steps, plan.parallelism.mpu())
    if split := muon_split(engine):
        log(split)
    if plan.cfg.torch_compile:  # DeepSpeed's own compile support: it knows which hooks must stay outside the graph
        from deepspeed.accelerator import get_accelerator

        engine.compile()  # DeepCompile when the config's compile.deepcompile is true (ds_configs/deepcompile.json)
        log(gpu_only.compiler_line(plan.ds, engine.is_deepcompile_active(), get_accelerator().get_compile_backend()))
    return engine


def assemble_loop(
    plan: RunPlan, engine, run_data: RunData, inputs: CheckedInputs, stop: StopRequest, rank: int, log, resumed_at
) -> loop.Loop:
    """The fit's parts: metrics.jsonl (and the trackers), the checkpointer, the runner of a step, the live eval."""
    log_file = metrics_log.MetricsLog(
        plan.output_dir / "metrics.jsonl",
        rank == 0,
        resumed_at=resumed_at,
        report_to=inputs.report_to,
        run_name=plan.cfg.run_name,
        config=plan.signature,
    )
    checkpointer = checkpoint.Checkpointer(
        plan.output_dir,
        rank,
        plan.cfg.save_total_limit,
        plan.adapter.files_writer(engine, run_data.tokenizer),
        plan.mesh.layout(),
    )
    runner = plan.objective.runner(engine, plan, rank, run_data.prepared, resumed_at is not None, log)
    live_eval = (
        in_training.LiveEval(plan, inputs.live_tasks, run_data.tokenizer, run_data.prepared, rank, log)
        if inputs.live_tasks or plan.cfg.eval_samples
        else None
    )
    return loop.Loop(
        engine=engine,
        runner=runner,
        plan=plan,
        order=run_data.order,
        prepared=run_data.prepared,
        log_file=log_file,
        checkpointer=checkpointer,
        stop=stop,
        rank=rank,
        log=log,
        live_eval=live_eval,
    )


def warn_if_too_big(plan: RunPlan, rank: int, log) -> None:
    """On a GPU, warn before an OOM, with what would fit."""
    if not torch.cuda.is_available() or rank != 0:
        return
    from zero_recipes import memory  # the estimator: only here and under --dry_run, not in a CPU run's start-up

    estimate, line = memory.for_run(plan.model_config, plan.ds, plan.cfg, plan.world)
    free = torch.cuda.get_device_properties(0).total_memory
    log(line)
    verdict = (
        None if estimate is None else memory.fit_verdict(estimate.per_gpu["peak_bytes"], free, estimate.zero_stage)
    )
    if verdict in ("no", "tight"):
        what = (
            "exceeds" if verdict == "no" else "leaves too little room for the CUDA context, NCCL and fragmentation on"
        )
        log(
            f"warning: the estimate {what} this GPU's {free / 2**30:.1f} GiB; see `python tools/estimate_memory.py "
            f"--model ... --table --gpu_memory {free / 2**30:.0f}GiB` for a config that fits"
        )


def check_export(engine, runner, plan: RunPlan, run_data: RunData, rank: int):
    """Reload the export on rank 0 as a user would and compare its logits with the engine's on one probe row."""
    rows = run_data.prepared.probe_rows
    probe = data.collate([rows.row(0)], run_data.prepared.pad_id) if rows is not None else run_data.order.next_batch()
    probe = probe["input_ids"][:1, :64].to(engine.device)
    dtype = DTYPES[plan.precision]
    return verify_export(engine, probe, rank, lambda: plan.adapter.reload(plan.output_dir, dtype), runner.logits)


def dry_run(plan: RunPlan, log) -> int:
    """Everything a launch would check before its process group starts (the plan, the model config and its
    attention, the data, output_dir and resume rules), then what it would run and its memory estimate."""
    cfg, model_config = plan.cfg, plan.model_config
    ds_checks.refuse_gpu_only(plan.ds)  # ZenFlow, SuperOffload, DeepCompile on a CPU: refused, not only warned of
    inputs = check_inputs(plan)
    n = modeling.count_params_meta(model_config)
    tokens = plan.global_batch * cfg.block_size
    ds, notes = plan.ds, list(plan.notes)
    if cfg.max_steps > 0:
        ds = plan.complete(cfg.max_steps).ds
    elif isinstance(ds.get("scheduler"), dict):
        notes.insert(0, "scheduler steps stay 'auto' until the dataset is prepared")
    log("resolved DeepSpeed config (key names normalised, validated by DeepSpeed's own config models):")
    log(json.dumps(ds, indent=2))
    for note in notes:
        log(f"note: {note}")
    for problem in ds_checks.machine_problems(ds, cfg.tf32):
        log(f"warning: this machine cannot train it: {problem}")
    for line in inputs.sampled:
        log(f"data: {line}")
    for line in plan.objective.dry_run_lines(cfg, lambda: data.load_tokenizer(cfg)):
        log(f"data: {line}")
    log(f"output: {plan.output_dir}: {output_plan(plan.output_dir, cfg, inputs.resume_request)}")
    steps = (
        str(cfg.max_steps)
        if cfg.max_steps > 0
        else f"{cfg.num_train_epochs} epoch(s); count known once the data is prepared"
    )
    log(
        f"plan: model {model_config.model_type} {moe.parameters_in_words(model_config, n)}; {plan.mesh.describe()}; ZeRO stage "
        f"{plan.zero_stage}; {plan.precision_words}; "
        f"{plan.global_batch} {plan.objective.rows} x {cfg.block_size} tokens = {tokens} tokens/step; steps {steps}; "
        f"{flops.model_flops_per_token(model_config, cfg.block_size) * tokens / 1e12:.3f} TFLOP/step"
    )
    if plan.mesh.group > 1:
        local = launcher_env.rank_info().local_world_size
        nodes = local if plan.world > local > 1 else None
        axis = next(name for name, n in plan.mesh.sizes.items() if n > 1)
        log(
            f"mesh (global ranks: a row per data-parallel replica, a column per {axis}-parallel index):\n"
            f"{mesh_picture(plan.mesh, nodes)}"
        )
    from zero_recipes import memory

    log(memory.for_run(model_config, ds, cfg, plan.world)[1])
    return 0


def output_plan(output_dir, cfg, resume_request) -> str:
    """What a launch would do with output_dir, as run_dir.check_output_dir decided it."""
    if resume_request == "auto":
        return "holds this run; a launch resumes it from its newest checkpoint"
    if resume_request is not None:
        return f"a launch resumes from {resume_request}"
    if cfg.overwrite_output_dir and output_dir.is_dir() and any(output_dir.iterdir()):
        return "a launch starts over (--overwrite_output_dir)"
    return "a launch trains from scratch"


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    except ConfigError as e:
        code = process_group.report_refusal(e)
    except KeyboardInterrupt:
        code = 130
    except BaseException as e:
        if "loss scale already at minimum" in str(e):  # DeepSpeed's fp16 loss scaler gives up
            if int(os.environ.get("RANK", 0)) == 0:
                print(
                    "error: fp16 loss scale hit its minimum: the gradients keep overflowing. Use bf16 "
                    "(ds_configs/bf16.json), lower --learning_rate, or lower min_loss_scale in the fp16 block",
                    file=sys.stderr,
                    flush=True,
                )
        elif line := lost_peer(e):  # every surviving rank says it: each node's log shows the cause
            print(f"\nerror: {line}", file=sys.stderr, flush=True)  # \n: after tqdm's bar
        else:
            import traceback

            traceback.print_exc()
        code = 1
    metrics_log.close_open_logs()
    process_group.finish(code)
