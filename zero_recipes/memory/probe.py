"""Measure what a training step really holds in memory, per rank, on the CPU accelerator: the allocator
probe the memory estimate is checked against.

    deepspeed --num_gpus 2 --module zero_recipes.memory.probe --deepspeed ds_configs/zero2.json \
        --model_config '{"hidden_size": 256, ...}' --per_device_train_batch_size 2 --block_size 256 \
        --probe_out /tmp/probe.json

It takes train.py's flags and builds the model and engine with the same code (zero_recipes.modeling.model,
zero_recipes.adapters.lora, zero_recipes.training.engine, the same resolved DeepSpeed config), then runs a few steps on random tokens under
torch.profiler with profile_memory. Each allocation and free of the CPU allocator on a profiled thread is
an event carrying the allocator's global count of live bytes, which, with `count_every_thread`, includes every
thread's allocations and frees (gloo's worker threads free its collectives' copies): exact for torch tensors
(DeepSpeed's flat buffers, its C++ Adam's states and gloo's staging tensors included), blind to non-torch
memory (the Python heap, libraries, a checkpoint's memory-mapped file). On the CPU accelerator "device" and host
memory are one pool, so the figure is device plus host; tools/bench/estimator/benchmark.py compares it with the
estimate's per-GPU plus per-rank host bytes.

It refuses a GPU in one line (`refuse_accelerator`): what it reads is the CPU allocator, and counting CUDA
allocations instead would be a second probe no CPU can check; on a GPU, train.py logs the device's peak itself.

Phases are marked with record_function: init (model and engine), forward_backward, optimizer_step. Under
pipeline parallelism (`"pipeline": {"stages": N}`) each rank runs its stage as train.py does (DeepSpeed's
train_batch) and every instruction of the schedule is marked with its phase (`pipeline_steps`).

The same reading of the allocator's events (`allocator_events`) serves the benchmarks' probes
(tools/bench/runners/profiled_train.py, longctx/probe.py) and the estimate tests' one forward+backward
(`fwd_bwd_peak_bytes`). torch and the training modules are imported when a probe runs, not with this module.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from zero_recipes.adapters import lora
from zero_recipes.distributed import deepspeed_logs, launcher_env, process_group
from zero_recipes.errors import ConfigError
from zero_recipes.modeling import lm_loss, model as modeling
from zero_recipes.plan import RunPlan
from zero_recipes.training.engine import make_engine

PHASES = ("init", "forward_backward", "optimizer_step")
STEPS = 3  # the optimizer states appear at step 1; steps 2-3 show the steady state


def timeline(prof) -> dict:
    """Peak live bytes per phase, and the live bytes after init and after the last step."""
    marks, mem = allocator_events(prof)
    live, peak, after_init = 0, dict.fromkeys(PHASES, 0), None
    starts = [start for start, _, _ in marks]
    i = 0
    for t, nbytes in mem:
        live += nbytes
        while i < len(marks) and marks[i][1] < t:
            if marks[i][2] == "init":
                after_init = live - nbytes
            i += 1
        phase = phase_at(marks, starts, t)
        if phase:
            peak[phase] = max(peak[phase], live)
    return {"peak": peak, "after_init": after_init if after_init is not None else live, "end": live}


def phase_at(marks: list, starts: list, t: int):
    """The phase whose mark holds time t (marks sorted by start, none overlapping another), or None. Bisected:
    a pipeline's step is dozens of marks, one per instruction of its schedule."""
    import bisect

    i = bisect.bisect_right(starts, t) - 1
    return marks[i][2] if i >= 0 and marks[i][1] >= t else None


