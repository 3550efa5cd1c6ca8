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

from .states_gpu import flat_grad_copy

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


def _zero12_step(t) -> float:
    """The step's transients, one after another (zero/stage_1_and_2.py `step`): the grad norm's fp64 copy of one
    piece (states.grad_norm_transient), then the flat grad partition and its master-dtype copy
    (states.flat_grad_copy), then the optimizer's temporaries beside that copy. The largest sets the peak."""
    return max(t.grad_norm, flat_grad_copy(t.p, t.m) / t.N, (t.m + t.temp) / t.N)


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
    # `copy_grads_in_partition`'s buffer of the rank's reduced grads (ZeRO-1 too, with contiguous_gradients): its
    # views stay the params' grads until the step has made its flat copy
    (lambda t: t.p / t.N if t.contiguous else 0,      "-",  "-",   "-",  "-",   "ts"),
    (_zero2_reduce,                                   "-",  "-",   "-",  "t",   "-"),
    (_zero12_step,                                    "-",  "-",   "-",  "-",   "t"),
)  # fmt: skip


def _offload12_reduce(t) -> float:
    """What reducing a bucket adds under ZeRO-1/2 offload, at the backward's end (or when the bucket fills): the
    larger of two transients that follow one another. zero/stage_1_and_2.py `copy_grads_in_partition` ->
    `set_norm_for_param_grad_in_gpu` takes this rank's piece of each param's grad to fp64 (`get_norm_dtype`) for
    its norm, 8 B x the largest piece (`Inputs.off_norm`); on several ranks `average_tensor` ->
    `allreduce_and_scatter` -> `allreduce_bucket` first flattens the bucket's grads into one tensor (p B x the
    bucket's elements, the model's at most; `use_multi_rank_bucket_allreduce`, DeepSpeed's default). gloo may free
    that flat copy after the norm's copy exists (measured: 637.6 MB on one rank of a 2-rank run under load, where
    the max is 572.0; the benchmark's runs read 572.0): the estimate takes the max, as a GPU frees it at once."""
    flat = t.p * min(1.0, t.reduce_bucket / t.P) if t.N > 1 else 0.0
    return max(t.off_norm, flat)


def _offload12_init(t) -> float:
    """The fp32 model built before DeepSpeed, cast to 16 bits one parameter at a time (engine.py
    `_configure_distributed_model`), where it outweighs the engine's own buffers (many ranks): the excess."""
    engine = t.p + 2 * t.m / t.N + t.p / t.N + 2 * t.p * t.f
    return max(0.0, 4 + t.p * t.f - engine) if t.p < 4 else 0.0


ZERO12_OFFLOAD = (
    # Every row is a buffer of zero/stage_1_and_2.py, measured to the byte on model B (bf16, 1 and 2 ranks,
    # benchmarks/estimator.md; the allocations alive at each peak named by their Python stack). The offloaded
    # states and DeepSpeed's pinned staging are host memory on a GPU (states_gpu.ZERO12 has the split); here they
    # share the one pool with the 16-bit model, so only the sum is checked. The pool hides two GPU differences:
    # `pin_memory` is a no-op on the CPU accelerator, where on a GPU it makes a page-locked copy (the host holds a
    # buffer twice for a moment at init: not modelled), and the gloo copies below are the CPU's alone.
    # size                                          init   steady fwd    fwd_bwd step
    (lambda t: t.p,                                   "ts",  "ts",  "ts",  "ts",  "ts"),  # bit16_groups_flat
    # `__init__`: the fp32 master partition; `initialize_optimizer_states`: its fp32 grad (both pinned on a GPU)
    (lambda t: 2 * t.m / t.N,                         "tsh", "tsh", "tsh", "tsh", "tsh"),
    (lambda t: t.o / t.N,                             "-",   "tsh", "tsh", "tsh", "tsh"),  # DeepSpeedCPUAdam's moments
    # `__init__`: param_buffer_of_bit16_for_cpu_offload_groups (p/N) and temp_grad_buffer_for_cpu_offload (the
    # largest param), host; temp_grad_buffer_for_gpu_offload (the largest param), the device's
    (lambda t: t.p / t.N + t.p * t.f,                 "th",  "th",  "th",  "th",  "th"),
    (lambda t: t.p * t.f,                             "t",   "t",   "t",   "t",   "t"),
    (_offload12_init,                                 "t",   "-",   "-",   "-",   "-"),
    # `setup_buckets` at the first grad (reduce_bucket_size, two with overlap_comm), released after the backward
    (lambda t: t.reduce_bucket * t.p * t.overlap / t.P, "-", "-",   "-",   "t",   "-"),
    (_offload12_reduce,                               "-",   "-",   "-",   "t",   "-"),
    # the step's all-gather of the updated 16-bit partitions: gloo's all_gather_into_tensor stages the whole
    # output in a flat tensor of its own (torch's ProcessGroupGloo allgather); NCCL writes in place
    (lambda t: t.p if t.N > 1 else 0,                 "-",   "-",   "-",   "-",   "t"),
)  # fmt: skip


