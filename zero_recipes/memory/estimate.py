"""The whole estimate for one launch: model states and buffers (states.py), activations (activations.py),
the phase that sets the peak, host memory per node, and whether it fits. The table of what fits across GPU
counts and configs is table.py; the compute/time/energy of a token budget, compute.py. Under pipeline
parallelism each stage is one of these (its layers, states and in-flight activations: pipeline.py) and the
estimate is the worst stage's.

The peak is the maximum over phases, never a sum of everything: activations live only in
forward/backward, the optimizer's transients only in its step, and init (where ZeRO-1/2 build the whole
model on every rank) only before either.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace

from zero_recipes.ds.facts import (
    autocast_dtype,
    offloads,
    precision as ds_precision,
    precision_words,
    state_bytes,
    zero_stage,
)
from zero_recipes.parallel import combinations
from zero_recipes.parallel.mesh import Mesh
from zero_recipes.parallel.sequence_parallel import check_split

from ..errors import ConfigError
from . import host_memory, moe as moe_memory, offload_variants, preloaded as preloaded_model
from .activations import Activations, activation_bytes
from .launch import Launch
from .shape import ModelShape
from .states import PHASES, Setup, adam_temporaries, live_parameter_cap, optimizer_states, phases

# bytes per unit of a memory size as written: decimal (kb ... tb) and binary (kib ... tib)
UNITS = (
    {"": 1, "b": 1}
    | {u + "b": 1000**i for i, u in enumerate("kmgt", 1)}
    | {u + "ib": 1024**i for i, u in enumerate("kmgt", 1)}
)

# What a GPU needs beyond the peak of torch's allocations, which is all the estimate counts. Outside the
# allocator: the CUDA context with torch's kernels (about 0.3-0.6 GiB with CUDA's lazy loading) and NCCL's
# communicator buffers (NCCL_BUFFSIZE, 4 MiB, per channel and peer). Inside it but not allocated: the caching
# allocator's fragmentation, reserved minus allocated. It depends on the stage. ZeRO-0/1/2 allocate the same
# blocks every step: 1-8 % in the published runs of benchmarks/estimator-gpu-public.md (gpjt's ZeRO-2 sweep: 49946
# vs 46125 MiB, and 79408 vs 78422 at the largest batch that ran on an 80 GB card; 21662 vs 20228 on a 24 GB
# card). ZeRO-3 gathers and frees parameters of every size in every layer, and its runs reserve 12-41 % above their
# allocated peak (gpjt's Llama-3-8B ZeRO-3 sweeps: 55030 vs 49086 MiB, 47368 vs 40890, 37560 vs 26571), 20 % at
# the largest batch that ran before one more ran out (78068 vs 64870 MiB): under pressure the allocator frees its
# cache and retries, and 20 % is what it could not give back there.
# An allocated peak that fits the card but not with this margin is "tight": it may run or run out of memory,
# and only a launch tells; the verdict never says "fits" there (LlamaFactory #5977 ran out by about that much).
OUTSIDE_ALLOCATOR_BYTES = 2**30
FRAGMENTATION = 0.05
ZERO3_FRAGMENTATION = 0.20


def fragmentation(stage: int) -> float:
    """The caching allocator's reserve above the allocated peak, as a share of it, by ZeRO stage (above)."""
    return ZERO3_FRAGMENTATION if stage == 3 else FRAGMENTATION


def margin_bytes(peak_bytes: int, stage: int) -> int:
    """What a GPU needs beyond the allocated peak: the CUDA context and NCCL, and the allocator's fragmentation."""
    return int(OUTSIDE_ALLOCATOR_BYTES + fragmentation(stage) * peak_bytes)


def fit_verdict(peak_bytes: int, gpu_memory: int | None, stage: int = 0) -> str | None:
    """'yes', 'tight' (the allocated peak fits, the margin above does not) or 'no'; None without a memory."""
    if gpu_memory is None:
        return None
    if peak_bytes > gpu_memory:
        return "no"
    return "yes" if peak_bytes + margin_bytes(peak_bytes, stage) <= gpu_memory else "tight"


