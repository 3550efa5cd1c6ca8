"""Model states and DeepSpeed's own buffers on one rank, by ZeRO stage, offload and phase.

Two accountings, because host and device are one pool on the CPU accelerator and two on a GPU:

- `gpu_phases`: what lives on the GPU and what on the host, buffer by buffer from DeepSpeed 0.19.8's code
  (states_gpu.py's table: each row cites the file and function that allocates it). This is what
  tools/estimate_memory.py reports.
- `cpu_phases`: the one-pool totals, checked against the torch profiler's allocator events of real DeepSpeed
  runs on the CPU accelerator (states_cpu.py's table; zero_recipes/memory/probe.py, N = 1, 2, 4 ranks;
  benchmarks/estimator.md). It checks the sums, not the device/host split.

p: bytes of a training parameter (2 in bf16/fp16, 4 in fp32). N: data-parallel ranks. F: the largest
single parameter (usually the embedding). Adam's two moments are fp32 (8 B), so is the master copy (4 B), unless
bf16_states.json makes them bf16 (m = 2 B a master weight, o = 4 B of moments: `optimizer_state_bytes`, the tables'
t.m and t.o); Muon's matrices keep one momentum buffer instead of Adam's two.

LoRA (`Setup.trainable` below the parameter count): only the optimizer's parameters get grads, master copies,
Adam moments and the buffers sized by them, so the trainable part is the same accounting over the trainable
parameters alone; the frozen base adds its weights at p bytes (`frozen_phases`), partitioned under ZeRO-3.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from . import states_cpu, states_gpu
from .states_gpu import flat_grad_copy  # noqa: F401 -- the tables' helper, named with the other terms

PHASES = ("init", "forward_backward", "optimizer_step")


def adam_temporaries(optim: str, accelerator: str) -> int:
    """Bytes per stepped element that train.py's torch AdamW allocates in its step, by its `optim` (config.OPTIMIZERS).
    Fused AdamW (the default, on a CPU as on a GPU), DeepSpeed's FusedAdam and DeepSpeedCPUAdam allocate none: 0.
    Unfused (`adamw_torch`), torch steps one tensor at a time on a CPU, allocating two the size of the tensor it
    steps (sqrt, then the division): 8; on a GPU it takes the foreach form, one list of them: 4."""
    if optim == "adamw_torch_fused":
        return 0
    return 8 if accelerator == "cpu" else 4


def grad_norm_transient(stage: int, largest: float, world: int) -> float:
    """Bytes per parameter of the gradient norm's fp64 copy at the step, one param at a time (`get_norm_dtype`:
    fp64 wherever the device has it), before the step flattens the grads (`step_grad_transient` takes the larger).
    ZeRO-1/2: zero/stage_1_and_2.py `scaled_global_norm` -> `get_grad_norm_direct` over `averaged_gradients`, this
    rank's piece of each param: 8 B x the largest piece, at most the partition. ZeRO-3: stage3.py `_get_norm_groups`
    -> `get_grad_norm_direct`, each param's whole grad partition: 8 B x the largest param / N. `largest` is the
    largest param's share of all of them. Under optimizer offload the norm is taken in the backward instead
    (`offload_norm_transient`). Measured where it sets the peak: ZeRO-2 bf16 on 4 ranks (model B, whose 8.19M-
    element embedding is nearly a rank's whole partition: 251.4 MB at the step, 7.44 B/param, as this gives);
    on 1 and 2 ranks the flat copies that follow it are larger, so it is not seen there (benchmarks/estimator.md)."""
    if stage in (1, 2):
        return 8 * min(largest, 1 / world)
    return 8 * largest / world if stage == 3 else 0.0


# stage3.py `_constant_buffered_norm2` takes a grad to fp64 in slices of this many elements (its buffer_size)
ZERO3_NORM_SLICE = 250_000_000


def offload_norm_transient(stage: int, largest: float, world: int, num_params: int) -> float:
    """Bytes per parameter of the gradient norm's fp64 copy that optimizer offload makes in the backward, one param
    at a time, as each reduced grad is copied to the host (the norm is then taken from these at the step, with no
    copy of its own). ZeRO-1/2: zero/stage_1_and_2.py `copy_grads_in_partition` -> `set_norm_for_param_grad_in_gpu`,
    8 B x this rank's piece of the param (`grad_position`), at most the partition. ZeRO-3: stage3.py
    `partition_grads` -> `_offload_grad_partition_at_boundary` -> `_constant_buffered_norm2`, 8 B x the param's
    grad partition (1/N of it), in slices of ZERO3_NORM_SLICE elements. fp64 is `get_norm_dtype()` wherever the
    device has it (zero/utils.py). `largest` is the largest param's share of all of them. Measured on model B
    (8.19M-element embedding and head), bf16: 65.5 MB at ZeRO-2 on 1 and 2 ranks, 65.5 and 32.8 MB at ZeRO-3 on 1
    and 2 (benchmarks/estimator.md)."""
    if stage in (1, 2):
        return 8 * min(largest, 1 / world)
    return 8 * min(largest / world, ZERO3_NORM_SLICE / num_params)


@dataclass
class Setup:
    num_params: int
    largest_param: int
    world: int  # data-parallel ranks (the world over tensor_parallel; num_params then one TP rank's share)
    stage: int
    bytes_per_param: int  # p
    mixed: bool  # bf16/fp16 with an fp32 master copy
    offload_optimizer: str | None  # None, "cpu" or "nvme"
    offload_param: str | None
    zero: dict = field(default_factory=dict)  # the resolved zero_optimization block
    # Bytes per stepped element of the optimizer's temporaries (`adam_temporaries` below)
    adam_temporaries: int = 0
    zero_init: bool = True  # ZeRO-3 builds the model straight into partitions
    accelerator: str = "gpu"  # "gpu": device and host apart (gpu_phases); "cpu": one pool (cpu_phases)
    # LoRA: the parameters the optimizer steps (adapters and modules_to_save) and the largest of them; None:
    # all of them (full fine-tuning). The rest is the frozen base.
    trainable: int | None = None
    largest_trainable: int = 0
    # Bytes per parameter the frozen base is loaded in: train.py loads a pretrained base in bf16 under bf16,
    # in fp32 otherwise (fp16 casts after the load).
    load_bytes: int = 4
    # QLoRA (--load_in_4bit): the frozen parameters bitsandbytes stores in NF4 (every Linear weight but the
    # output head, transformers' default skip list) and the largest of them
    quantized: int = 0
    largest_quantized: int = 0
    # Bytes of a master weight (and of the gradient partition the step reads in its dtype) and of each of Adam's
    # two moments: 4 and 4, or 2 and 2 under bf16_master_weights_and_grads and bf16_optimizer_states (ds.facts
    # `state_bytes`; runtime/base_optimizer.py `_configure_master_weights`)
    master_bytes: int = 4
    moment_bytes: int = 4
    # Muon (`"optimizer": {"type": "Muon"}`): the parameters DeepSpeed steps with Muon (2-D, not embedding or head:
    # deepspeed/__init__.py `set_optimizer_flags`), each with one momentum buffer instead of Adam's two moments
    muon_params: int = 0


def optimizer_state_bytes(s: Setup) -> float:
    """Bytes per parameter (averaged over all of them) of the optimizer's own state, before ZeRO partitions it.
    Adam: two moments. Muon's matrices: one momentum buffer, in the gradient's dtype (zero/stage_1_and_2.py
    `_muon_momentum_buffer` follows the gradient; stage3.py `_create_momentum_buffer` takes the communication
    dtype, the parameters' by default; ZeRO-0's FP16 wrapper steps fp32 copies), the rest Adam's."""
    adam = 2 * s.moment_bytes
    if not s.muon_params:
        return float(adam)
    # ZeRO-1/2 also keep a staged copy of each Muon group's momentum that muon_update writes into and the step
    # commits, reused across steps (stage_1_and_2.py `_muon_staging_momentum`, `_commit_muon_momentum`): two
    # buffers, so in fp32 Muon's state there equals Adam's (measured with the allocator probe, 8 bytes a parameter
    # either way: benchmarks/optimizers-2026-12-05.md); with bf16 gradients they are half. ZeRO-3 keeps one.
    momentum = (2 if s.stage in (1, 2) else 1) * s.bytes_per_param if s.stage > 0 else 4
    share = s.muon_params / s.num_params
    return (1 - share) * adam + share * momentum


def optimizer_states(s: Setup) -> dict:
    """One rank's master weights and optimizer state (ZeRO partitions them over `world` ranks from stage 1; at
    ZeRO-0 the fp32 parameters are their own master, counted with the parameters) and where they live: the
    figure the precision tests measure in a run's checkpoint (tests/integration/training/test_precision_states.py)."""
    shards = s.world if s.stage > 0 else 1
    n = (s.trainable if s.trainable is not None else s.num_params) / shards
    master = 0 if (s.stage == 0 and not s.mixed) else s.master_bytes * n
    return {
        "master_bytes": int(master),
        "optimizer_bytes": int(optimizer_state_bytes(s) * n),
        "master_dtype": "fp32" if s.master_bytes == 4 else "bf16",
        "moment_dtype": "fp32" if s.moment_bytes == 4 else "bf16",
        "where": "host" if s.offload_optimizer else "device",
        "muon_params": s.muon_params,
        "muon_note": " and its staged copy (ZeRO-1/2)" if s.stage in (1, 2) else "",
    }


@dataclass
class PhaseBytes:
    """One rank's bytes in one phase. `states` are params, grads, master and Adam moments; `buffers` are
    DeepSpeed's working memory beyond them (buckets, gathered ZeRO-3 params, flat copies, temporaries)."""

    states: int
    buffers: int
    host_states: int  # offloaded states of this rank, in host memory
    host_buffers: int = 0

    @property
    def device(self) -> int:
        return self.states + self.buffers


def zero_setting(zero: dict, key: str, default: float) -> float:
    """A number of the zero_optimization block; `default` (DeepSpeed 0.19.8's) where it is absent or "auto"."""
    value = zero.get(key, default)
    return float(value) if isinstance(value, (int, float)) else default


def live_parameter_cap(zero: dict) -> float:
    """The elements ZeRO-3 keeps gathered at most: stage3_max_live_parameters plus the prefetch bucket."""
    live = zero_setting(zero, "stage3_max_live_parameters", 1e9)
    return live + zero_setting(zero, "stage3_prefetch_bucket_size", 5e7)


@dataclass(frozen=True)
class Inputs:
    """What the tables (states_cpu.py, states_gpu.py) size their rows by, named once for one rank."""

    P: int  # parameters
    N: int  # ranks the states are partitioned over
    p: int  # bytes of a training parameter
    f: float  # the largest parameter's share of P
    stage: int
    off_opt: bool
    off_par: bool
    temp: int  # the optimizer step's temporaries per stepped element (DeepSpeedCPUAdam under offload: none)
    grad_norm: float  # grad_norm_transient's bytes per parameter (0 under optimizer offload)
    overlap: int  # reduce buckets: two with overlap_comm
    reduce_bucket: float  # elements
    live_cap: float  # elements (live_parameter_cap)
    sub_group: float  # elements
    off_norm: float = 0.0  # offload_norm_transient's bytes per parameter (the backward's fp64 norm under offload)
    # ZeRO-1/2 copy each reduced grad of the rank's partition into one buffer (`copy_grads_in_partition`), kept
    # until the step frees the grads; contiguous_gradients is DeepSpeed 0.19.8's default (zero/config.py)
    contiguous: bool = True
    m: float = 4  # bytes of a master weight, and of the gradient partition the step reads in its dtype
    o: float = 8  # bytes of the optimizer's state per parameter (optimizer_state_bytes: Adam's two moments, 8)

    @classmethod
    def of(cls, s: Setup) -> "Inputs":
        off_opt, f = s.offload_optimizer is not None, s.largest_param / s.num_params
        return cls(
            s.num_params,
            s.world,
            s.bytes_per_param,
            f,
            s.stage,
            off_opt,
            s.offload_param is not None,
            0 if off_opt else s.adam_temporaries,
            0.0 if off_opt else grad_norm_transient(s.stage, f, s.world),
            2 if s.zero.get("overlap_comm") else 1,
            zero_setting(s.zero, "reduce_bucket_size", 5e8),
            live_parameter_cap(s.zero),
            zero_setting(s.zero, "sub_group_size", 1e9),
            offload_norm_transient(s.stage, f, s.world, s.num_params) if off_opt else 0.0,
            bool(s.zero.get("contiguous_gradients", True)),
            s.master_bytes,
            optimizer_state_bytes(s),
        )


TABLE_PHASES = ("init", "steady", "forward", "forward_backward", "optimizer_step")
"""The phases of a table's columns (states_cpu.py, states_gpu.py), in order."""


def _apply(rows: tuple, t: Inputs, places: str) -> dict[str, list[float]]:
    """Each phase's bytes per parameter in each of `places`: the sizes of the rows whose cell there names the
    place, added in the rows' order."""
    sums = {phase: [0.0] * len(places) for phase in TABLE_PHASES}
    for size, *cells in rows:
        value = size(t)
        for phase, cell in zip(TABLE_PHASES, cells):
            for place in cell.strip("-"):
                sums[phase][places.index(place)] += value
    return sums


def _split(total: float, states: float, host: float) -> PhaseBytes:
    """A measured-or-derived total of one rank (device + host), split by the paper's accounting."""
    states = max(0.0, min(states, total - host))  # with offload, init's total can be below the host share
    return PhaseBytes(int(states), int(max(0.0, total - host - states)), int(host))


def phases(s: Setup) -> dict[str, PhaseBytes]:
    """Bytes of one rank in each phase (plus "steady" and "forward"), activations excluded."""
    if s.trainable is not None and s.trainable < s.num_params:
        return lora_phases(s)
    if s.accelerator == "cpu" or s.stage == 0:
        # ZeRO-0 puts nothing on the host: in bf16/fp16 engine.py `_do_optimizer_sanity_check` picks the FP16
        # wrapper and `_configure_fp16_optimizer` builds FP16_UnfusedOptimizer around torch AdamW, whose fp32
        # copies and Adam state live beside the module on the device, as on the CPU. (BF16_Optimizer is chosen
        # for ZeRO-1 with data_types.grad_accum_dtype fp32, which no shipped config sets: not modelled; and for
        # ZeRO-0 in bf16 under a pipeline, whose states are bf16_optimizer.py's.)
        return cpu_phases(s)
    return gpu_phases(s)


def cpu_phases(s: Setup) -> dict[str, PhaseBytes]:
    """The CPU accelerator's one pool (states_cpu.py's table): bytes of one rank in each phase, activations
    excluded. Totals are measured; `states` and `host` follow the paper's accounting, `buffers` are the rest."""
    table = states_cpu.rows(s.stage, s.offload_optimizer is not None, s.mixed)
    sums = _apply(table, Inputs.of(s), "tsh")
    return {k: _split(*(v * s.num_params for v in sums[k])) for k in TABLE_PHASES}


def gpu_phases(s: Setup) -> dict[str, PhaseBytes]:
    """ZeRO-1/2/3 on a GPU (states_gpu.py's table): device and host bytes of one rank per phase, from DeepSpeed
    0.19.8's code paths."""
    table = states_gpu.ZERO12 if s.stage in (1, 2) else states_gpu.ZERO3
    sums = _apply(table, Inputs.of(s), states_gpu.PLACES)
    return {k: PhaseBytes(*(int(v * s.num_params) for v in sums[k])) for k in TABLE_PHASES}


# A pretrained checkpoint is read one shard at a time (5 GB at most, transformers' default shard size), stored
# in bf16 as hub checkpoints are: what a load holds beyond the parameters it fills, at most.
CHECKPOINT_SHARD_BYTES = 5 * 10**9

# Bytes per NF4-stored parameter with double quantisation (what train.py's --load_in_4bit asks for):
# bitsandbytes packs two 4-bit codes per byte, keeps one absmax per 64-element block quantised to 8 bits, and
# one fp32 scale per 256 of those blocks (bitsandbytes functional.py `quantize_4bit`, blocksize 64,
# `compress_statistics`).
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)


