"""The memory estimate of a LoRA run: what a user reads off tools/estimate_memory.py. Byte counts are derived here
from first principles (a frozen weight: its bytes alone; a trained one: 16-bit weight 2 + grad 2 + fp32 master 4 +
Adam's two moments 8), parameter counts from peft's own `get_nb_trainable_parameters`, the activations from a
real forward/backward of the peft-wrapped model. In process, no launcher; here rather than in tests/unit because
tracing 8B models through peft takes seconds a test (33 s of test time, more than half the unit tier's budget)."""

import dataclasses
import json

import pytest
import torch

from helpers import ESTIMATE_OVER, ESTIMATE_UNDER, fwd_bwd_peak_bytes, small_llama, tool_in_process
from zero_recipes.adapters.lora import lora_config
from zero_recipes.config.train_config import TrainConfig
from zero_recipes.memory import Launch, ModelShape, Precomputed, activation_bytes, estimate

LLAMA_8B = {  # Llama-3.1-8B's shape
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
}
ZERO = {"reduce_bucket_size": 5e8, "overlap_comm": False, "contiguous_gradients": True}


def llama_8b():
    from transformers import AutoConfig

    fields = dict(LLAMA_8B)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def lora_of(r=16, targets=("all-linear",), save=(), dropout=0.0):
    cfg = dataclasses.replace(
        TrainConfig(), lora_r=r, lora_target_modules=list(targets), modules_to_save=list(save), lora_dropout=dropout
    )
    return lora_config(cfg)


def peft_counts(config, lora) -> tuple[int, int]:
    """(trainable, all) as peft itself counts them, on the meta model."""
    import copy

    from peft import get_peft_model

    from zero_recipes.modeling.model import meta_model

    return get_peft_model(meta_model(config), copy.deepcopy(lora)).get_nb_trainable_parameters()


def ds(stage: int, bf16: bool = True, **zero) -> dict:
    return {
        "zero_optimization": {"stage": stage, **ZERO, **zero},
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": False},
    }


@pytest.mark.parametrize(
    "targets,save",
    [(("all-linear",), ()), (("q_proj", "v_proj"), ()), (("all-linear",), ("lm_head",))],
    ids=["all-linear", "q-v", "all-linear+lm_head"],
)
def test_trainable_count_is_peft_own(targets, save):
    config, lora = small_llama(), lora_of(8, targets, save)
    trainable, total = peft_counts(config, lora)
    shape = ModelShape.of(config, lora)
    assert (shape.trainable, shape.num_params) == (trainable, total)
    assert 0 < trainable < total


def test_8b_lora_on_one_gpu_states_are_2_bytes_frozen_16_bytes_trained():
    """ZeRO-2 on one GPU in bf16: the frozen base costs its 2 bytes, each adapter weight 16 (no offload)."""
    config, lora = llama_8b(), lora_of()
    trainable, total = peft_counts(config, lora)
    assert trainable == 41_943_040  # r 16 on q,k,v,o,gate,up,down of 32 layers: the figure LoRA users know
    launch = Launch(1, 1, 1, 2048, True)
    e = estimate(config, ds(2), launch, lora=lora)
    want = 2 * (total - trainable) + 16 * trainable
    assert e.trainable_params == trainable and e.num_params == total
    # at the step: the adapters' reduced grads (`grads_in_partition`) exist from the backward to the step, not in
    # the forward whose activations set the forward/backward peak
    got = e.phases["optimizer_step"]["model_states_bytes"]
    assert abs(got / want - 1) < 0.005, (got, want)
    # full fine-tuning of the same model needs 16 bytes for every parameter: over 7 times the LoRA states
    full = estimate(config, ds(2), launch)
    assert full.trainable_params is None
    assert full.phases["optimizer_step"]["model_states_bytes"] > 7 * got