def _zero3_partitions(t) -> float:
    """Params, grads, master and Adam, all partitioned. Under optimizer offload stage3.py `_setup_for_real_optimizer`
    puts the grad partitions (`grad_partitions_flat_buffer`, p/N) on the host beside the master, its fp32 grad
    (`initialize_optimizer_states`) and Adam: 2p + 2m + o over N, measured to the byte on 1 and 2 ranks."""
    return (2 * t.p + 2 * t.m + t.o) / t.N if t.off_opt else (2 * t.p + t.m + t.o) / t.N


def _zero3_host(t) -> float:
    """The offloaded states and their pinned staging: with offload, zero.Init builds the partitions on the host."""
    return ((t.p + 2 * t.m + t.o) / t.N if t.off_opt else 0) + (t.p / t.N if t.off_par else 0)


def _zero3_in_flight(t) -> float:
    """The backward's transient at a param's reduce: its full grad (p x the largest param) and the reduced copy,
    or under optimizer offload the grad and the fp64 copy its partition's norm takes (measured on 1 and 2 ranks:
    16.4 MB of head grad beside 65.5 and 32.8 MB of fp64)."""
    return t.p * t.f + t.off_norm if t.off_opt else 2 * t.p * t.f


def _zero3_step(t) -> float:
    """stage3.py `step`, one transient after another: the grad norm's fp64 copy of the largest param's partition
    (states.grad_norm_transient), then a sub-group's flat grad and its master-dtype copy
    (`_prepare_fp32_grad_for_sub_group`, states.flat_grad_copy), then that copy beside AdamW's temporaries.
    Under offload: none (DeepSpeedCPUAdam steps the host's partition in place)."""
    if t.off_opt:
        return 0
    share = min(t.sub_group / t.P, 1 / t.N)
    return max(t.grad_norm, flat_grad_copy(t.p, t.m) * share, (t.m + t.temp) * share)


def _zero3_init(t) -> float:
    """What zero.Init holds beyond the partitions while it builds the model (measured)."""
    if t.N > 1:
        return ZERO3_INIT_GATHERED * t.p * min(1.0, (t.live_cap + t.sub_group) / t.P)
    return ZERO3_ONE_RANK_RESIDENT * t.p


ZERO3 = (
    # size                                                init steady fwd   fwd_bwd step
    # measured on one rank without offload, between the steps' ends (none at the step, none under offload)
    (lambda t: 0.0 if t.N > 1 or t.off_opt else ZERO3_ONE_RANK_RESIDENT * t.p, "-", "t", "t", "t", "-"),
    (_zero3_partitions,                                     "s", "ts",  "ts", "ts",  "ts"),
    (lambda t: -_zero3_host(t),                             "s", "s",   "s",  "s",   "s"),   # on the host
    (_zero3_host,                                           "h", "h",   "h",  "h",   "h"),
    # forward and backward: the params gathered whole, up to the live cap (states_gpu.gathered)
    (lambda t: t.p * min(1.0 if t.N > 1 else 0.0, t.live_cap / t.P), "-", "-", "t", "t", "-"),
    # the grad of the param in flight and its reduced copy; under optimizer offload the grad and its partition's
    # fp64 norm copy (`_offload_grad_partition_at_boundary`, states.offload_norm_transient), then the reduce bucket
    (_zero3_in_flight,                                      "-", "-",   "-",  "t",   "-"),
    (lambda t: t.reduce_bucket * t.p * t.overlap / t.P,    "-", "-",   "-",  "t",   "-"),
    (_zero3_step,                                           "-", "-",   "-",  "-",   "t"),
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
