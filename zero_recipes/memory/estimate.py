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

from zero_recipes.ds.facts import offloads, precision as ds_precision, zero_stage
from zero_recipes.parallel import combinations
from zero_recipes.parallel.mesh import Mesh
from zero_recipes.parallel.sequence_parallel import check_split

from ..errors import ConfigError
from . import moe as moe_memory
from .activations import Activations, activation_bytes
from .shape import ModelShape
from .states import PHASES, Setup, adam_temporaries, live_parameter_cap, phases

UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}

# What a GPU needs beyond the peak of torch's allocations, which is all the estimate counts. Outside the
# allocator: the CUDA context with torch's kernels (about 0.3-0.6 GiB with CUDA's lazy loading) and NCCL's
# communicator buffers (NCCL_BUFFSIZE, 4 MiB, per channel and peer). Inside it but not allocated: the caching
# allocator's fragmentation, reserved minus allocated, 1-7 % in the published runs of
# benchmarks/estimator-gpu-public.md (79408 vs 78422 MiB on an A100, 21662 vs 20228 MiB on a 24 GB card).
# An allocated peak that fits the card but not with this margin is "tight": it may run or run out of memory,
# and only a launch tells; the verdict never says "fits" there (LlamaFactory #5977 ran out by about that much).
OUTSIDE_ALLOCATOR_BYTES = 2**30
FRAGMENTATION = 0.05


def fit_verdict(peak_bytes: int, gpu_memory: int | None) -> str | None:
    """'yes', 'tight' (the allocated peak fits, the margin above does not) or 'no'; None without a memory."""
    if gpu_memory is None:
        return None
    if peak_bytes > gpu_memory:
        return "no"
    return "yes" if peak_bytes * (1 + FRAGMENTATION) + OUTSIDE_ALLOCATOR_BYTES <= gpu_memory else "tight"


def parse_memory(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b?|b)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ConfigError(f"cannot read memory size '{text}'; write it like 80GiB, 24GB or 81920MiB")
    unit = (m.group(2) or "").lower()
    unit = unit if unit.endswith("b") or unit == "" else unit + "b"
    return int(float(m.group(1)) * UNITS[unit])


@dataclass
class Launch:
    num_gpus: int = 1  # per node
    num_nodes: int = 1
    micro_batch_size: int = 1
    seq_len: int = 2048
    gradient_checkpointing: bool = False
    attn_implementation: str = "sdpa"
    accelerator: str = "gpu"
    """"gpu": device and host apart, by DeepSpeed's GPU code path (states.gpu_phases). "cpu": the CPU accelerator's
    one pool (states.cpu_phases), for checking against CPU runs."""
    optim: str = "adamw_torch_fused"
    """train.py's --optim: the optimizer step's temporaries follow it (states.adam_temporaries)."""
    optimizer_temporaries: int | None = None
    """Bytes per stepped element the optimizer step allocates, for another project's optimizer (torch's
    single-tensor AdamW 8, foreach 4, fused 0). None: train.py's, by `optim` and the accelerator."""
    tiled_loss: bool = True
    """train.py's --tiled_loss: the head and loss over tiles once a micro-batch has more tokens than one tile."""
    loss_tile_tokens: int = 0
    """train.py's --loss_tile_tokens (0: one tile's fp32 logits at most 256 MiB)."""
    tiled_mlp: bool = False
    """train.py's --tiled_mlp: every MLP through DeepSpeed's TiledMLP."""
    expert_imbalance: float = moe_memory.EXPERT_IMBALANCE
    """Under expert parallelism: the most-loaded rank's routed rows over the balanced tokens x k (memory/moe.py)."""

    @property
    def world(self) -> int:
        return self.num_gpus * self.num_nodes


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

    def as_json(self) -> dict:
        return asdict(self)