def parse_memory(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b?|b)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ConfigError(f"cannot read memory size '{text}'; write it like 80GiB, 24GB or 81920MiB")
    unit = (m.group(2) or "").lower()
    unit = unit if unit.endswith("b") or unit == "" else unit + "b"
    return int(float(m.group(1)) * UNITS[unit])


@dataclass
class Estimate:
    num_params: int
    precision: str
    zero_stage: int
    offload: dict
    per_gpu: dict
    per_node: dict
    phases: dict
    activations_method: str
    fits: bool | None = None
    """True only for fit == 'yes': what a launch can count on."""
    fit: str | None = None
    notes: list = field(default_factory=list)
    trainable_params: int | None = None
    """LoRA: the parameters trained (adapters, modules_to_save); None for full fine-tuning."""
    tensor_parallel: int = 1
    data_parallel: int = 1
    """The ranks ZeRO partitions over: the world divided by tensor_parallel (by the stages under a pipeline)."""
    params_per_rank: int | None = None
    """Parameters one rank holds before ZeRO partitions them (the AutoTP shard, the worst pipeline stage's layers;
    num_params without either)."""
    sequence_parallel: int = 1
    """Ulysses ranks per group (sequence_parallel_size): each holds seq_len / this many tokens of every row."""
    pipeline_parallel: int = 1
    """Pipeline stages; the figures above are then the worst stage's (`pipeline` says which, and every stage's)."""
    pipeline: dict | None = None
    """Under pipeline parallelism: micro_batches, bubble, worst_stage and the stages (pipeline.stage_row)."""
    moe: dict | None = None
    """A mixture of experts: total and active parameters, experts, k, what a rank holds under EP (moe.Split)."""
    precision_words: str = ""
    """The precision in words (ds.facts.precision_words): "bf16 autocast, fp32 parameters and master weights"."""
    optimizer_states: dict | None = None
    """One rank's master weights and optimizer state, their dtypes and where they live (states.optimizer_states)."""

    def as_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Precomputed:
    """What a caller has already worked out for the launch it estimates, so that a sweep (table.py, longest.py,
    moe_advice.py) works it out once rather than once a cell; None: the estimate works it out."""

    shape: ModelShape | None = None
    activations: Activations | None = None
    """Without a pipeline: the launch's activations (activations.activation_bytes), in the run's dtype."""
    stage_traces: list | None = None
    """Under a pipeline: every stage's activations (pipeline_trace.all_stages)."""


