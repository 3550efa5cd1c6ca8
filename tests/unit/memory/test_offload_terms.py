"""Optimizer offload's buffers, each from DeepSpeed 0.19.8's code, on model B (benchmarks/estimator.md: P =
33,790,464 parameters, the 16000 x 512 embedding and head the largest, F = 8,192,000), bf16, the shipped
zero2.json's reduce bucket (5e7 elements, overlap_comm off). Each expected figure is the list of buffers DeepSpeed
allocates, written out here; the MB figures beside them are what the allocator probe measured on the CPU
(python tools/benchmark.py estimator, points B zero2+offload_optimizer and zero3+offload_all)."""

import pytest

from zero_recipes.memory.states import (
    ZERO3_NORM_SLICE,
    Inputs,
    Setup,
    cpu_phases,
    gpu_phases,
    offload_norm_transient,
)

P, F = 33_790_464, 8_192_000
BUCKET = 5e7  # zero2.json's reduce_bucket_size, in elements


def setup(stage: int, world: int, accelerator: str = "cpu", **zero) -> Setup:
    z = {"reduce_bucket_size": BUCKET, "overlap_comm": False, "sub_group_size": 1e9, **zero}
    return Setup(P, F, world, stage, 2, True, "cpu", None, z, accelerator=accelerator)


def total(b) -> int:
    return b.states + b.buffers + b.host_states + b.host_buffers


def zero2_offload_steady(n: int) -> float:
    """zero/stage_1_and_2.py under offload_optimizer: bit16_groups_flat (2P), the fp32 master partition and its
    fp32 grad (`initialize_optimizer_states`), DeepSpeedCPUAdam's two fp32 moments (16P/N together),
    param_buffer_of_bit16_for_cpu_offload_groups (2P/N), temp_grad_buffer_for_cpu_offload and
    temp_grad_buffer_for_gpu_offload (2F each)."""
    return 2 * P + 16 * P / n + 2 * P / n + 2 * F + 2 * F


@pytest.mark.parametrize(("n", "measured_mb"), [(1, 874.11), (2, 572.04)])
def test_zero2_offload_backward_is_deepspeeds_buffers(n, measured_mb):
    """The backward's end adds the reduce bucket (`setup_buckets`, 2 B x 5e7) and the larger of the fp64 copy
    `set_norm_for_param_grad_in_gpu` makes of this rank's piece of a param (8 B x F) and, on 2 ranks,
    `allreduce_bucket`'s flat copy of the bucket's grads (2 B x P, the whole model fitting the bucket)."""
    flat = 2 * P if n > 1 else 0
    expected = zero2_offload_steady(n) + 2 * BUCKET + max(8 * F, flat)
    got = total(cpu_phases(setup(2, n))["forward_backward"])
    assert got == pytest.approx(expected, abs=16)
    assert got / 1e6 == pytest.approx(measured_mb, rel=1e-4)


@pytest.mark.parametrize(("n", "measured_mb"), [(1, 708.58), (2, 472.04)])
def test_zero2_offload_step_adds_only_glooss_all_gather_copy(n, measured_mb):
    """At the step DeepSpeedCPUAdam updates the host partition in place; on several ranks gloo's all-gather of the
    16-bit partitions stages its output (2 B x P) in a tensor of its own."""
    expected = zero2_offload_steady(n) + (2 * P if n > 1 else 0)
    got = total(cpu_phases(setup(2, n))["optimizer_step"])
    assert got == pytest.approx(expected, abs=16)
    assert got / 1e6 == pytest.approx(measured_mb, rel=1e-4)


def test_zero2_offload_on_a_gpu_keeps_the_staging_on_the_host_and_the_norm_copy_on_the_device():
    """On a GPU the pinned buffers (master, its grad, the moments, the 16-bit staging, the cpu grad buffer) are host
    memory; the fp64 norm copy is made from the bucket's grad on the device. The CPU accelerator's one pool holds
    the same bytes (test above); only the split differs."""
    fb = gpu_phases(setup(2, 2, accelerator="gpu"))["forward_backward"]
    assert fb.host_states + fb.host_buffers == pytest.approx(16 * P / 2 + 2 * P / 2 + 2 * F, abs=16)
    in_flight = 2 * 2 * F  # the param's grad and its copy into the bucket (states_gpu.ZERO12)
    device = 2 * P + 2 * F + 2 * BUCKET + in_flight + max(8 * F, 2 * P)
    assert fb.states + fb.buffers == pytest.approx(device, abs=16)


def test_offload_norm_copy_is_a_piece_under_zero2_and_a_partition_under_zero3():
    """stage_1_and_2.py takes this rank's piece of the param (at most the partition); stage3.py the param's
    partition (1/N), in slices of 250M elements (`_constant_buffered_norm2`)."""
    assert offload_norm_transient(2, F / P, 2, P) * P == pytest.approx(8 * F)
    assert offload_norm_transient(2, 0.9, 4, P) * P == pytest.approx(8 * P / 4)  # the piece is the partition
    assert offload_norm_transient(3, F / P, 2, P) * P == pytest.approx(8 * F / 2)
    big = 10**10
    assert offload_norm_transient(3, 0.1, 1, big) * big == pytest.approx(8 * ZERO3_NORM_SLICE)
    assert Inputs.of(setup(2, 1)).grad_norm == 0  # under offload the step takes no fp64 copy of its own


@pytest.mark.parametrize(("n", "measured_mb"), [(1, 760.45), (2, 440.97)])
def test_zero3_offload_backward(n, measured_mb):
    """stage3.py under offload_optimizer and offload_param: the 16-bit param partitions (2P/N), the grad partitions
    (`grad_partitions_flat_buffer`, 2P/N), the fp32 master and its grad and Adam (16P/N), all on the host; in the
    backward the head's full grad (2F) beside the fp64 copy of its partition (8F/N), and the params gathered whole
    on 2 ranks (2P, the live cap above P). On 2 ranks the estimate is 3 % over: at the peak (the head's reduce, the
    backward's first) 53 MB of gathered params and gloo's copies are alive, not all 67.6 MB of the model."""
    ds = {"stage3_max_live_parameters": 1e9, "stage3_prefetch_bucket_size": 5e7, "reduce_bucket_size": 262144}
    s = setup(3, n, **ds)
    s.offload_param = "cpu"
    expected = 20 * P / n + 2 * F + 8 * F / n + (2 * P if n > 1 else 0) + 2 * 262144
    got = total(cpu_phases(s)["forward_backward"])
    assert got == pytest.approx(expected, abs=16)
    assert got / 1e6 == pytest.approx(measured_mb, rel=0.04 if n > 1 else 0.005)
