"""The CPU accelerator's one pool as a table: one rank's bytes per phase by ZeRO stage and offload, checked
against the torch profiler's allocator events of real DeepSpeed runs (probe.py, N = 1, 2, 4 ranks;
benchmarks/estimator.md). The totals are what was measured; the constants measured rather than derived say so.
states.cpu_phases applies the table.

A row is `(bytes per parameter, init, steady, forward, forward_backward, optimizer_step)`: the size is a function
of states.Inputs (P parameters, N ranks, p bytes a parameter, f the largest parameter's share of them), and each
phase's cell says which of the phase's sums it adds to:

    t  the measured total of the rank (device and host are one pool here)
    s  the model states, by the paper's accounting (params, grads, master, Adam moments)
    h  the host's share (offloaded states and pinned staging)             -  not allocated

Buffers are the total's rest (states._split). A sum adds its rows in the table's order (the order is the
arithmetic's, so the estimate is the same to the byte whatever the table's layout). It checks the sums, not the
device/host split.
"""

from __future__ import annotations

# Optimizer offload's pinned staging, B/param (measured): ZeRO-1/2 ~1.3 per rank, ZeRO-3 ~2 over N. Page-locked
# host memory, so the estimate counts it on the host.
PINNED_STAGING_12, PINNED_STAGING_3 = 1.3, 2.0

# Measured, not in the paper: ZeRO-2's backward on several ranks holds ~1 B/param more (gloo's reduce-scatter
# clones its input); freed by the step (it once seemed to stay: frees on gloo's threads the probe did not see,
# probe.allocator_events)
GLOO_REDUCE_SCATTER_COPY = 1.0
# ZeRO-3 on one rank keeps ~0.34p B/param beyond its partitions between steps (measured; on several ranks,
# every allocator thread counted, within 0.02 B/param of them: the ~(1.2p + 0.3) once measured there were frees
# on gloo's threads the probe did not see)
ZERO3_ONE_RANK_RESIDENT = 0.34
# ZeRO-3's init on several ranks: 0.8p B/param of the parameters zero.Init gathers, up to its caps (measured)
ZERO3_INIT_GATHERED = 0.8

ZERO0_MIXED = (
    # Every rank holds everything. bf16/fp16: the BF16/FP16 optimizer takes one zero step at init to create
    # Adam's state, so init costs what a step does.
    # size                                          init steady fwd   fwd_bwd step
    (lambda t: t.p,                                   "t",  "ts",  "ts", "ts",  "ts"),  # the params
    (lambda t: 4,                                     "t",  "ts",  "ts", "ts",  "ts"),  # the fp32 master copy
    (lambda t: t.o,                                   "t",  "ts",  "ts", "ts",  "ts"),  # Adam's moments
    (lambda t: 4,                                     "t",  "-",   "-",  "ts",  "ts"),  # fp32 accumulated grads
    (lambda t: t.p,                                   "t",  "-",   "-",  "-",   "t"),   # the step's 16-bit copy
    (lambda t: t.temp * t.f,                          "t",  "-",   "-",  "-",   "t"),   # AdamW's temporaries
    (lambda t: 4,                                     "s",  "-",   "-",  "-",   "-"),   # the fp32-built model
)  # fmt: skip

ZERO0_FP32 = (
    # size                                          init steady fwd   fwd_bwd step
    (lambda t: t.p,                                   "-",  "ts",  "ts", "ts",  "ts"),  # the params
    (lambda t: t.o,                                   "-",  "ts",  "ts", "ts",  "ts"),  # Adam's moments
    (lambda t: 4,                                     "-",  "-",   "-",  "ts",  "ts"),  # fp32 grads
    (lambda t: 4,                                     "-",  "-",   "-",  "t",   "-"),   # their flat all-reduce copy
    (lambda t: t.temp * t.f,                          "-",  "-",   "-",  "-",   "t"),   # AdamW's temporaries
    (lambda t: 4,                                     "ts", "-",   "-",  "-",   "-"),   # the fp32-built model
)  # fmt: skip


def _zero12_grads(t) -> float:
    """ZeRO-1 keeps every param's full grad until the step, beside its reduced partition; ZeRO-2 the partition."""
    return t.p + t.p / t.N if t.stage == 1 else t.p / t.N


def _zero2_reduce(t) -> float:
    """ZeRO-2's reduce in buckets: the grad of the param in flight (reduced, then copied into the partition), the
    bucket, and gloo's copy on several ranks."""
    if t.stage == 1:
        return 0
    copy = GLOO_REDUCE_SCATTER_COPY if t.N > 1 else 0.0
    return 2 * t.p * t.f + t.reduce_bucket * t.p * t.overlap / t.P + copy


ZERO12 = (
    # size                                          init steady fwd   fwd_bwd step
    (lambda t: t.p,                                   "t",  "ts",  "ts", "ts",  "ts"),  # low-precision params
    (lambda t: (t.m + t.o) / t.N,                     "-",  "ts",  "ts", "ts",  "ts"),  # master + Adam parts
    (lambda t: 4,                                     "ts", "-",   "-",  "-",   "-"),   # the fp32-built model
    (lambda t: t.m / t.N,                             "ts", "-",   "-",  "-",   "-"),   # its master partition
    (_zero12_grads,                                   "-",  "-",   "-",  "ts",  "-"),
    (_zero2_reduce,                                   "-",  "-",   "-",  "t",   "-"),
    # the step: the reduced partition and its fp32 copy for the update, and the larger of AdamW's temporaries
    # and the grad norm's fp64 copy of one param's piece under ZeRO-2 (states.grad_norm_transient)
    (lambda t: (t.p + t.m) / t.N,                     "-",  "-",   "-",  "-",   "ts"),
    (lambda t: max(t.temp / t.N, t.grad_norm),        "-",  "-",   "-",  "-",   "t"),
)  # fmt: skip