def test_qlora_8b_holds_its_linear_weights_in_nf4():
    """--load_in_4bit: every Linear weight but the head in NF4 (4-bit codes, an 8-bit absmax per 64 weights and
    an fp32 scale per 256 absmaxes), embeddings, norms and head in bf16, adapters at 16 bytes."""
    config, lora = llama_8b(), lora_of()
    trainable, total = peft_counts(config, lora)
    h, i, layers, kv = 4096, 14336, 32, 8 * 128
    linear = layers * (2 * h * h + 2 * h * kv + 3 * h * i)  # q, o; k, v; gate, up, down
    nf4 = linear * (0.5 + 1 / 64 + 4 / (64 * 256))
    want = nf4 + 2 * (total - trainable - linear) + 16 * trainable
    e = estimate(config, ds(2), Launch(1, 1, 1, 2048, True), lora=lora, load_in_4bit=True)
    got = e.phases["optimizer_step"]["model_states_bytes"]  # the step's fp32 grad copy is a buffer
    assert abs(got / want - 1) < 0.005, (got, want)
    # and about a third of the bf16 LoRA peak's states: what makes an 8B model fit a 12 GB card
    bf16 = estimate(config, ds(2), Launch(1, 1, 1, 2048, True), lora=lora)
    assert got < 0.4 * bf16.phases["optimizer_step"]["model_states_bytes"]
    # each layer's weight is dequantised into a bf16 temporary while it computes: the largest one, in buffers
    fb = e.phases["forward_backward"]["buffers_bytes"] - bf16.phases["forward_backward"]["buffers_bytes"]
    assert fb == 2 * h * i


def test_frozen_base_is_partitioned_under_zero3_and_fp32_doubles_it():
    config, lora = llama_8b(), lora_of()
    trainable, total = peft_counts(config, lora)
    frozen = total - trainable
    z3 = estimate(config, ds(3), Launch(8, 1, 1, 2048, True), lora=lora)
    got = z3.phases["optimizer_step"]["model_states_bytes"]
    assert abs(got / ((2 * frozen + 16 * trainable) / 8) - 1) < 0.005, got
    # ZeRO-0 in fp32, at the step (grads alive): frozen weights at 4 bytes; trained ones 4 + grad 4 + Adam 8,
    # no separate master copy
    fp32 = estimate(config, ds(0, bf16=False), Launch(1, 1, 1, 2048, True), lora=lora)
    got = fp32.phases["optimizer_step"]["model_states_bytes"]
    assert abs(got / (4 * frozen + 16 * trainable) - 1) < 0.005, got


def test_full_fine_tuning_estimate_is_unchanged_by_the_lora_path():
    """lora=None is today's estimate: the same bytes as a shape that names no trainable subset."""
    config = small_llama()
    launch = Launch(2, 1, 2, 256, False, accelerator="cpu")
    plain = estimate(config, ds(3), launch)
    shape = ModelShape.of(config)
    assert shape.trainable is None and plain.trainable_params is None
    assert plain.phases == estimate(config, ds(3), launch, precomputed=Precomputed(shape)).phases


def measured_lora_fwd_bwd(config, lora, micro, seq, dtype) -> int:
    """Peak live bytes of a real forward+backward of the peft-wrapped model (adapter grads dropped as ZeRO does)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_config(config, dtype=dtype), lora, autocast_adapter_dtype=False)
    return fwd_bwd_peak_bytes(model, config, micro, seq)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_lora_activations_match_a_real_peft_forward_backward(dropout):
    """Traced through peft's layers: dropout's mask and the adapters' inputs count, a frozen weight's do not."""
    config, lora = small_llama(), lora_of(16, dropout=dropout)
    predicted = activation_bytes(config, 2, 256, torch.bfloat16, False, "sdpa", lora)
    assert predicted.method == "traced"
    real = measured_lora_fwd_bwd(config, lora, 2, 256, torch.bfloat16)
    assert -ESTIMATE_UNDER <= predicted.bytes / real - 1 <= ESTIMATE_OVER, (predicted.bytes, real)


def test_table_recommends_lora_before_offload(tmp_path):
    """An 8B model on one 80 GiB GPU: full fine-tuning fits only with offload; LoRA without it comes first."""
    p = tmp_path / "llama8b.json"
    p.write_text(json.dumps(LLAMA_8B))
    args = ["--model", str(p), "--deepspeed", "ds_configs/bf16.json", "--seq_len", "2048", "--gpu_memory", "80GiB"]
    run = [*args, "--table", "--longest_sequence", "false"]
    proc = tool_in_process("estimate_memory", *run, "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    t = json.loads(proc.stdout)
    one = {(r["config"], r["gradient_checkpointing"]): r for r in t["rows"] if r["num_gpus"] == 1}
    assert not one["zero2", False]["fits"] and not one["zero2", True]["fits"]
    rec = t["recommended"]["1"]
    assert rec["lora_r"] == 16 and rec["config"] in ("zero1", "zero2", "zero3"), rec
    assert t["recommended_full_fine_tuning"]["1"]["config"].endswith(("offload_optimizer", "offload_all"))
    assert all(r["lora_r"] == 0 for r in t["rows"]) and {r["lora_r"] for r in t["lora_rows"]} == {16}
    text = tool_in_process("estimate_memory", *run).stdout
    assert f"  1 GPU(s): {rec['config']} + LoRA r16" in text
