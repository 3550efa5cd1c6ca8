"""Model states and DeepSpeed's own buffers on one rank, by ZeRO stage, offload and phase.

Two accountings, because host and device are one pool on the CPU accelerator and two on a GPU:

- `gpu_phases`: what lives on the GPU and what on the host, term by term from DeepSpeed 0.19.8's code (each
  term cites the file and function that allocates it). This is what tools/estimate_memory.py reports.
- `cpu_phases`: the one-pool totals, checked against the torch profiler's allocator events of real DeepSpeed
  runs on the CPU accelerator (zero_recipes/memory/probe.py, N = 1, 2, 4 ranks; benchmarks/estimator.md);
  the constants that are measured rather than derived say so. It checks the sums, not the device/host split.

p: bytes of a training parameter (2 in bf16/fp16, 4 in fp32). N: data-parallel ranks. F: the largest
single parameter (usually the embedding). Adam's two moments are fp32 (8 B), so is the master copy (4 B).

LoRA (`Setup.trainable` below the parameter count): only the optimizer's parameters get grads, master copies,
Adam moments and the buffers sized by them, so the trainable part is the same accounting over the trainable
parameters alone; the frozen base adds its weights at p bytes (`frozen_phases`), partitioned under ZeRO-3.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

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
    """Bytes per parameter of ZeRO-2's gradient norm at the step: zero/stage_1_and_2.py `get_grad_norm_direct`
    takes each param's piece of the rank's grad partition to fp64 (`get_norm_dtype`, wherever the device has
    fp64) before its norm, one piece at a time: 8 B x the largest piece, at most the partition (`largest`: the
    largest param as a share of all of them). Hidden under the per-tensor AdamW's 8 B x partition; measured on the
    CPU once fused AdamW allocated none: +67.6 MB at the step of a 1-rank ZeRO-2 bf16 run whose largest param is
    8.2M (8 x 8.2M = 65.5 MB). ZeRO-1 runs the same code, but measured less of it (+33.8 MB for 2 ranks where this
    gives 65.5; none on a pipeline stage), so it is left out there until it is understood."""
    return 8 * min(largest, 1 / world) if stage == 2 else 0.0


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


# Optimizer offload's pinned staging, B/param (measured on the CPU accelerator): ZeRO-1/2 ~1.3 per rank,
# ZeRO-3 ~2 over N. Page-locked host memory, so the estimate counts it on the host.
PINNED_STAGING_12, PINNED_STAGING_3 = 1.3, 2.0


def _bucket(zero: dict, key: str, default: float) -> float:
    value = zero.get(key, default)
    return float(value) if isinstance(value, (int, float)) else default


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
    """The CPU accelerator's one pool: bytes of one rank in each phase, activations excluded.
    Totals are per parameter; `states` and `host` follow the paper's accounting, `buffers` are the rest.
    One branch per ZeRO stage and offload, kept in one function (over 60 lines) so the accounting of the
    cases reads side by side."""
    P, N, p, f = s.num_params, s.world, s.bytes_per_param, s.largest_param / s.num_params
    off_opt, off_par = s.offload_optimizer is not None, s.offload_param is not None
    temp = s.adam_temporaries if not off_opt else 0
    overlap = 2 if s.zero.get("overlap_comm") else 1
    bucket = _bucket(s.zero, "reduce_bucket_size", 5e8) * p * overlap / P  # per parameter, like the rest
    cap = _bucket(s.zero, "stage3_max_live_parameters", 1e9) + _bucket(s.zero, "stage3_prefetch_bucket_size", 5e7)
    if s.stage == 0:
        # Every rank holds everything. Backward: fp32 grads plus DeepSpeed's flat fp32 copy for the all-reduce,
        # or, in bf16, the BF16_Optimizer's fp32 accumulators. The BF16_Optimizer takes one zero step at
        # init to create Adam's state, so init costs what a step does.
        master = 4 if s.mixed else 0
        steady = p + master + 8
        total = {
            "steady": steady,
            "forward_backward": steady + (4 if s.mixed else 8),
            "optimizer_step": steady + 4 + (p if s.mixed else 0) + temp * f,
        }
        total["init"] = total["optimizer_step"] if s.mixed else 4
        states = {"steady": steady, "forward_backward": steady + 4, "optimizer_step": steady + 4, "init": 4}
        host = dict.fromkeys(total, 0.0)
    elif s.stage in (1, 2) and not off_opt:
        steady = p + 12 / N  # low-precision params, fp32 master + Adam partitions
        # measured, not in the paper: ZeRO-2's backward on several ranks holds ~1 B/param more (gloo's
        # reduce-scatter clones its input); freed by the step (it once seemed to stay: frees on gloo's threads
        # the probe did not see, probe.allocator_events)
        staging = 1.0 if s.stage == 2 and N > 1 else 0.0
        grads = p + p / N if s.stage == 1 else p / N  # ZeRO-1 keeps full grads until the step
        # ZeRO-2: the grad of the param in flight (reduced, then copied into the partition) and the bucket
        extra = 0 if s.stage == 1 else 2 * p * f + bucket + staging
        total = {
            "steady": steady,
            "forward_backward": steady + grads + extra,
            # the reduced partition, its fp32 copy for the update, and the larger of AdamW's temporaries and the
            # grad norm's fp64 copy of one param's piece under ZeRO-2 (`grad_norm_transient`)
            "optimizer_step": steady + (p + 4) / N + max(temp / N, grad_norm_transient(s.stage, f, N)),
            # the fp32-built model, its low-precision flat copy, the fp32 partition
            "init": 4 + p + 4 / N,
        }
        states = {
            "steady": steady,
            "forward_backward": steady + grads,
            "optimizer_step": steady + (p + 4) / N,
            "init": 4 + 4 / N,
        }
        host = dict.fromkeys(total, 0.0)
    elif s.stage in (1, 2):
        # Optimizer offload: master, Adam and an fp32 grad partition live on the host (16/N); measured beyond
        # that: ~1.3 B/param of pinned staging and ~1/N of DeepSpeedCPUAdam's flat views
        steady = p + PINNED_STAGING_12 + 17 / N
        total = {
            "steady": steady,
            "forward_backward": steady + p * (1 + f),
            "optimizer_step": steady + (p if N > 1 else 0),
            "init": p + 1 + 10 / N,
        }
        states = {
            "steady": p + 16 / N,
            "forward_backward": p + 16 / N + p,
            "optimizer_step": p + 16 / N,
            "init": p + 16 / N,
        }
        # init: the low-precision model and its flat copy go to the device, the fp32 partitions to the host.
        # The pinned staging is host memory by definition (page-locked for the copies); on the CPU accelerator,
        # where it was measured, device and host are one pool, so this split is reasoned, not GPU-measured.
        host = {k: (total[k] - 2 * p if k == "init" else 16 / N + PINNED_STAGING_12) for k in total}
    else:
        # ZeRO-3. Between steps only the partitions stay (measured on 2 ranks, every allocator thread
        # counted: within 0.02 B/param of them; the ~(1.2p + 0.3) B/param once measured here were frees on
        # gloo's threads the probe did not see, probe.allocator_events); on one rank ~0.34p remains.
        sub_group = _bucket(s.zero, "sub_group_size", 1e9)
        resident = 0.0 if N > 1 else 0.34 * p
        gathered = p * min(1 - 1 / N, cap / P)  # forward/backward: the other ranks' shards, up to the cap
        part = (2 * p + 12) / N  # params, grads, master, Adam: all partitioned
        if off_opt:
            # grads live in the host's fp32 partition (16/N with master and Adam); measured beyond that:
            # ~2/N of pinned staging, and ~p/2 more in backward while grads stream to the host
            part = (p + 16 + PINNED_STAGING_3) / N
        steady = resident + part
        total = {
            "steady": steady,
            "forward_backward": steady + gathered + 2 * p * f + bucket + (p / 2 if off_opt else 0),
            "optimizer_step": steady + (0 if off_opt else (4 + temp) / N),
            "init": (0.8 * p * min(1.0, (cap + sub_group) / P) if N > 1 else 0.34 * p) + (p + 10) / N,
        }
        # the offloaded states and their pinned staging
        host_part = ((16 + PINNED_STAGING_3) / N if off_opt else 0) + (p / N if off_par else 0)
        states = dict.fromkeys(total, part - host_part)  # on the device
        host = dict.fromkeys(total, host_part)  # with offload, zero.Init builds the partitions on the host
    # What is live during the forward, before any grad exists: activations add to this, while the grads'
    # transient comes after most activations are freed (measured: the fwd/bwd peak is the larger of the two)
    forward_extra = p * min(1 - 1 / N, cap / P) if s.stage == 3 else 0
    total["forward"], states["forward"], host["forward"] = (
        total["steady"] + forward_extra,
        states["steady"],
        host["steady"],
    )
    return {k: _split(total[k] * P, states[k] * P, host[k] * P) for k in total}


def gpu_phases(s: Setup) -> dict[str, PhaseBytes]:
    """ZeRO-1/2/3 on a GPU: device and host bytes of one rank per phase, from DeepSpeed 0.19.8's code paths.
    Paths are under deepspeed/runtime/. Over 60 lines: the terms of each stage read side by side."""
    P, N, p, f = s.num_params, s.world, s.bytes_per_param, s.largest_param / s.num_params
    off_opt, off_par = s.offload_optimizer is not None, s.offload_param is not None
    temp = s.adam_temporaries if not off_opt else 0  # DeepSpeedCPUAdam (offload) allocates none
    rbs = _bucket(s.zero, "reduce_bucket_size", 5e8) / P  # elements per parameter
    dev: dict[str, list[float]] = {}  # phase -> [device states, device buffers, host states, host buffers]
    if s.stage in (1, 2):
        # engine.py `_configure_distributed_model`: the module is cast to 16 bits on the host
        # (`_cast_module_mixed_precision`) and only then moved (`self.module.to(self.device)`): p on the device,
        # never the fp32 copy. zero/stage_1_and_2.py `DeepSpeedZeroOptimizer.__init__`: the params become views
        # of `bit16_groups_flat`, and the fp32 master partition `single_partition_of_fp32_groups` is made on
        # `self.device`, the host under offload_optimizer.
        master_dev = 0 if off_opt else 4 / N
        # torch AdamW (or DeepSpeedCPUAdam under offload) makes exp_avg and exp_avg_sq at the first step: 8/N
        adam_dev = 0 if off_opt else 8 / N
        # ZeRO-2 `copy_grads_in_partition`: `grads_in_partition`, p/N, allocated at the first backward and kept
        # (on the device without offload; with offload the reduced grads go to the host's fp32 grad partition)
        grad_part = p / N if (s.stage == 2 and not off_opt) else 0
        # offload: `temp_grad_buffer_for_gpu_offload`, the largest param's size, on the device
        staging_dev = p * f if off_opt else 0
        steady = p + master_dev + adam_dev + grad_part
        # `setup_buckets`: one reduce bucket of reduce_bucket_size (two with overlap_comm) in the grad dtype, made
        # in the backward's prologue, while every activation is still alive, and kept from then on
        buckets = rbs * p * (2 if s.zero.get("overlap_comm") else 1)
        # ZeRO-1 reduces at the end of backward (`reduce_gradients`): every param's grad (p, counted with the
        # states) is alive until then, reduced bucket by bucket; ZeRO-2 reduces in buckets as grads arrive: the
        # param in flight and its copy (2pf) plus the buckets
        in_flight = 0 if s.stage == 1 else 2 * p * f
        # host: master 4/N and its grad 4/N (`initialize_optimizer_states`, pinned when pin_memory), Adam 8/N;
        # buffers: `param_buffer_of_bit16_for_cpu_offload_groups` p/N, `temp_grad_buffer_for_cpu_offload` pf
        host_states = 16 / N if off_opt else 0
        host_buffers = (p / N + p * f) if off_opt else 0
        dev = {
            # `bit16_groups_flat` is flattened on the device only when `available_memory()` has room for the
            # copy, else on the host (`flatten_on_accelerator`): the copy never sets a peak. Adam not made yet.
            "init": [p + master_dev, 0, host_states / 2, host_buffers],
            "steady": [steady, staging_dev + buckets, host_states, host_buffers],
            "forward": [steady, staging_dev + buckets, host_states, host_buffers],
            "forward_backward": [
                steady + (p if s.stage == 1 else 0),
                staging_dev + buckets + in_flight,
                host_states,
                host_buffers,
            ],
            # `step`: the fp32 grad partition (4/N, `get_flat_partition`) next to the 16-bit one on the device, and
            # the larger of an unfused torch AdamW's temporaries (sqrt, then the division: 8 B per element it
            # steps) and the grad norm's fp64 copy of one param's piece (`grad_norm_transient`)
            "optimizer_step": [
                steady + (0 if off_opt else 4 / N),
                staging_dev + buckets + (0 if off_opt else p / N + max(temp / N, grad_norm_transient(s.stage, f, N))),
                host_states,
                host_buffers,
            ],
        }
    else:
        # zero/partition_parameters.py `Init`: each module is built, then partitioned; p/N params stay, on the
        # host (pinned, stage3.py `_create_param_groups_fp16_flat_cpu_memory`) under offload_param.
        params_dev = 0 if off_par else p / N
        # stage3.py `DeepSpeedZeroOptimizer_Stage3`: `grad_partitions_flat_buffer` p/N and the fp32 partitions
        # (`_create_fp32_partitions`, 4/N) on `self.device`, the host under offload_optimizer; Adam 8/N with them
        opt_dev = 0 if off_opt else (p + 12) / N
        # the sub-group's fp32 grad during `step` (`_prepare_fp32_grad_for_sub_group`): sub_group_size at most
        sub_group = 4 * min(_bucket(s.zero, "sub_group_size", 1e9) / P, 1 / N)
        cap = (
            _bucket(s.zero, "stage3_max_live_parameters", 1e9) + _bucket(s.zero, "stage3_prefetch_bucket_size", 5e7)
        ) / P
        # params gathered between use and release: the other ranks' shards, and under offload_param this rank's
        # own too (its partition lives on the host and is fetched for compute), up to the live cap
        gathered = p * min(1.0 if off_par else 1 - 1 / N, cap)
        bucket = rbs * p  # `__init__`: one ipg bucket of reduce_bucket_size when contiguous_gradients, kept
        steady = params_dev + opt_dev
        host_states = (p / N if off_par else 0) + ((p + 16) / N if off_opt else 0)
        host_step = sub_group if off_opt else 0
        dev = {
            # a module is built in fp32 before it is partitioned: at most the largest param at 4 B
            "init": [params_dev + (0 if off_opt else (p + 4) / N), 4 * f, host_states - (8 / N if off_opt else 0), 0],
            "steady": [steady, bucket, host_states, 0],
            "forward": [steady, bucket + gathered, host_states, 0],
            "forward_backward": [steady, bucket + gathered + 2 * p * f, host_states, 0],
            # an unfused torch AdamW steps one sub-group at a time: its temporaries are 8 B x the sub-group
            "optimizer_step": [steady, bucket + (0 if off_opt else sub_group * (1 + temp / 4)), host_states, host_step],
        }
    return {k: PhaseBytes(int(a * P), int(b * P), int(c * P), int(d * P)) for k, (a, b, c, d) in dev.items()}


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
    frozen = frozen_phases(s)
    if s.stage in (1, 2) and s.offload_optimizer is not None and (s.accelerator == "cpu"):
        # cpu_phases' offload branch folds `setup_buckets`' reduce bucket (reduce_bucket_size elements, allocated
        # at the first backward) into per-parameter constants measured on a 34M model; over a LoRA's few trainable
        # parameters that share vanishes (measured: 96 MB under), so the bucket is added whole here
        bucket = (
            _bucket(s.zero, "reduce_bucket_size", 5e8) * s.bytes_per_param * (2 if s.zero.get("overlap_comm") else 1)
        )
        fb = frozen["forward_backward"]
        frozen["forward_backward"] = PhaseBytes(fb.states, int(fb.buffers + bucket), fb.host_states, fb.host_buffers)
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
    cap = _bucket(s.zero, "stage3_max_live_parameters", 1e9) + _bucket(s.zero, "stage3_prefetch_bucket_size", 5e7)
    share = 1.0 if (off_par and not cpu) else 1 - 1 / N  # on a GPU, offload_param fetches this rank's share too

    def gathered(n: int) -> float:  # the live-parameter cap applies to frozen and trainable together
        return p * min(share * n, cap)

    extra = gathered(P) - gathered(s.trainable)  # the frozen part of what a forward gathers
    part = p * F / N  # zero/partition_parameters.py `Init`: partitioned like every parameter
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