ZERO12_OFFLOAD = (
    # Master, Adam and an fp32 grad partition live on the host (16/N); measured beyond that: ~1.3 B/param of
    # pinned staging and ~1/N of DeepSpeedCPUAdam's flat views. init: the low-precision model and its flat copy
    # go to the device, the fp32 partitions to the host. The pinned staging is host memory by definition
    # (page-locked for the copies); measured here, where device and host are one pool, so the split is
    # reasoned, not GPU-measured.
    # size                                          init  steady fwd   fwd_bwd step
    (lambda t: t.p,                                   "tsh", "ts",  "ts", "ts",  "ts"),  # low-precision params
    (lambda t: PINNED_STAGING_12,                     "-",   "th",  "th", "th",  "th"),  # pinned staging
    (lambda t: (2 * t.m + t.o + 1) / t.N,             "-",   "t",   "t",  "t",   "t"),   # host partitions, views
    (lambda t: (2 * t.m + t.o) / t.N,                 "s",   "sh",  "sh", "sh",  "sh"),  # master, grad, Adam
    (lambda t: t.p * (1 + t.f),                       "-",   "-",   "-",  "t",   "-"),   # grads, one in flight
    (lambda t: t.p,                                   "-",   "-",   "-",  "s",   "-"),   # the grads' state
    (lambda t: t.p if t.N > 1 else 0,                 "-",   "-",   "-",  "-",   "t"),   # the reduced grads
    (lambda t: 1,                                     "th",  "-",   "-",  "-",   "-"),   # init, measured
    (lambda t: 10 / t.N,                              "th",  "-",   "-",  "-",   "-"),   # init, measured
    (lambda t: -2 * t.p,                              "h",   "-",   "-",  "-",   "-"),   # 16-bit model + copy
)  # fmt: skip


def _zero3_partitions(t) -> float:
    """Params, grads, master and Adam, all partitioned. Under optimizer offload the grads live in the host's
    master-dtype partition (2m + o = 16/N with master and Adam in fp32), with ~2/N of pinned staging beyond that
    (measured)."""
    return (t.p + 2 * t.m + t.o + PINNED_STAGING_3) / t.N if t.off_opt else (2 * t.p + t.m + t.o) / t.N


def _zero3_host(t) -> float:
    """The offloaded states and their pinned staging: with offload, zero.Init builds the partitions on the host."""
    return ((2 * t.m + t.o + PINNED_STAGING_3) / t.N if t.off_opt else 0) + (t.p / t.N if t.off_par else 0)


def _zero3_init(t) -> float:
    """What zero.Init holds beyond the partitions while it builds the model (measured)."""
    if t.N > 1:
        return ZERO3_INIT_GATHERED * t.p * min(1.0, (t.live_cap + t.sub_group) / t.P)
    return ZERO3_ONE_RANK_RESIDENT * t.p


ZERO3 = (
    # size                                                init steady fwd   fwd_bwd step
    (lambda t: 0.0 if t.N > 1 else ZERO3_ONE_RANK_RESIDENT * t.p, "-", "t", "t", "t", "t"),
    (_zero3_partitions,                                     "s", "ts",  "ts", "ts",  "ts"),
    (lambda t: -_zero3_host(t),                             "s", "s",   "s",  "s",   "s"),   # on the host
    (_zero3_host,                                           "h", "h",   "h",  "h",   "h"),
    # forward and backward: the other ranks' shards gathered, up to the live cap
    (lambda t: t.p * min(1 - 1 / t.N, t.live_cap / t.P),   "-", "-",   "t",  "t",   "-"),
    # the grad of the param in flight and its reduced copy, and the reduce bucket
    (lambda t: 2 * t.p * t.f,                               "-", "-",   "-",  "t",   "-"),
    (lambda t: t.reduce_bucket * t.p * t.overlap / t.P,    "-", "-",   "-",  "t",   "-"),
    # measured: ~p/2 more while grads stream to the host under optimizer offload
    (lambda t: t.p / 2 if t.off_opt else 0,                 "-", "-",   "-",  "t",   "-"),
    # the step: the fp32 grad partition and AdamW's temporaries (DeepSpeedCPUAdam under offload: none)
    (lambda t: 0 if t.off_opt else (t.m + t.temp) / t.N,    "-", "-",   "-",  "-",   "t"),
    (_zero3_init,                                           "t", "-",   "-",  "-",   "-"),
    (lambda t: (t.p + 10) / t.N,                            "t", "-",   "-",  "-",   "-"),
)  # fmt: skip


def rows(stage: int, offload_optimizer: bool, mixed: bool) -> tuple:
    """The table of a ZeRO stage and optimizer offload (ZeRO-0 by precision, ZeRO-3 offload within its rows)."""
    if stage == 0:
        return ZERO0_MIXED if mixed else ZERO0_FP32
    if stage in (1, 2):
        return ZERO12_OFFLOAD if offload_optimizer else ZERO12
    return ZERO3