def lora_phases(s: Setup) -> dict[str, PhaseBytes]:
    """LoRA: the trainable parameters under full fine-tuning's accounting, plus the frozen base. DeepSpeed sizes
    its optimizer-side memory by the optimizer's param groups, which hold only the trainable parameters:
    zero/stage_1_and_2.py `DeepSpeedZeroOptimizer.__init__` flattens `optimizer.param_groups` into
    `bit16_groups_flat`, stage3.py `_create_fp16_partitions_with_defragmentation` and `_create_fp32_partitions`
    likewise, fp16/unfused_optimizer.py `FP16_UnfusedOptimizer` (ZeRO-0 in bf16/fp16) copies only them to fp32.
    The reduce buckets (`setup_buckets`, stage3 `__init__`) are reduce_bucket_size whatever is trained, as
    before; the in-flight grad is the largest *trainable* parameter's."""
    trained = phases(replace(s, num_params=s.trainable, largest_param=max(1, s.largest_trainable), trainable=None))
    # the tables size the reduce bucket (reduce_bucket_size, allocated whole) in bytes per trained parameter, so over
    # a LoRA's few trainable parameters it comes out whole, as measured
    frozen = frozen_phases(s)
    return {
        k: PhaseBytes(
            t.states + f.states, t.buffers + f.buffers, t.host_states + f.host_states, t.host_buffers + f.host_buffers
        )
        for k, t in trained.items()
        for f in (frozen[k],)
    }


