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


def _zero12_step(t) -> float:
    """`step`: the 16-bit grad partition (p/N) beside its fp32 copy, and the larger of an unfused torch AdamW's
    temporaries (sqrt, then the division: 8 B per element it steps) and the grad norm's fp64 copy of one param's
    piece (states.grad_norm_transient). DeepSpeedCPUAdam under offload allocates none."""
    return 0 if t.off_opt else t.p / t.N + max(t.temp / t.N, t.grad_norm)


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
    # ZeRO-2 `copy_grads_in_partition`: `grads_in_partition`, allocated at the first backward and kept (with
    # offload the reduced grads go to the host's fp32 grad partition instead)
    (lambda t: t.p / t.N if t.stage == 2 and not t.off_opt else 0, "-", "D", "D", "D", "D"),
    # ZeRO-1 reduces at the end of backward (`reduce_gradients`): every param's grad is alive until then
    (lambda t: t.p if t.stage == 1 else 0,                          "-", "-", "-", "D", "-"),
    # `step`: the fp32 grad partition (`get_flat_partition`) next to the 16-bit one on the device
    (lambda t: 0 if t.off_opt else t.m / t.N,                       "-", "-", "-", "-", "D"),
    # offload: `temp_grad_buffer_for_gpu_offload`, the largest param's size
    (lambda t: t.p * t.f if t.off_opt else 0,                       "-", "d", "d", "d", "d"),
    # `setup_buckets`: one reduce bucket of reduce_bucket_size (two with overlap_comm) in the grad dtype, made in
    # the backward's prologue, while every activation is still alive, and kept from then on
    (lambda t: t.reduce_bucket / t.P * t.p * t.overlap,            "-", "d", "d", "d", "d"),
    # ZeRO-2 reduces in buckets as grads arrive: the param in flight and its copy
    (lambda t: 0 if t.stage == 1 else 2 * t.p * t.f,               "-", "-", "-", "d", "-"),
    (_zero12_step,                                                  "-", "-", "-", "-", "d"),
    # offload, `initialize_optimizer_states` (pinned when pin_memory): the master partition and its grad, ...
    (lambda t: 2 * t.m / t.N if t.off_opt else 0,                   "H", "H", "H", "H", "H"),
    # ... and DeepSpeedCPUAdam's moments, from the first step (bf16 with fp32_optimizer_states=False)
    (lambda t: t.o / t.N if t.off_opt else 0,                       "-", "H", "H", "H", "H"),
    # offload: `param_buffer_of_bit16_for_cpu_offload_groups` and `temp_grad_buffer_for_cpu_offload`
    (lambda t: t.p / t.N if t.off_opt else 0,                       "h", "h", "h", "h", "h"),
    (lambda t: t.p * t.f if t.off_opt else 0,                       "h", "h", "h", "h", "h"),
)  # fmt: skip


def _gathered(t) -> float:
    """Params gathered between use and release: the other ranks' shards, and under offload_param this rank's own
    too (its partition lives on the host and is fetched for compute), up to the live cap
    (stage3_max_live_parameters + stage3_prefetch_bucket_size)."""
    return t.p * min(1.0 if t.off_par else 1 - 1 / t.N, t.live_cap / t.P)


def _sub_group(t) -> float:
    """The sub-group's fp32 grad during `step` (`_prepare_fp32_grad_for_sub_group`): sub_group_size at most."""
    return t.m * min(t.sub_group / t.P, 1 / t.N)


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
    (_gathered,                                                     "-", "-", "d", "d", "-"),
    # the grad of the param in flight and its reduced copy
    (lambda t: 2 * t.p * t.f,                                       "-", "-", "-", "d", "-"),
    # an unfused torch AdamW steps one sub-group at a time: its temporaries are 8 B x the sub-group
    (lambda t: 0 if t.off_opt else _sub_group(t) * (1 + t.temp / 4), "-", "-", "-", "-", "d"),
    # offload: DeepSpeedCPUAdam steps the sub-group's fp32 grad on the host
    (lambda t: _sub_group(t) if t.off_opt else 0,                   "-", "-", "-", "-", "h"),
)  # fmt: skip

PLACES = "DdHh"
"""PhaseBytes' fields in order: states, buffers, host_states, host_buffers."""
