"""The memory estimate under tensor parallelism against a real AutoTP-split model: DeepSpeed's own
`deepspeed.initialize` in one child process on torch's fake process group (rank 0 of a world of tp or more;
collectives do nothing, shapes and allocations are real), no launcher, a few seconds each. The estimate's
first-principles checks are in tests/unit/memory/test_tensor_parallel.py. Also: the CLI's --json under sequence parallelism is pure
JSON on stdout, which only a real process shows (DeepSpeed's logging writes to the stdout it finds at import)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from helpers import ESTIMATE_OVER, ESTIMATE_UNDER, REPO, small_llama
from zero_recipes.memory import ModelShape, activation_bytes

# One rank of an AutoTP group, built by real DeepSpeed: its parameter count and shapes, and optionally the peak
# live bytes of one forward/backward of the split model, measured by the estimate tests' one function
# (zero_recipes.memory.probe.fwd_bwd_peak_bytes: grads dropped as made, allocator events).
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
from zero_recipes.memory.probe import fwd_bwd_peak_bytes

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


BF16 = torch.bfloat16


def test_cli_sequence_parallel_json_is_pure_json(tmp_path):
    """--sequence_parallel 2 --json: stdout is one JSON object (DeepSpeed's logging and the notes go elsewhere),
    saying SP 2 over 2 ZeRO ranks, with less activation memory than the same run without SP."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", **small_llama().to_diff_dict()}))
    proc = subprocess.run(
        [sys.executable, "tools/estimate_memory.py", "--model", str(cfg), "--deepspeed", "ds_configs/zero3.json"]
        + ["ds_configs/bf16.json", "--num_gpus", "2", "--seq_len", "2048", "--json", "--sequence_parallel", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    sp = json.loads(proc.stdout)
    assert (sp["sequence_parallel"], sp["data_parallel"]) == (2, 2)
    whole = activation_bytes(small_llama(), 1, 2048, BF16, False)
    assert 0 < sp["phases"]["forward_backward"]["activations_bytes"] < whole.bytes
