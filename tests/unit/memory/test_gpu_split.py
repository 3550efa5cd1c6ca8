"""The GPU's device/host split follows DeepSpeed 0.19.8's code path (memory/states.py `gpu_phases`), not the CPU
accelerator's one pool. A 7B Llama on 8 GPUs in bf16, the case where the one-pool accounting misled."""

import pytest
from transformers import LlamaConfig

from zero_recipes.memory import Launch, ModelShape, Precomputed, estimate
from zero_recipes.memory.activations import Activations

LLAMA_7B = LlamaConfig(
    hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, vocab_size=32000
)
SHAPE = ModelShape(num_params=6_738_415_616, largest_param=32000 * 4096)
ACT = Activations(bytes=6 * 2**30, per_layer_bytes=6 * 2**30 // 32, method="given")  # a fixed activation term
P = SHAPE.num_params


def zero(stage, **extra):
    z = {"stage": stage, "reduce_bucket_size": 5e8, "stage3_prefetch_bucket_size": 5e7, **extra}
    return {"train_batch_size": 8, "bf16": {"enabled": True}, "fp16": {"enabled": False}, "zero_optimization": z}


def gpu(ds, n=8, accelerator="gpu"):
    return estimate(LLAMA_7B, ds, Launch(n, 1, 1, 2048, accelerator=accelerator), precomputed=Precomputed(SHAPE, ACT))


CPU_OFFLOAD = {"device": "cpu", "pin_memory": True}


@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_init_never_puts_the_fp32_model_on_the_gpu(stage):
    """engine.py casts the module to bf16 on the host before `.to(device)`: the GPU sees the 16-bit params, their
    fp32 master partition, p + 4/N = 2.5 B/param, not the fp32 model's 4 on top (the flat copy is made on the device
    only when it has room: stage_1_and_2.py `flatten_on_accelerator`)."""
    e = gpu(zero(stage))
    assert e.phases["init"]["device_bytes"] / P == pytest.approx(2 + 4 / 8, rel=1e-3)
    assert e.per_gpu["peak_phase"] != "init"  # with activations, training is the peak, as on real GPUs
    assert e.per_node["cpu_bytes"] >= 8 * 4 * P  # the fp32 random-init model is built on the host, per rank


def test_zero2_optimizer_offload_keeps_16bit_weights_and_activations_on_the_gpu():
    """With the optimizer offloaded the GPU holds the bf16 weights (2 B/param), a grad staging buffer of the
    largest param, the reduce buckets and the activations; master, grads and Adam (16/N) are on the host."""
    e = gpu(zero(2, offload_optimizer=CPU_OFFLOAD))
    fb = e.phases["forward_backward"]
    assert fb["model_states_bytes"] / P == pytest.approx(2.0, rel=1e-3)
    assert fb["activations_bytes"] == ACT.bytes
    assert e.per_gpu["peak_phase"] == "forward_backward"
    assert fb["host_bytes"] / P == pytest.approx(16 / 8 + 2 / 8 + 2 * SHAPE.largest_param / P, rel=1e-3)
    assert e.per_node["pinned_bytes"] == 8 * fb["host_bytes"]  # pin_memory, DeepSpeed's default, pins them


def test_zero3_offload_moves_the_states_and_the_sub_group_buffer_to_the_host():
    """stage3.py puts the grad partitions, fp32 master, Adam and the sub-group's fp32 grad on the host under
    offload_optimizer, and the param partitions too under offload_param: the GPU peak falls below plain ZeRO-3's
    by at least those states, and with everything offloaded no model state stays on the GPU."""
    plain = gpu(zero(3))
    opt = gpu(zero(3, offload_optimizer=CPU_OFFLOAD))
    both = gpu(zero(3, offload_optimizer=CPU_OFFLOAD, offload_param=CPU_OFFLOAD))
    moved = (2 + 12) / 8 * P
    assert opt.per_gpu["peak_bytes"] <= plain.per_gpu["peak_bytes"] - 0.99 * moved
    assert both.per_gpu["peak_bytes"] < opt.per_gpu["peak_bytes"]
    assert both.phases["forward_backward"]["model_states_bytes"] == 0
    bucket = 5e8 * 2  # stage3.py keeps one reduce bucket on the device from __init__ on
    # the step runs on the host (DeepSpeedCPUAdam): the GPU holds only that bucket
    assert both.phases["optimizer_step"]["device_bytes"] == pytest.approx(bucket, rel=1e-6)
    # the step's sub-group grad flattened (2 B) and cast to fp32 (4 B), both alive for the cast
    # (`_prepare_fp32_grad_for_sub_group`): 6 B x min(sub_group_size, P/N), on the device only without offload
    step = plain.phases["optimizer_step"]
    assert step["buffers_bytes"] == pytest.approx(6 * P / 8 + bucket, rel=1e-6)


def test_the_cpu_validation_keeps_its_one_pool_accounting():
    """The CPU accelerator has one pool; its accounting (checked against real CPU runs) is asked for by name."""
    one_pool = gpu(zero(2), accelerator="cpu")
    assert one_pool.phases["init"]["device_bytes"] / P == pytest.approx(4 + 2 + 4 / 8, rel=1e-3)


def test_zero1_backward_holds_every_grad_once_plus_the_bucket():
    """ZeRO-1 keeps each param's 16-bit grad until `reduce_gradients` at the end of backward: p once (with the
    states), and the reduce bucket, not the grads a second time as in-flight copies."""
    fb = gpu(zero(1)).phases["forward_backward"]
    # ... and, with contiguous_gradients (the default), `copy_grads_in_partition`'s buffer of the rank's reduced
    # partition (p/N), which the reduce at the backward's end fills
    assert fb["model_states_bytes"] / P == pytest.approx(2 + 12 / 8 + 2 + 2 / 8, rel=1e-3)
    assert fb["buffers_bytes"] == pytest.approx(5e8 * 2, rel=1e-3)


def test_train_pys_host_line_is_per_node_on_many_nodes(monkeypatch):
    # 16 ranks on 2 nodes of 8: without zero.Init each rank loads the fp32 model on its node's host before
    # DeepSpeed moves it, so a node holds 8 copies, as one node of 8 does; 16 was the bug
    from zero_recipes.config.train_config import TrainConfig
    from zero_recipes.memory import for_run

    ds = zero(2) | {"train_batch_size": 16}
    cfg = TrainConfig(per_device_train_batch_size=1, block_size=2048)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    two_nodes, line = for_run(LLAMA_7B, ds, cfg, 16)
    one_node, _ = for_run(LLAMA_7B, ds | {"train_batch_size": 8}, cfg, 8)
    assert two_nodes.per_node["cpu_bytes"] == one_node.per_node["cpu_bytes"] >= 8 * 4 * SHAPE.num_params
    assert f"host {two_nodes.per_node['cpu_bytes'] / 2**30:.2f} GiB per node" in line
