"""The memory estimate under tensor parallelism (DeepSpeed's AutoTP), against first principles and against a
real AutoTP-split model. The real split runs DeepSpeed's own `deepspeed.initialize` in one subprocess on torch's
fake process group (rank 0 of a world of tp or more; collectives do nothing, shapes and allocations are real):
no launcher, a few seconds each."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from helpers import ESTIMATE_OVER, ESTIMATE_UNDER, REPO, small_llama
from zero_recipes.config import ConfigError
from zero_recipes.memory import Launch, ModelShape, activation_bytes, estimate
from zero_recipes.memory.states import Setup, phases
from zero_recipes.model import meta_model

# One rank of an AutoTP group, built by real DeepSpeed: its parameter count and shapes, and optionally the peak
# live bytes of one forward/backward of the split model, measured by the estimate tests' one function
# (zero_recipes.bench.common.fwd_bwd_peak_bytes: grads dropped as made, allocator events).
AUTOTP_RANK = r"""
import json, os, sys
import torch, torch.distributed as tdist
from torch.testing._internal.distributed.fake_pg import FakeStore

spec = json.loads(sys.argv[1])
tdist.init_process_group("fake", store=FakeStore(), rank=0, world_size=spec["world"])
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(spec["world"]), LOCAL_WORLD_SIZE=str(spec["world"]))
import deepspeed
from deepspeed.utils import groups
from transformers import AutoConfig, AutoModelForCausalLM
from zero_recipes.bench.common import fwd_bwd_peak_bytes

deepspeed.init_distributed(dist_backend="fake")
groups._init_tp_mesh_device(tensor_model_parallel_size=spec["tp"])
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **spec["config"]), attn_implementation="sdpa")
ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
      "tensor_parallel": {"autotp_size": spec["tp"]}, "zero_optimization": {"stage": 0},
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
engine, *_ = deepspeed.initialize(model=model, config=ds, model_parameters=model.parameters(), mpu=groups)
module = engine.module
out = {"params": sum(p.numel() for p in {id(p): p for p in module.parameters()}.values()),
       "shapes": {n: list(p.shape) for n, p in module.named_parameters()}}
if spec.get("micro"):
    engine.first_dataloader_check.remove()  # its object broadcast means nothing on a fake group
    out["fwd_bwd_peak"] = fwd_bwd_peak_bytes(module, module.config, spec["micro"], spec["seq"])