def estimate(
    model_config,
    ds: dict,
    launch: Launch,
    gpu_memory: int | None = None,
    lora=None,
    load_in_4bit: bool = False,
    precomputed: Precomputed | None = None,
) -> Estimate:
    """`ds` is a resolved DeepSpeed config (zero_recipes.ds.intake.resolve), as train.py uses it; `lora` a peft
    LoraConfig (zero_recipes.adapters.lora.lora_config) for a LoRA run, else None. Under pipeline parallelism
    every stage is estimated and the worst one reported (`_pipelined`)."""
    known = precomputed or Precomputed()
    mesh = checked_mesh(model_config, ds, launch)
    shape = known.shape or ModelShape.of(model_config, lora, load_in_4bit, mesh.tp, ds.get("tensor_parallel"))
    if shape.tp != mesh.tp:
        raise ValueError(f"a ModelShape of tensor-parallel size {shape.tp} given for a config of size {mesh.tp}")
    # a mixture of experts under EP: a rank holds the dense weights and E/ep of each layer's experts (moe.py)
    experts = moe_memory.split(model_config, shape.model_params, mesh.ep, launch.world)
    held, shards = _held(model_config, shape, mesh, experts)
    setup = _setup(held, shards, ds, launch)
    if mesh.pp > 1:
        e = _pipelined(model_config, ds, launch, mesh, shape, setup, gpu_memory, known.stage_traces)
        return _described(e, ds, setup)
    by_phase = offload_variants.adjust(phases(setup), setup)  # ZenFlow's, SuperOffload's terms (GPU-only)
    activations = known.activations or _traced(
        model_config, launch, setup.bytes_per_param, lora, mesh, shape, autocast_dtype(ds)
    )
    in_loss = tiled_head_gradient(model_config, launch, mesh, setup.bytes_per_param, shape)
    if experts is not None:
        by_phase = _expert_phases(by_phase, experts, setup, launch)
        in_loss += moe_memory.ep_activation_bytes(
            model_config,
            experts,
            launch.micro_batch_size,
            launch.seq_len,
            setup.bytes_per_param,
            launch.gradient_checkpointing,
            launch.expert_imbalance,
        )
    by_phase = preloaded_model.adjust(by_phase, setup, shape, launch.preloaded, launch.gradient_checkpointing)
    table = phase_table(
        {
            "init": [(by_phase["init"], 0)],
            # or the forward's peak: activations on the steady states (with a tiled loss, the head's gradient in
            # flight inside the loss's backward too)
            "forward_backward": [(by_phase["forward_backward"], 0), (by_phase["forward"], activations.bytes + in_loss)],
            "optimizer_step": [(by_phase["optimizer_step"], 0)],
        }
    )
    e = _result(table, held, setup, ds_precision(ds), launch, mesh, gpu_memory, activations.method)
    if launch.preloaded is not None:
        e.notes.append(preloaded_model.note(setup, shape, launch.preloaded, launch.gradient_checkpointing))
    if experts is not None:
        e.moe = {**experts.as_json(), "expert_imbalance": launch.expert_imbalance if experts.ep > 1 else None}
    return _described(e, ds, setup)


def _described(e: Estimate, ds: dict, setup: Setup) -> Estimate:
    """The estimate with its precision in words and the optimizer states' bytes, dtypes and place."""
    e.precision_words = precision_words(ds)
    e.optimizer_states = optimizer_states(setup)
    if said := offload_variants.note(setup):
        e.notes.append(said)
    return e


def checked_mesh(model_config, ds: dict, launch: Launch) -> Mesh:
    """The launch's parallel sizes (Mesh.of: the one place the estimate reads them), refused where train.py refuses
    them: the axes with each other, the world and the ZeRO stage, and the model's split along SP and PP."""
    mesh = Mesh.of(launch.world, ds)
    mesh.check()
    combinations.refuse(combinations.modes(mesh.sizes, zero_stage(ds), "full"))
    if mesh.sp > 1:
        check_split(mesh.sp, model_config, launch.seq_len, "the sequence length", "--seq_len")
    if mesh.pp > 1:
        from zero_recipes.parallel.pipeline.layers import refusal

        if problem := refusal(model_config, mesh.pp):  # a family or stage count train.py cannot split
            raise ConfigError(problem)
    return mesh


def _held(model_config, shape: ModelShape, mesh: Mesh, experts) -> tuple[ModelShape, int]:
    """What one rank holds before ZeRO partitions it, and the ranks ZeRO partitions it over: under expert
    parallelism the dense weights and its experts, over the ranks holding the same experts."""
    if experts is None or experts.ep == 1:
        return shape, mesh.zero_shards
    largest = moe_memory.held_largest(model_config, shape.largest_param, experts)
    held = replace(shape, num_params=experts.held, largest_param=largest, full_params=shape.model_params)
    return held, experts.zero_world


def _expert_phases(by_phase: dict, experts, setup: Setup, launch: Launch) -> dict:
    """states.phases' result with a mixture of experts' terms (moe.adjust_phases)."""
    return moe_memory.adjust_phases(
        by_phase,
        experts,
        setup.stage,
        setup.bytes_per_param,
        live_parameter_cap(setup.zero),
        setup.load_bytes,
        0 if setup.offload_optimizer else setup.adam_temporaries,
        launch.accelerator == "gpu",
        launch.gradient_checkpointing,
    )


