"""ZeRO-1/2/3 on a GPU as a table: every state and buffer DeepSpeed 0.19.8 allocates on one rank, where it lives
and in which phase. Paths are under deepspeed/runtime/; states.gpu_phases applies the table.

A row is `(bytes per parameter, init, steady, forward, forward_backward, optimizer_step)`: the size is a function
of states.Inputs (P parameters, N ranks, p bytes a parameter, f the largest parameter's share of them; 0 where the
run's stage or offload does not make the buffer), and each phase's cell says where the buffer is then:

    D  a model state on the device      d  a buffer on the device
    H  a model state on the host        h  a buffer on the host          -  not allocated

A place's bytes in a phase are its rows added in the table's order (the order is the arithmetic's, so the
estimate is the same to the byte whatever the table's layout).
"""

from __future__ import annotations


def flat_grad_copy(p: float, m: float) -> float:
    """Bytes per element of the step's flat copy of a grad partition in the master's dtype: zero/stage_1_and_2.py
    `step` and stage3.py `_prepare_fp32_grad_for_sub_group` flatten the partition's grads (p B) and cast the flat
    tensor (m B), both alive for the cast; when the dtypes are the same the cast returns the flat tensor itself."""
    return m if p == m else p + m


def _zero12_step(t) -> float:
    """zero/stage_1_and_2.py `step`, one transient after another: the grad norm's fp64 copy of one param's piece
    (states.grad_norm_transient), then the flat 16-bit grad partition with its fp32 copy (`flat_grad_copy`), then
    the fp32 copy beside an unfused torch AdamW's temporaries (sqrt, then the division: 8 B per element it steps).
    The largest sets the peak. Under offload the grads are already on the host and DeepSpeedCPUAdam allocates
    none: 0."""
    if t.off_opt:
        return 0
    return max(t.grad_norm, flat_grad_copy(t.p, t.m) / t.N, (t.m + t.temp) / t.N)


def _offload12_reduce(t) -> float:
    """ZeRO-1/2 offload's bucket reduce on the device, two transients one after the other: on several ranks
    `average_tensor` -> `allreduce_bucket` flattens the bucket's grads (p B x its elements, the model's at most;
    `use_multi_rank_bucket_allreduce`, the default), then `copy_grads_in_partition` ->
    `set_norm_for_param_grad_in_gpu` takes each param's piece to fp64 for its norm (states.offload_norm_transient)
    before the copy to the host."""
    if not t.off_opt:
        return 0
    flat = t.p * min(1.0, t.reduce_bucket / t.P) if t.N > 1 else 0.0
    return max(t.off_norm, flat)


ZERO12 = (
    # size                                                        init steady fwd  fwd_bwd step
    # engine.py `_configure_distributed_model`: the module is cast to 16 bits on the host
    # (`_cast_module_mixed_precision`) and only then moved (`self.module.to(self.device)`): p on the device, never
    # the fp32 copy. zero/stage_1_and_2.py `DeepSpeedZeroOptimizer.__init__`: the params become views of
    # `bit16_groups_flat`, which is flattened on the device only when `available_memory()` has room for the copy,
    # else on the host (`flatten_on_accelerator`): the copy never sets a peak.
    (lambda t: t.p,                                                 "D", "D", "D", "D", "D"),
    # the fp32 master partition `single_partition_of_fp32_groups`, made on `self.device`
    (lambda t: 0 if t.off_opt else t.m / t.N,                       "D", "D", "D", "D", "D"),
    # torch AdamW makes exp_avg and exp_avg_sq at the first step, in the master's dtype (t.o: 8 B, 4 in bf16)
    (lambda t: 0 if t.off_opt else t.o / t.N,                       "-", "D", "D", "D", "D"),
    # `copy_grads_in_partition`: `grads_in_partition`, allocated at the backward (ZeRO-1 too, with
    # contiguous_gradients) and released with the grads at the step, after its flat copy (measured: not between
    # steps); with offload the reduced grads go to the host's fp32 grad partition instead
    (lambda t: t.p / t.N if t.contiguous and not t.off_opt else 0,  "-", "-", "-", "D", "D"),
    # ZeRO-1 reduces at the end of backward (`reduce_gradients`): every param's grad is alive until then
    (lambda t: t.p if t.stage == 1 else 0,                          "-", "-", "-", "D", "-"),
    # offload: `temp_grad_buffer_for_gpu_offload`, the largest param's size, made in `__init__`
    (lambda t: t.p * t.f if t.off_opt else 0,                       "d", "d", "d", "d", "d"),
    # `setup_buckets`: one reduce bucket of reduce_bucket_size (two with overlap_comm) in the grad dtype, made in
    # the backward's prologue, while every activation is still alive, and kept from then on
    (lambda t: t.reduce_bucket / t.P * t.p * t.overlap,            "-", "d", "d", "d", "d"),
    # ZeRO-2 reduces in buckets as grads arrive: the param in flight and its copy
    (lambda t: 0 if t.stage == 1 else 2 * t.p * t.f,               "-", "-", "-", "d", "-"),
    (_offload12_reduce,                                             "-", "-", "-", "d", "-"),
    (_zero12_step,                                                  "-", "-", "-", "-", "d"),
    # offload, `initialize_optimizer_states` (pinned when pin_memory): the master partition and its grad, ...
    (lambda t: 2 * t.m / t.N if t.off_opt else 0,                   "H", "H", "H", "H", "H"),
    # ... and DeepSpeedCPUAdam's moments, from the first step (bf16 with fp32_optimizer_states=False)
    (lambda t: t.o / t.N if t.off_opt else 0,                       "-", "H", "H", "H", "H"),
    # offload: `param_buffer_of_bit16_for_cpu_offload_groups` and `temp_grad_buffer_for_cpu_offload`
    (lambda t: t.p / t.N if t.off_opt else 0,                       "h", "h", "h", "h", "h"),
    (lambda t: t.p * t.f if t.off_opt else 0,                       "h", "h", "h", "h", "h"),
)  # fmt: skip