def allocator_events(prof) -> tuple[list, list]:
    """A torch.profiler run (profile_memory=True) as (marks, allocations), both in time order: marks are
    (start_ns, end_ns, name) of the record_function("phase:NAME") ranges, allocations (time_ns, bytes) of the
    CPU allocator, positive for an allocation and negative for a free, so their running sum is the live bytes
    since the profile began. The bytes are the differences of the allocator's own global count
    (`total_allocated` of each allocation event), not the events' sizes: the profiler records only the threads
    it was started on, and gloo frees its collectives' copies (`_reduce_scatter_base`'s clone, all-gather
    buffers) on its own worker threads, so summing sizes missed those frees at random and inflated ZeRO-3's
    measured peaks by up to 25 % from one launch to the next. Under `count_every_thread` the global count sees
    every thread. This probe and the benchmarks' (tools/bench) read their runs this way."""
    events = prof.profiler.kineto_results.events()
    marks = sorted(
        (e.start_ns(), e.start_ns() + e.duration_ns(), e.name()[len("phase:") :])
        for e in events
        if e.name().startswith("phase:")
    )
    counts = sorted(
        (node.start_time_ns, f.alloc_size, f.total_allocated, f.total_reserved, f.ptr)
        for node in _walk(prof.profiler.kineto_results.experimental_event_tree())
        if type(f := node.extra_fields).__name__ == "_ExtraFields_Allocation" and f.device.type == "cpu"
    )
    # Two kinds of events: the default CPU allocator's (c10's ProfiledCPUMemoryReporter: its global count, no
    # reserved bytes) and those of another allocator that reports to the profiler (transformers' checkpoint load
    # arrives as one such block, reserved bytes and a count of 0, its free a 0 and 0), whose sizes are summed as
    # before: told apart by the block's address.
    mem, before, foreign = [], None, set()
    for t, size, total, reserved, ptr in counts:
        if (size > 0 and reserved) or (size < 0 and ptr in foreign):
            (foreign.add if size > 0 else foreign.discard)(ptr)
            mem.append((t, size))
            continue
        before = total - size if before is None else before  # live when the profile began: the baseline
        mem.append((t, total - before))
        before = total
    return marks, mem


def _walk(roots):
    stack = list(roots)
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        yield node


def count_every_thread(on: bool = True) -> bool:
    """Make the CPU allocator count every thread's allocations and frees in its global total, which the
    profiler's allocation events carry (c10's ProfiledCPUMemoryReporter updates it for a profiled thread only,
    unless FLAGS_caffe2_report_cpu_memory_usage is set; torch has no Python switch for it, so it is set in
    libc10 directly). Call it before the tensors to be measured exist; a tensor made before it and freed after
    is not subtracted (c10 warns once per thousand). Returns the setting it replaced, so that a measurement
    inside a longer process (a test worker) can put it back: with it on, every allocation takes c10's lock."""
    import ctypes

    import torch

    lib = Path(torch.__file__).parent / "lib" / "libc10.so"
    try:
        flag = ctypes.c_bool.in_dll(ctypes.CDLL(str(lib)), "FLAGS_caffe2_report_cpu_memory_usage")
    except (OSError, ValueError) as e:  # another build of torch: the profiled threads' count, as before
        print(f"memory probe: frees on gloo's threads are not counted ({e})", file=sys.stderr)
        return False
    before, flag.value = flag.value, on
    return before