def estimate(
    model_config,
    ds: dict,
    launch: Launch,
    shape: ModelShape | None = None,
    activations: Activations | None = None,
    gpu_memory: int | None = None,
    lora=None,
    load_in_4bit: bool = False,
    stage_traces: list | None = None,
) -> Estimate:
    """`ds` is a resolved DeepSpeed config (zero_recipes.ds.intake.resolve), as train.py uses it; `lora` a peft
    LoraConfig (zero_recipes.adapters.lora.lora_config) for a LoRA run, else None. Under pipeline parallelism every stage
    is estimated and the worst one reported (`_pipelined`); `stage_traces`, its stages' activations
    (pipeline.stage_activations) when already traced, as `activations` is without it."""
    mesh = Mesh.of(launch.world, ds)
    mesh.check()  # what train.py refuses of the mesh, and of its axes with the ZeRO stage, refused the same way
    combinations.refuse(combinations.modes(mesh.sizes, zero_stage(ds), "full"))
    tp, sp = mesh.tp, mesh.sp
    if sp > 1:
        check_split(sp, model_config, launch.seq_len, "the sequence length", "--seq_len")
    if mesh.pp > 1:
        from zero_recipes.parallel.pipeline.layers import refusal

        if problem := refusal(model_config, mesh.pp):  # a family or stage count train.py cannot split
            raise ConfigError(problem)
    shape = shape or ModelShape.of(model_config, lora, load_in_4bit, tp, ds.get("tensor_parallel"))
    if shape.tp != tp:
        raise ValueError(f"a ModelShape of tensor-parallel size {shape.tp} given for a config of size {tp}")
    precision = ds_precision(ds)
    p = 4 if precision == "fp32" else 2
    off_opt, off_par = offloads(ds)
    zero = ds.get("zero_optimization", {})
    # a mixture of experts under EP: a rank holds the dense weights and E/ep of each layer's experts (moe.py)
    experts = moe_memory.split(model_config, shape.model_params, mesh.ep, launch.world)
    held, shards = shape, mesh.zero_shards
    if experts is not None and experts.ep > 1:
        largest = moe_memory.held_largest(model_config, shape.largest_param, experts)
        held = replace(shape, num_params=experts.held, largest_param=largest, full_params=shape.model_params)
        shards = experts.zero_world
    setup = _setup(held, shards, zero_stage(ds), p, precision, off_opt, off_par, zero, launch)
    if mesh.pp > 1:
        return _pipelined(model_config, ds, launch, mesh, shape, setup, precision, gpu_memory, stage_traces)
    by_phase = phases(setup)
    if activations is None:
        activations = _traced(model_config, launch, p, lora, tp, shape, sp)
    in_loss = tiled_head_gradient(model_config, launch, sp, p, mesh.zero_shards, shape)
    if experts is not None:
        cap = live_parameter_cap(zero)
        by_phase = moe_memory.adjust_phases(
            by_phase,
            experts,
            setup.stage,
            p,
            cap,
            setup.load_bytes,
            0 if off_opt else setup.adam_temporaries,
            launch.accelerator == "gpu",
            launch.gradient_checkpointing,
        )
        in_loss += moe_memory.ep_activation_bytes(
            model_config,
            experts,
            launch.micro_batch_size,
            launch.seq_len,
            p,
            launch.gradient_checkpointing,
            launch.expert_imbalance,
        )
    table = phase_table(
        {
            "init": [(by_phase["init"], 0)],
            # or the forward's peak: activations on the steady states (with a tiled loss, the head's gradient in
            # flight inside the loss's backward too)
            "forward_backward": [(by_phase["forward_backward"], 0), (by_phase["forward"], activations.bytes + in_loss)],
            "optimizer_step": [(by_phase["optimizer_step"], 0)],
        }
    )
    e = _result(table, held, setup, precision, launch, mesh, gpu_memory, activations.method)
    if experts is not None:
        e.moe = {**experts.as_json(), "expert_imbalance": launch.expert_imbalance if experts.ep > 1 else None}
    return e


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
    per_node = _per_node(table, shape, setup, phases(setup)["init"].host_buffers, launch.num_gpus)
    per_gpu = {
        "peak_bytes": top["device_bytes"],
        "peak_phase": peak_phase,
        "model_states_bytes": top["model_states_bytes"],
        "activations_bytes": top["activations_bytes"],
        "buffers_bytes": top["buffers_bytes"],
    }
    fit = fit_verdict(per_gpu["peak_bytes"], gpu_memory)
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


def _pipelined(model_config, ds, launch, mesh, shape, setup, precision, gpu_memory, traced) -> Estimate:
    """Every stage's phases (pipeline.py: its parameters as DeepSpeed splits them, its activations under the 1F1B
    schedule); the Estimate is the worst stage's, with each stage's peak in `pipeline`."""
    import dataclasses

    from . import bf16_optimizer, pipeline
    from .pipeline_trace import all_stages

    m = pipeline.micro_batches(ds)
    split = pipeline.split(model_config, mesh.pp, pipeline.pipeline_block(ds, launch.world)["partition"], m)
    traced = traced or all_stages(model_config, split, m, launch, setup.bytes_per_param)
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


def _setup(shape: ModelShape, dp: int, stage: int, p: int, precision: str, off_opt, off_par, zero: dict, launch):
    """The model states' inputs (states.Setup) for this shape, ZeRO config and launch."""
    return Setup(
        shape.num_params,
        shape.largest_param,
        dp,
        stage,
        p,
        precision != "fp32",
        off_opt,
        off_par,
        zero,
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
        load_bytes=2
        if precision == "bf16"
        else 4,  # train.py's build_model: a pretrained base loads in bf16 under bf16
    )


def _traced(model_config, launch: Launch, p: int, lora, tp: int, shape: ModelShape, sp: int) -> Activations:
    """The launch's activations (activations.activation_bytes) in the run's dtype."""
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
        tp,
        shape.vocab_parallel,
        sp,
        launch.tiled_loss,
        launch.loss_tile_tokens,
        launch.tiled_mlp,
    )