def frozen_phases(s: Setup) -> dict[str, PhaseBytes]:
    """The frozen base of a LoRA run: its weights at p bytes, no grad, no master copy, no Adam moments.
    `states` are the weights; `buffers` what loading and ZeRO-3's gathering add."""
    P, N, p = s.num_params, s.world, s.bytes_per_param
    F = P - s.trainable
    cpu = s.accelerator == "cpu" or s.stage == 0  # one pool, or (ZeRO-0) nothing on the host by design
    # The checkpoint's reads, bf16 as hub checkpoints are: ZeRO-0/1/2 load tensors that become the parameters,
    # with nothing left over when the load dtype is the checkpoint's; an fp32 load holds the bf16 reads until
    # the load ends. ZeRO-3 (transformers' `_load_state_dict_into_zero3_model`) holds the state dict as read, on
    # rank 0, while it copies each entry into its gathered parameter (all measured). On a GPU, host memory.
    ckpt = 2 * F if (s.stage == 3 or s.load_bytes != 2) else 0
    ckpt = min(ckpt, CHECKPOINT_SHARD_BYTES)
    if s.stage < 3:
        # engine.py `_configure_distributed_model` casts the module (frozen weights too) to p bytes on the host
        # before it moves it; the load itself is in load_bytes. NF4 weights are quantised as they load onto the
        # device and stay packed (ZeRO-3 with 4 bits is refused); each quantised layer's forward and backward
        # dequantise its weight into a p-byte temporary (bitsandbytes `matmul_4bit`), one layer at a time.
        Q = s.quantized
        weights = p * (F - Q) + NF4_BYTES * Q
        init_states = s.load_bytes * (F - Q) + NF4_BYTES * Q if cpu else weights
        out = dict.fromkeys(("steady", "optimizer_step"), PhaseBytes(int(weights), 0, 0))
        dequant = PhaseBytes(int(weights), p * s.largest_quantized, 0)
        out["forward"] = out["forward_backward"] = dequant
        out["init"] = PhaseBytes(int(init_states), int(ckpt) if cpu else 0, 0, 0 if cpu else int(ckpt))
        return out
    off_par = s.offload_param is not None
    cap = live_parameter_cap(s.zero)
    # gathered whole, own shard included (states_gpu.gathered); on one rank only offload_param on a GPU fetches
    share = 1.0 if (N > 1 or (off_par and not cpu)) else 0.0

    def gathered(n: int) -> float:  # the live-parameter cap applies to frozen and trainable together
        return p * min(share * n, cap)

    # QLoRA under ZeRO-3 (refused by train.py, run by others with bnb_4bit_quant_storage set to the 16-bit dtype,
    # so that ZeRO-3 shards the packed NF4 codes like any parameter): the frozen linears at NF4's bytes, gathered
    # and partitioned packed, each dequantised into a p-byte temporary when its layer runs (bitsandbytes)
    Q = s.quantized
    frozen_bytes = p * (F - Q) + NF4_BYTES * Q
    extra = (gathered(P) - gathered(s.trainable)) * frozen_bytes / (p * F)  # the frozen part a forward gathers
    extra += p * s.largest_quantized
    part = frozen_bytes / N  # zero/partition_parameters.py `Init`: partitioned like every parameter
    dev_part, host_part = (0.0, part) if off_par else (part, 0.0)
    # Between steps only the partitions stay, as in full fine-tuning (cpu_phases; the ~1.2p B/param once measured
    # here on several ranks were frees on gloo's threads the probe did not see).
    steady = PhaseBytes(int(dev_part), 0, int(host_part))
    moving = PhaseBytes(int(dev_part), int(extra), int(host_part))
    # init: the partition plus the state dict being copied in (on the host on a GPU), and the parameter
    # `GatheredParameters` gathers whole to copy its entry into with a temporary of its size, at most the
    # largest (measured: +2 x 16.4 MB while a 16.4 MB embedding loads)
    init_dev = (int(ckpt) if cpu else 0) + 2 * p * s.largest_param
    init = PhaseBytes(int(dev_part), init_dev, int(host_part), 0 if cpu else int(ckpt))
    return {"steady": steady, "forward": moving, "forward_backward": moving, "optimizer_step": steady, "init": init}