def fwd_bwd_peak_bytes(model, config, micro: int, seq: int, forward=None) -> int:
    """Peak live bytes of one real forward+backward of `model` on random tokens, from the CPU allocator's
    profiler events; each trainable parameter's grad is dropped as it is made, as DeepSpeed moves it into its
    own buffers (the memory estimate counts those with the model states), but inside a tiled compute, where
    DeepSpeed leaves it in `param.grad` until the last tile. `forward(model, ids)` returns the
    loss (default: the model's own, with labels). The estimate tests and their child processes (a real AutoTP
    rank, tests/unit/memory/test_tensor_parallel.py) measure with this one function."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    model.train()
    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(_to_deepspeed)
    ids = torch.randint(0, config.get_text_config().vocab_size, (micro, seq))
    forward = forward or (lambda m, x: m(input_ids=x, labels=x, use_cache=False).loss)
    was = count_every_thread()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            forward(model, ids).backward()
    finally:
        count_every_thread(was)
    live = peak = 0
    for _, nbytes in allocator_events(prof)[1]:
        live += nbytes
        peak = max(peak, live)
    return peak


def _to_deepspeed(param) -> None:
    """What ZeRO does with a gradient as it is made: takes it into its buffers, unless DeepSpeed's tiled compute
    (sequence_tiled_compute, TiledMLP) has marked the weight not ready until its last tile."""
    if getattr(param, "ds_grad_is_ready", True):
        param.grad = None


def refuse_accelerator(device: str) -> None:
    """The probe measures the CPU allocator (its profiler events), on CPU batches: on a GPU it would feed those
    to a CUDA engine and count none of the device's memory. A GPU run's peak is train.py's own `mem_peak_gb`
    (torch.cuda.max_memory_allocated), which `benchmark.py gpu` holds against the estimate."""
    if device != "cpu":
        raise ConfigError(
            f"the memory probe measures the CPU accelerator's memory, and DeepSpeed's accelerator here is {device}: "
            "run it with DS_ACCELERATOR=cpu, or read a GPU run's peak from train.py's metrics.jsonl (mem_peak_gb; "
            "python tools/benchmark.py gpu compares it with the estimate)"
        )


def main(argv: list[str]) -> int:
    from deepspeed.accelerator import get_accelerator

    refuse_accelerator(get_accelerator().device_name())  # before any process group or model
    # transformers 5 reads a checkpoint's tensors in a thread pool, and the profiler misses the allocations of
    # those threads (measured: an fp32 load of a bf16 checkpoint showed the bf16 reads, never the fp32 weights).
    # Loading on the main thread ends with the same tensors, and every allocation is seen.
    os.environ.setdefault("HF_DEACTIVATE_ASYNC_LOAD", "1")
    import torch
    import torch._dynamo  # noqa: F401 -- before zero.Init, as in train.py

    count_every_thread()
    out, argv = probe_out(argv)
    plan = RunPlan.from_args(argv + ["--max_steps", str(STEPS)]).complete(STEPS)  # as train.py resolves it
    cfg, ds, model_config = plan.cfg, plan.ds, plan.model_config
    ranks = launcher_env.rank_info()
    rank, world = ranks.rank, ranks.world_size
    launcher_env.set_threads(ranks.local_world_size)
    # No host group: the probe waits on no one rank's work, and the group's Python objects move the moment the
    # garbage collector frees DeepSpeed's flat gradient copy (measured: a ZeRO-0 pipeline stage's step peaked 22 MB
    # over the estimate's band in 2 of 8 launches with it, 0 of 15 without)
    process_group.init(long_waits=False)
    deepspeed_logs.quiet_deepspeed()
    from transformers.integrations import HfDeepSpeedConfig

    modeling.causal_lm_class(model_config)
    batches = random_batches(plan, rank)
    quiet = lambda *a, **k: None  # noqa: E731
    # as train.py: the axes' set-up (Ulysses goes into transformers' attention table) before the model is built
    parallelism, adapter = plan.parallelism, plan.adapter
    parallelism.before_build(cfg, model_config, quiet)
    mpu = parallelism.mpu()  # as train.py: DeepSpeed's groups under TP or SP (the batch counts dp ranks)
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("phase:init"):
            # alive while the model is built, with train.py's dict for zero.Init (axis.Parallelism.zero_init_config)
            hf_ds = HfDeepSpeedConfig(parallelism.zero_init_config(ds))  # noqa: F841
            # as train.py's build_model: a pretrained base loads in bf16 under bf16, and LoRA wraps it
            bf16_load = plan.precision == "bf16" and cfg.model_name_or_path
            model = modeling.build_model(cfg, model_config, torch.bfloat16 if bf16_load else torch.float32, rank)
            lm_loss.install_for_run(model, plan, quiet)  # as train.py: its own loss where it applies, tiled MLP
            model = adapter.wrap(model, quiet)
            model = parallelism.split(model, ds, quiet)  # as train.py: a pipeline keeps this rank's stage
            engine = make_engine(cfg, model, ds, STEPS, mpu=mpu)
        engine.train()
        routed = routed_counts(engine.module)
        steps = pipeline_steps if plan.mesh.pp > 1 else eager_steps
        steps(engine, plan, rank, batches, record_function)
    mine = rank_report(prof, engine, plan, rank, routed)
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, mine)
    if rank == 0:
        Path(out).write_text(json.dumps({"ranks": gathered, "world": world, "ds_config": ds}, indent=1) + "\n")
    process_group.finish(0)
    return 0


def probe_out(argv: list[str]) -> tuple[str, list[str]]:
    """The --probe_out path, and train.py's flags without it."""
    out = argv[argv.index("--probe_out") + 1]
    return out, [a for i, a in enumerate(argv) if a != "--probe_out" and (i == 0 or argv[i - 1] != "--probe_out")]


def rank_report(prof, engine, plan, rank: int, routed: list) -> dict:
    """This rank's part of the probe's JSON: its phases' peaks (`timeline`), the model it held, the run's axes."""
    mine = timeline(prof)
    mine["routed_counts"] = routed
    mine["num_params"] = modeling.num_params(engine.module)
    mine["trainable_params"] = lora.trainable_count(engine.module)[0]
    mine["precision"] = plan.precision
    mine["tensor_parallel"] = plan.mesh.tp
    mine["sequence_parallel"] = plan.mesh.sp
    mine["pipeline_parallel"], mine["stage"] = plan.mesh.pp, plan.mesh.stage(rank)
    return mine