print("AUTOTP " + json.dumps(out))
"""

SMALL = {
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 688,
    "vocab_size": 8000,
}


def autotp_rank(config: dict, tp: int, world: int, micro: int = 0, seq: int = 0) -> dict:
    spec = {"config": config, "tp": tp, "world": world, "micro": micro, "seq": seq}
    proc = subprocess.run(
        [sys.executable, "-c", AUTOTP_RANK, json.dumps(spec)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("AUTOTP ")), None)
    assert line, proc.stderr[-3000:]
    return json.loads(line[len("AUTOTP ") :])


def named_sizes(config) -> dict[str, int]:
    return {n: p.numel() for n, p in meta_model(config).named_parameters()}


def test_tp2_halves_the_split_layers_and_keeps_embedding_and_norms_whole():
    """From the names alone: q/k/v/o/gate/up/down and the (untied) head split in two, the embedding and the
    norms whole; the per-rank count is exactly that, and TP4 quarters the same layers."""
    config = small_llama()
    sizes = named_sizes(config)
    whole = sum(n for k, n in sizes.items() if "embed_tokens" in k or "norm" in k)
    split = sum(sizes.values()) - whole
    assert whole > 0 and split > 0
    one, two, four = (ModelShape.of(config, tp=t) for t in (1, 2, 4))
    assert two.num_params == whole + split // 2 and four.num_params == whole + split // 4
    assert two.model_params == one.num_params == sum(sizes.values())
    assert two.largest_param == sizes["model.embed_tokens.weight"]  # the embedding stays whole, the largest
    assert not two.vocab_parallel


def test_tp2_model_states_scale_with_the_split_and_zero_partitions_over_dp():
    """ZeRO-2 bf16 on a GPU: TP2 on 4 GPUs holds the states of a 2-rank ZeRO-2 over one TP rank's parameters;
    the sharded weights' bytes are half TP1's, the embedding's equal."""
    config = small_llama()
    sizes = named_sizes(config)
    emb = sizes["model.embed_tokens.weight"]
    zero2 = {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
    tp2 = {**zero2, "tensor_parallel": {"autotp_size": 2}}
    e1 = estimate(config, zero2, Launch(2, seq_len=16))
    e2 = estimate(config, tp2, Launch(4, seq_len=16))
    assert (e2.tensor_parallel, e2.data_parallel, e1.data_parallel) == (2, 2, 2)
    # model states are linear in the parameter count at a fixed N: compare the split and the whole part
    per_param = e1.phases["optimizer_step"]["model_states_bytes"] / e1.num_params
    sharded_tp1 = (e1.num_params - emb - _norms(sizes)) * per_param
    sharded_tp2 = e2.phases["optimizer_step"]["model_states_bytes"] - (emb + _norms(sizes)) * per_param
    assert sharded_tp2 == pytest.approx(sharded_tp1 / 2, rel=1e-6)
    s = Setup(e2.params_per_rank, emb, 2, 2, 2, True, None, None, {"stage": 2})
    assert e2.phases["optimizer_step"]["model_states_bytes"] == phases(s)["optimizer_step"].states
    # host RAM at init: every rank builds the whole model before AutoTP splits it
    assert e2.per_node["cpu_bytes"] == 4 * 4 * e2.num_params


def _norms(sizes: dict) -> int:
    return sum(n for k, n in sizes.items() if "norm" in k)


def test_activations_inside_attention_and_mlp_divide_the_residual_stream_does_not():
    """Per layer, TP2 saves less than TP1 but more than half: the norms, the residual stream and the column
    layers' inputs stay whole; the loss region (a gathered head: full logits) does not shrink at all."""
    config = small_llama()
    a1, a2 = (activation_bytes(config, 2, 256, torch.bfloat16, False, "sdpa", None, t) for t in (1, 2))
    assert a1.method == a2.method == "traced"
    assert a1.per_layer_bytes / 2 < a2.per_layer_bytes < a1.per_layer_bytes
    layers = config.num_hidden_layers
    loss1, loss2 = a1.bytes - layers * a1.per_layer_bytes, a2.bytes - layers * a2.per_layer_bytes
    assert loss2 == loss1


def test_world_not_divisible_by_tp_is_refused():
    config = small_llama()
    ds = {"zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": 2}}
    with pytest.raises(ConfigError, match="multiple of tensor_parallel.autotp_size"):
        estimate(config, ds, Launch(3, seq_len=16))


@pytest.mark.parametrize(("tie", "tp", "world"), [(False, 2, 4), (True, 2, 2)])
def test_per_rank_count_is_a_real_autotp_split(tie, tp, world):
    """DeepSpeed's own split, with an mpu of a (data, tensor) mesh as train.py builds: the same per-rank count
    and shapes; a tied embedding and head become one vocabulary shard (engine.py `_apply_autotp_partitioning`)."""
    fields = {**SMALL, "tie_word_embeddings": tie}
    real = autotp_rank(fields, tp, world)
    shape = ModelShape.of(small_llama(**fields), tp=tp)
    assert shape.num_params == real["params"]
    assert shape.largest_param == max(torch.Size(s).numel() for s in real["shapes"].values())
    assert shape.vocab_parallel == tie
    assert real["shapes"]["model.embed_tokens.weight"][0] == (SMALL["vocab_size"] // tp if tie else SMALL["vocab_size"])


def test_tp_activations_match_a_real_autotp_forward_backward():
    """The traced per-rank activations against one real forward/backward of DeepSpeed's split layers (its
    column/row autograd functions and the head's all-gather buffer included), fp32, 2 x 256 tokens."""
    config = small_llama(**SMALL)
    real = autotp_rank(SMALL, 2, 2, micro=2, seq=256)["fwd_bwd_peak"]
    predicted = activation_bytes(config, 2, 256, torch.float32, False, "sdpa", None, 2)
    assert -ESTIMATE_UNDER <= predicted.bytes / real - 1 <= ESTIMATE_OVER, (predicted.bytes, real)