def phase_table(candidates: dict) -> dict:
    """Each phase's row: the largest on the device of its candidates, (states and buffers as states.py gives
    them for some moment, activations on top of them)."""
    table = {}
    for name in PHASES:
        b, act = max(candidates[name], key=lambda c: c[0].device + c[1])  # the first of equals
        table[name] = {
            "device_bytes": b.device + act,
            "model_states_bytes": b.states,
            "buffers_bytes": b.buffers,
            "activations_bytes": act,
            "host_bytes": b.host_states + b.host_buffers,
        }
    return table


def _result(table: dict, shape, setup: Setup, precision: str, launch, mesh, gpu_memory, method: str) -> Estimate:
    """The Estimate of one rank's phase table: its peak phase, the host memory per node and the verdict."""
    peak_phase = max(PHASES, key=lambda n: table[n]["device_bytes"])
    top = table[peak_phase]
    load = launch.preloaded.load_bytes if launch.preloaded else None
    per_node = host_memory.per_node(table, shape, setup, phases(setup)["init"].host_buffers, launch.num_gpus, load)
    per_gpu = {
        "peak_bytes": top["device_bytes"],
        "peak_phase": peak_phase,
        "model_states_bytes": top["model_states_bytes"],
        "activations_bytes": top["activations_bytes"],
        "buffers_bytes": top["buffers_bytes"],
    }
    fit = fit_verdict(per_gpu["peak_bytes"], gpu_memory, setup.stage)
    return Estimate(
        shape.model_params,
        precision,
        setup.stage,
        {"optimizer": setup.offload_optimizer, "param": setup.offload_param},
        per_gpu,
        per_node,
        table,
        method,
        None if fit is None else fit == "yes",
        fit,
        trainable_params=shape.trainable,
        tensor_parallel=mesh.tp,
        data_parallel=mesh.zero_shards,
        params_per_rank=shape.num_params,
        sequence_parallel=mesh.sp,
    )


def _pipelined(model_config, ds, launch, mesh, shape, setup, gpu_memory, traced) -> Estimate:
    """Every stage's phases (pipeline.py: its parameters as DeepSpeed splits them, its activations under the 1F1B
    schedule); the Estimate is the worst stage's, with each stage's peak in `pipeline`."""
    import dataclasses

    from . import bf16_optimizer, pipeline
    from .pipeline_trace import all_stages

    m = pipeline.micro_batches(ds)
    split = pipeline.split(model_config, mesh.pp, pipeline.pipeline_block(ds, launch.world)["partition"], m)
    traced = traced or all_stages(model_config, split, m, launch, setup.bytes_per_param)
    precision = ds_precision(ds)
    bf16 = bf16_optimizer.applies(setup.stage, precision, pipeline=True)
    rows = []
    for st in split:
        mine = dataclasses.replace(setup, num_params=st.params, largest_param=max(1, st.largest_param))
        by_phase = bf16_optimizer.phases(mine) if bf16 else phases(mine)
        rows.append((st, mine, phase_table(pipeline.candidates(by_phase, traced[st.index], shape.model_params,
                                                               launch.accelerator))))  # fmt: skip
    worst, mine, table = max(rows, key=lambda r: max(t["device_bytes"] for t in r[2].values()))
    held = dataclasses.replace(shape, num_params=worst.params, largest_param=mine.largest_param,
                               full_params=shape.model_params)  # fmt: skip
    e = _result(table, held, mine, precision, launch, mesh, gpu_memory, "traced")
    e.pipeline_parallel = mesh.pp
    e.pipeline = {"micro_batches": m, "bubble": pipeline.bubble(mesh.pp, m), "worst_stage": worst.index,
                  "stages": [pipeline.stage_row(st, t) for st, _, t in rows]}  # fmt: skip
    return e


def uses_muon(ds: dict) -> bool:
    """DeepSpeed builds its Muon (`"optimizer": {"type": "Muon"}`, ds_configs/muon.json)."""
    block = ds.get("optimizer")
    return isinstance(block, dict) and str(block.get("type", "")).lower() == "muon"