def _per_node(table: dict, shape: ModelShape, setup: Setup, init_host_buffers: int, num_gpus: int) -> dict:
    """Host memory per node: offloaded states (pinned when pin_memory), and the load. Without zero.Init every
    rank materialises the whole model on the host (fp32 for a random init) before DeepSpeed moves it; with
    it, a pretrained checkpoint passes through one shard (at most 5 GB, HF's default) at a time. Under tensor
    parallelism too: AutoTP splits the built model inside deepspeed.initialize (engine.py
    `_apply_autotp_partitioning`), so each rank first holds the whole of it."""
    stage, off_opt, off_par, zero = setup.stage, setup.offload_optimizer, setup.offload_param, setup.zero
    host_states = max(t["host_bytes"] for t in table.values())
    full = shape.model_params
    init_host = 4 * full if stage < 3 else min(5 * 10**9, 2 * full)
    if shape.trainable is not None:  # LoRA loads a pretrained base in setup.load_bytes (and its reads, states.py)
        init_host = setup.load_bytes * shape.num_params + init_host_buffers if stage < 3 else init_host
    nvme = {off_opt, off_par} & {"nvme"}
    offloaded_to_host = 0 if nvme else host_states
    # pin_memory defaults to true in DeepSpeed 0.19.8 (runtime/zero/offload_config.py): pinned unless a file says false
    pinned = any(
        isinstance(zero.get(k), dict)
        and zero[k].get("device") not in (None, "none")
        and zero[k].get("pin_memory", True)
        for k in ("offload_optimizer", "offload_param")
    )
    return {
        "cpu_bytes": num_gpus * max(offloaded_to_host, init_host),
        "pinned_bytes": num_gpus * offloaded_to_host if pinned else 0,
        "nvme_bytes": num_gpus * host_states if nvme else 0,
    }


def tiled_head_gradient(model_config, launch: Launch, sp: int, p: int, n: int, shape: ModelShape) -> int:
    """With the loss in tiles, the output head's backward runs inside the loss's (sequence_tiled_compute
    recomputes each tile there), and ZeRO reduces the head's gradient at the last tile, while that tile's logits
    and their gradient are live. So the head's gradient in flight, which without tiling comes after the loss
    region is freed (states.py counts it in the backward's phase, max'ed with the forward's), adds to the
    activations: the reduction's 2p bytes a head parameter (states.py's in-flight `2 * p * f`) and its gradient
    partition, p/N. (The gradient held across tiles, p bytes, is in the traced activations.) Measured on ZeRO-2,
    one rank, bf16 (benchmarks/estimator.md, the 128k-vocabulary points); the same terms assumed for ZeRO-1 and 3."""
    from .activations import loss_tile

    if shape.trainable is not None or shape.tp > 1:  # LoRA's head is frozen; TP's head is split: not modelled
        return 0
    tile = loss_tile(
        model_config, launch.micro_batch_size, launch.seq_len, sp, launch.tiled_loss, launch.loss_tile_tokens
    )
    if not tile or launch.micro_batch_size * launch.seq_len // sp <= tile:
        return 0
    text = model_config.get_text_config()
    head = text.vocab_size * text.hidden_size
    return int(head * (2 * p + p / n))


def rank_total(e: Estimate, phase: str) -> int:
    """Device plus this rank's host bytes in one phase: what one rank holds on a CPU accelerator."""
    t = e.phases[phase]
    return t["device_bytes"] + t["host_bytes"]


def for_run(model_config, ds: dict, cfg, world: int) -> tuple[Estimate | None, str]:
    """tools/estimate_memory.py's estimate for this train.py run (with its --optim), and it in one
    line for the log. (None, why) when it cannot be made: an estimate must never stop a run."""
    import torch

    try:
        from zero_recipes.adapters.lora import lora_config
        from zero_recipes.adapters.lora_options import enabled
        from zero_recipes.distributed.launcher_env import rank_info

        per_node = min(world, rank_info().local_world_size or world)  # the launcher's ranks on this node: host memory is per node
        e = estimate(
            model_config,
            ds,
            Launch(
                per_node,
                -(-world // per_node),
                cfg.per_device_train_batch_size,
                cfg.block_size,
                cfg.gradient_checkpointing,
                cfg.attn_implementation or "sdpa",
                "gpu" if torch.cuda.is_available() else "cpu",
                tiled_loss=getattr(cfg, "tiled_loss", True),
                loss_tile_tokens=getattr(cfg, "loss_tile_tokens", 0),
                tiled_mlp=getattr(cfg, "tiled_mlp", False),
                optim=getattr(cfg, "optim", "adamw_torch_fused"),
            ),
            lora=lora_config(cfg) if enabled(cfg) else None,
            load_in_4bit=cfg.load_in_4bit,
        )
    except Exception as err:  # noqa: BLE001
        return None, f"memory: no estimate ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
    g = e.per_gpu
    return e, (
        f"memory: estimated peak {g['peak_bytes'] / 2**30:.2f} GiB per GPU in {g['peak_phase']} (states "
        f"{g['model_states_bytes'] / 2**30:.2f}, activations {g['activations_bytes'] / 2**30:.2f}, buffers "
        f"{g['buffers_bytes'] / 2**30:.2f}); host {e.per_node['cpu_bytes'] / 2**30:.2f} GiB per node "
        f"(tools/estimate_memory.py for the breakdown and --table)"
    )
