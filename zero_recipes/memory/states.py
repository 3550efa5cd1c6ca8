"""Model states and DeepSpeed's own buffers on one rank, by ZeRO stage, offload and phase.

Bytes per parameter (Psi) follow the ZeRO paper (arXiv 1910.02054) where DeepSpeed does what the paper
says, and DeepSpeed 0.19.8's code where it does more. Every term below was checked against the torch
profiler's allocator events of real DeepSpeed runs on the CPU accelerator (zero_recipes/bench/memory_probe.py,
N = 1, 2, 4 ranks); the constants that are measured rather than derived say so.

p: bytes of a training parameter (2 in bf16/fp16, 4 in fp32). N: data-parallel ranks. F: the largest
single parameter (usually the embedding). Adam's two moments are fp32 (8 B), so is the master copy (4 B).
"""

from __future__ import annotations

from dataclasses import dataclass, field

PHASES = ("init", "forward_backward", "optimizer_step")


@dataclass
class Setup:
    num_params: int
    largest_param: int
    world: int  # data-parallel ranks
    stage: int
    bytes_per_param: int  # p
    mixed: bool  # bf16/fp16 with an fp32 master copy
    offload_optimizer: str | None  # None, "cpu" or "nvme"
    offload_param: str | None
    zero: dict = field(default_factory=dict)  # the resolved zero_optimization block
    # torch's single-tensor AdamW (what runs on a CPU) allocates two temporaries the size of the tensor it
    # steps (sqrt, then the division): 8 B per element. Fused AdamW on CUDA and DeepSpeedCPUAdam allocate none.
    adam_temporaries: bool = False
    zero_init: bool = True  # ZeRO-3 builds the model straight into partitions


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
    """Bytes of one rank in each phase (plus "steady": what stays between steps), activations excluded.
    Totals are per parameter; `states` and `host` follow the paper's accounting, `buffers` are the rest.
    One branch per ZeRO stage and offload, kept in one function (over 60 lines) so the accounting of the
    cases reads side by side."""
    P, N, p, f = s.num_params, s.world, s.bytes_per_param, s.largest_param / s.num_params
    off_opt, off_par = s.offload_optimizer is not None, s.offload_param is not None
    temp = 8 if s.adam_temporaries and not off_opt else 0
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
        # measured, not in the paper: ZeRO-2 on several ranks holds ~1 B/param more (reduce-scatter staging)
        staging = 1.0 if s.stage == 2 and N > 1 else 0.0
        steady += staging
        grads = p + p / N if s.stage == 1 else p / N  # ZeRO-1 keeps full grads until the step
        # ZeRO-2: the grad of the param in flight (reduced, then copied into the partition) and the bucket
        extra = 0 if s.stage == 1 else 2 * p * f + bucket
        total = {
            "steady": steady,
            "forward_backward": steady + grads + extra,
            # the reduced partition, its fp32 copy for the update, and CPU AdamW's temporaries
            "optimizer_step": steady + (p + 4 + temp) / N,
            # the fp32-built model, its low-precision flat copy, the fp32 partition
            "init": 4 + p + 4 / N,
        }
        states = {
            "steady": steady - staging,
            "forward_backward": steady - staging + grads,
            "optimizer_step": steady - staging + (p + 4) / N,
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
        # ZeRO-3. Measured: what stays gathered between steps plus the sub-group gradient buffer,
        # ~(1.2p + 0.3) B per parameter, capped like the gathered params (max_live_parameters +
        # sub_group_size); on one rank nothing is gathered and only ~0.34p remains.
        sub_group = _bucket(s.zero, "sub_group_size", 1e9)
        resident = (1.2 * p + 0.3) * min(1.0, (cap + sub_group) / P) if N > 1 else 0.34 * p
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