def _setup(shape: ModelShape, dp: int, ds: dict, launch: Launch) -> Setup:
    """The model states' inputs (states.Setup) for this shape, over `dp` ranks, by this DeepSpeed config and launch."""
    precision = ds_precision(ds)
    off_opt, off_par = offloads(ds)
    master, moment = state_bytes(ds)
    moment = launch.moment_bytes if launch.moment_bytes is not None else moment
    return Setup(
        shape.num_params,
        shape.largest_param,
        dp,
        zero_stage(ds),
        4 if precision == "fp32" else 2,
        precision != "fp32",
        off_opt,
        off_par,
        ds.get("zero_optimization", {}),
        adam_temporaries=(
            adam_temporaries(launch.optim, launch.accelerator)
            if launch.optimizer_temporaries is None
            else launch.optimizer_temporaries
        ),
        accelerator=launch.accelerator,
        trainable=shape.trainable,
        largest_trainable=shape.largest_trainable,
        quantized=shape.quantized,
        largest_quantized=shape.largest_quantized,
        # train.py's build_model: a pretrained base loads in bf16 under bf16
        load_bytes=2 if precision == "bf16" else 4,
        master_bytes=master,
        moment_bytes=moment,
        muon_params=shape.muon_params if uses_muon(ds) and shape.trainable is None else 0,
    )


def _traced(model_config, launch: Launch, p: int, lora, mesh: Mesh, shape: ModelShape, autocast=None) -> Activations:
    """The launch's activations (activations.activation_bytes) in the run's dtype; under `torch_autocast`
    (`autocast`: its dtype) fp32 parameters with the forward and backward traced inside torch.autocast."""
    import torch

    dtype = torch.float32 if p == 4 else torch.bfloat16
    return activation_bytes(
        model_config,
        launch.micro_batch_size,
        launch.seq_len,
        dtype,
        launch.gradient_checkpointing,
        launch.attn_implementation,
        lora,
        mesh.tp,
        shape.vocab_parallel,
        mesh.sp,
        launch.tiled_loss,
        launch.loss_tile_tokens,
        launch.tiled_mlp,
        launch.objective,
        autocast,
        launch.liger,
    )


def tiled_head_gradient(model_config, launch: Launch, mesh: Mesh, p: int, shape: ModelShape) -> int:
    """With the loss in tiles, the output head's backward runs inside the loss's (sequence_tiled_compute
    recomputes each tile there), and ZeRO reduces the head's gradient at the last tile, while that tile's logits
    and their gradient are live. So the head's gradient in flight, which without tiling comes after the loss
    region is freed (states.py counts it in the backward's phase, max'ed with the forward's), adds to the
    activations: the reduction's 2p bytes a head parameter (states.py's in-flight `2 * p * f`) and its gradient
    partition, p/N. (The gradient held across tiles, p bytes, is in the traced activations.) Measured on ZeRO-2,
    one rank, bf16 (benchmarks/estimator.md, the 128k-vocabulary points); the same terms assumed for ZeRO-1 and 3."""
    from .activations import loss_tile

    if shape.trainable is not None or shape.tp > 1 or launch.objective != "lm":  # LoRA's head is frozen; TP's
        return 0  # head is split: not modelled; DPO's is never tiled
    tile = loss_tile(
        model_config, launch.micro_batch_size, launch.seq_len, mesh.sp, launch.tiled_loss, launch.loss_tile_tokens
    )
    if not tile or launch.micro_batch_size * launch.seq_len // mesh.sp <= tile:
        return 0
    text = model_config.get_text_config()
    head = text.vocab_size * text.hidden_size
    return int(head * (2 * p + p / mesh.zero_shards))


def rank_total(e: Estimate, phase: str) -> int:
    """Device plus this rank's host bytes in one phase: what one rank holds on a CPU accelerator."""
    t = e.phases[phase]
    return t["device_bytes"] + t["host_bytes"]
