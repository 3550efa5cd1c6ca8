"""The step's transients without offload, one after another in DeepSpeed 0.19.8's `step`: the gradient norm's fp64
copy of one param's piece (zero/stage_1_and_2.py and stage3.py `get_grad_norm_direct`, `get_norm_dtype`), the flat
grad partition with its master-dtype copy, then that copy beside the optimizer's temporaries. Model B (P =
33,790,464, the largest param F = 8,192,000), the MB figures the allocator probe's (benchmarks/estimator.md)."""

import pytest

from zero_recipes.memory.states import Setup, cpu_phases, flat_grad_copy, gpu_phases, grad_norm_transient

P, F = 33_790_464, 8_192_000


def step(stage: int, n: int, p: int = 2, accelerator: str = "cpu", num=P, largest=F) -> int:
    zero = {"reduce_bucket_size": 5e7, "sub_group_size": 1e9}
    s = Setup(num, largest, n, stage, p, p == 2, None, None, zero, accelerator=accelerator)
    b = (cpu_phases if accelerator == "cpu" else gpu_phases)(s)["optimizer_step"]
    return b.states + b.buffers + b.host_states + b.host_buffers


def test_the_norm_copy_is_a_piece_under_zero12_and_a_partition_under_zero3():
    assert grad_norm_transient(1, F / P, 2) * P == pytest.approx(8 * F)
    assert grad_norm_transient(2, 0.9, 4) * P == pytest.approx(8 * P / 4)
    assert grad_norm_transient(3, F / P, 2) * P == pytest.approx(8 * F / 2)
    assert flat_grad_copy(2, 4) == 6 and flat_grad_copy(4, 4) == 4  # fp32 grads: the cast is the flat tensor


@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_bf16_two_ranks_step_is_the_flat_copy_beside_the_kept_grad_partition(stage):
    """2P params, 12P/N master and moments, `copy_grads_in_partition`'s buffer (2P/N, ZeRO-1 too with
    contiguous_gradients), then max(8F norm = 65.5 MB, 6P/N flat + fp32 = 101.4 MB): 405.47 MB measured on both."""
    expected = 2 * P + 12 * P / 2 + 2 * P / 2 + max(8 * F, 6 * P / 2)
    assert step(stage, 2) == pytest.approx(expected, abs=16)
    assert step(stage, 2) / 1e6 == pytest.approx(405.47, rel=1e-4)


def test_zero2_four_ranks_step_is_set_by_the_norm_copy():
    """On 4 ranks the embedding's piece (8.19M of a 8.45M-element partition) outweighs the flat copies: 8F =
    65.5 MB against 6P/4 = 50.7 MB. Measured 251.4 MB."""
    expected = 2 * P + 12 * P / 4 + 2 * P / 4 + 8 * F
    assert 8 * F > 6 * P / 4
    assert step(2, 4) == pytest.approx(expected, abs=16)
    assert step(2, 4) / 1e6 == pytest.approx(251.4, rel=1e-3)


@pytest.mark.parametrize(("p", "n", "measured_mb"), [(2, 2, 372.20), (4, 1, 811.97)])
def test_zero3_step_is_the_sub_groups_flat_copy(p, n, measured_mb):
    """stage3.py: partitions (2p + 4 + 8)/N, then max(8F/N norm, the sub-group's flat grad and its fp32 cast
    (`_prepare_fp32_grad_for_sub_group`: (p + 4)/N in bf16, 4/N in fp32, where the cast is a no-op))."""
    expected = (2 * p + 12) * P / n + max(8 * F / n, flat_grad_copy(p, 4) * P / n)
    assert step(3, n, p) == pytest.approx(expected, abs=16)
    assert step(3, n, p) / 1e6 == pytest.approx(measured_mb, rel=2e-3)


def test_on_a_gpu_a_large_embedding_at_many_ranks_is_set_by_the_norm_copy():
    """A 2B model whose 0.6B-element embedding is more than a rank's partition on 8 GPUs: the piece is the whole
    partition, 8 B/N a parameter, above the flat copies' 6 B/N; on the device at the step."""
    num, largest = 2 * 10**9, 6 * 10**8
    with_norm = step(2, 8, accelerator="gpu", num=num, largest=largest)
    small = step(2, 8, accelerator="gpu", num=num, largest=10**6)  # the flat copy sets it: 6 B/N
    assert with_norm - small == pytest.approx((8 - 6) * num / 8, rel=1e-6)