def routed_counts(module) -> list:
    """Under AutoEP: every MoE layer call's tokens per (global) expert on this rank, in call order, filled as the
    steps run (the router's third output, auto_ep_layer.RouterOutput.num_tokens_per_expert). With every rank's,
    `expert_imbalance` gives what the most-loaded rank's experts received. Empty without AutoEP."""
    try:
        from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
    except ImportError:
        return []
    out: list = []

    def hook(_module, _inputs, output):
        out.append([int(x) for x in output[2].tolist()])

    for m in module.modules():
        if isinstance(m, AutoEPMoELayer):
            m.router.register_forward_hook(hook)
    return out


def expert_imbalance(ranks: list, ep: int, tokens: int, top_k: int, layers: int) -> float:
    """From a probe's ranks (their `routed_counts`; ranks in order, EP groups of consecutive ranks as AutoEP
    lays them out): the most rows any rank's experts received in one forward (`layers` MoE layer calls, summed:
    every layer's rows are held at the backward's start), over the balanced layers x tokens x k."""
    worst = 0
    for start in range(0, len(ranks), ep):
        group = [r["routed_counts"] for r in ranks[start : start + ep]]
        calls = min(len(g) for g in group)
        local = len(group[0][0]) // ep
        for first in range(0, calls - layers + 1, layers):
            for dest in range(ep):
                rows = sum(
                    sum(g[call][dest * local : (dest + 1) * local])
                    for g in group
                    for call in range(first, first + layers)
                )
                worst = max(worst, rows)
    return worst / (layers * tokens * top_k)


def eager_steps(engine, plan, rank: int, batches: list, record_function) -> None:
    """The micro-batches through the engine's forward, backward and step, as runner.EagerRunner runs them."""
    for batch in batches:
        with record_function("phase:forward_backward"):
            loss = engine(**batch, use_cache=False).loss
            engine.backward(loss)
        with record_function("phase:optimizer_step"):
            engine.step()


def pipeline_steps(engine, plan, rank: int, batches: list, record_function) -> None:
    """STEPS optimizer steps of a pipeline as train.py runs them (pipeline_runner.PipelineRunner.train_step:
    DeepSpeed's train_batch over the step's micro-batches), each instruction of DeepSpeed's schedule under its
    phase: the optimizer step under optimizer_step, the rest (forwards, backwards, the gradient all-reduces, the
    activations and gradients between stages) under forward_backward. The engine's instruction table is replaced
    on this engine only, each entry wrapped, never changed."""
    from deepspeed.runtime.pipe import schedule

    def marked(fn, phase):
        def run(self, *args, **kwargs):
            with record_function(f"phase:{phase}"):
                return fn(self, *args, **kwargs)

        return run

    engine._INSTRUCTION_MAP = {
        kind: marked(fn, "optimizer_step" if kind is schedule.OptimizerStep else "forward_backward")
        for kind, fn in type(engine)._INSTRUCTION_MAP.items()
    }
    runner = plan.parallelism.runner(engine, plan, rank, False)
    per_step = plan.cfg.gradient_accumulation_steps
    for start in range(0, len(batches), per_step):
        runner.train_step([runner.micro_batch(b) for b in batches[start : start + per_step]], False)


def random_batches(plan, rank: int) -> list[dict]:
    """This rank's micro-batches of random tokens, STEPS x gradient accumulation of them."""
    import torch

    cfg = plan.cfg
    vocab = plan.model_config.get_text_config().vocab_size
    # every rank of a tensor-parallel group must see the same tokens (DeepSpeed checks the first batch: "Data
    # inconsistency within the TP group"), so the tokens are seeded by the data-parallel rank
    gen = torch.Generator().manual_seed(plan.mesh.dp_rank(rank))
    rows = [
        torch.randint(0, vocab, (cfg.per_device_train_batch_size, cfg.block_size), generator=gen)
        for _ in range(STEPS * cfg.gradient_accumulation_steps)
    ]
    # as train.py: under SP each rank trains its slice of the same rows (runner.EagerRunner.micro_batch)
    return [plan.parallelism.shard({"input_ids": ids, "labels": ids}, rank) for ids in rows]


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except ConfigError as e:  # as train.py
        sys.exit(process_group.report_refusal(e))