def gathered(t) -> float:
    """Params gathered between use and release, up to the live cap (stage3_max_live_parameters +
    stage3_prefetch_bucket_size), each whole: zero/partition_parameters.py `_all_gather_dtype` and
    `_all_gather_sequential` gather into a new buffer of the param's full size (partition x world) and copy this
    rank's own shard into it, beside the partition it keeps. On one rank nothing is gathered (the partition is the
    param) unless offload_param keeps it on the host. Measured: every ZeRO-3 run on 2 CPU ranks was under by p/N a
    parameter with the other ranks' shards alone (-7.4 % fp32 at 2 x 512; 68.6 MB against p x P / 2 = 67.6)."""
    return t.p * min(1.0 if (t.off_par or t.N > 1) else 0.0, t.live_cap / t.P)


def _sub_group(t) -> float:
    """The sub-group's fp32 grad during `step` (`_prepare_fp32_grad_for_sub_group`): sub_group_size at most."""
    return t.m * min(t.sub_group / t.P, 1 / t.N)


def _zero3_step(t) -> float:
    """stage3.py `step` on the device, one transient after another: the grad norm's fp64 copy of the largest
    param's partition (`get_grad_norm_direct`, states.grad_norm_transient), a sub-group's flat grad with its
    master-dtype copy (`_prepare_fp32_grad_for_sub_group`, `flat_grad_copy`), then that copy beside an unfused
    torch AdamW's temporaries (8 B x the sub-group). Under offload DeepSpeedCPUAdam steps the host's: none here."""
    if t.off_opt:
        return 0
    share = min(t.sub_group / t.P, 1 / t.N)
    return max(t.grad_norm, flat_grad_copy(t.p, t.m) * share, (t.m + t.temp) * share)


ZERO3 = (
    # size                                                        init steady fwd  fwd_bwd step
    # zero/partition_parameters.py `Init`: each module is built, then partitioned; p/N params stay, on the host
    # (pinned, stage3.py `_create_param_groups_fp16_flat_cpu_memory`) under offload_param
    (lambda t: 0 if t.off_par else t.p / t.N,                       "D", "D", "D", "D", "D"),
    (lambda t: t.p / t.N if t.off_par else 0,                       "H", "H", "H", "H", "H"),
    # stage3.py `DeepSpeedZeroOptimizer_Stage3`: `grad_partitions_flat_buffer` p/N and the fp32 partitions
    # (`_create_fp32_partitions`, 4/N) on `self.device`, the host under offload_optimizer; Adam's 8/N with them
    # from the first step
    (lambda t: 0 if t.off_opt else (t.p + t.m + t.o) / t.N,         "-", "D", "D", "D", "D"),
    (lambda t: 0 if t.off_opt else (t.p + t.m) / t.N,               "D", "-", "-", "-", "-"),
    (lambda t: (t.p + 2 * t.m + t.o) / t.N if t.off_opt else 0,     "H", "H", "H", "H", "H"),
    (lambda t: -t.o / t.N if t.off_opt else 0,                      "H", "-", "-", "-", "-"),  # Adam: not yet
    # a module is built in fp32 before it is partitioned: at most the largest param at 4 B
    (lambda t: 4 * t.f,                                             "d", "-", "-", "-", "-"),
    # `__init__`: one ipg bucket of reduce_bucket_size when contiguous_gradients, kept
    (lambda t: t.reduce_bucket / t.P * t.p,                        "-", "d", "d", "d", "d"),
    (gathered,                                                     "-", "-", "d", "d", "-"),
    # the grad of the param in flight and its reduced copy
    (lambda t: 2 * t.p * t.f,                                       "-", "-", "-", "d", "-"),
    # offload: `partition_grads` -> `_offload_grad_partition_at_boundary` takes each reduced grad partition to
    # fp64 for its norm on the device before the copy to the host (states.offload_norm_transient)
    (lambda t: t.off_norm,                                          "-", "-", "-", "d", "-"),
    (_zero3_step,                                                   "-", "-", "-", "-", "d"),
    # offload: DeepSpeedCPUAdam steps the sub-group's fp32 grad on the host
    (lambda t: _sub_group(t) if t.off_opt else 0,                   "-", "-", "-", "-", "h"),
)  # fmt: skip

PLACES = "DdHh"
"""PhaseBytes' fields in order: states, buffers, host_states, host_buffers."""
