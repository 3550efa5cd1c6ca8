"""A model built before DeepSpeed (`--zero_init false`, zero_recipes/memory/preloaded.py): the mechanism checked on
real torch and DeepSpeed code, and the estimate's terms on Llama-3-8B's shape (the published runs'
benchmarks/estimator-gpu-public.md checks them against GPUs)."""

import pytest
import torch
from transformers import AutoConfig

from zero_recipes.memory import Launch, estimate
from zero_recipes.memory.preloaded import Preloaded, version_tuple

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=False)  # fmt: skip
OLD, NEW = Preloaded(version_tuple("0.14.2")), Preloaded(version_tuple("0.19.8"))


def saved_storages(out) -> list[int]:
    """Bytes of every tensor the autograd graph behind `out` saved, by walking it."""
    seen, todo, sizes = set(), [out.grad_fn], []
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        for name in dir(fn):
            if name.startswith("_saved_"):
                value = getattr(fn, name)
                if isinstance(value, torch.Tensor):
                    sizes.append(value.untyped_storage().nbytes())
        if hasattr(fn, "saved_tensors"):
            sizes += [t.untyped_storage().nbytes() for t in fn.saved_tensors if t is not None]
        todo += [f for f, _ in fn.next_functions]
    return sizes


def released_after_forward(linear_fn) -> int:
    """The largest storage the graph still holds after ZeRO-3 releases the weight the way free_param does
    (`param.data` replaced by an empty tensor)."""
    weight = torch.nn.Parameter(torch.randn(256, 128))
    x = torch.randn(2, 8, 128, requires_grad=True)
    out = linear_fn(x, weight)
    weight.data = torch.empty(0)
    return max(saved_storages(out))


def test_torch_linear_keeps_a_released_weight_alive_and_deepspeeds_wrapper_does_not():
    """The mechanism behind the retained term: torch's linear saves weight.t(), a view of the gathered storage;
    DeepSpeed's LinearFunctionForZeroStage3 (installed for a built model from 0.19.4) saves the parameter."""
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    weight_bytes = 256 * 128 * 4
    assert released_after_forward(torch.nn.functional.linear) == weight_bytes
    assert released_after_forward(zero3_linear_wrap) < weight_bytes  # the input (2 x 8 x 128 fp32), no weight


def llama_8b_estimate(preloaded, checkpointing=False, stage=3, **zero):
    from zero_recipes.config.cli import parse_args
    from zero_recipes.ds import intake

    config = AutoConfig.for_model("llama", **LLAMA3_8B)
    files = [f"ds_configs/zero{stage}.json", "ds_configs/fp16.json"]
    cfg, explicit = parse_args(["--deepspeed", *files, "--per_device_train_batch_size", "1"])
    raw = intake.deep_merge(intake.load_fragments(files), {"zero_optimization": zero})
    resolved = intake.resolve(raw, cfg, explicit, 8, 4096)
    ds = intake.with_steps(resolved.ds, resolved.cfg, 1000)
    launch = Launch(8, 1, 1, 512, checkpointing, "sdpa", tiled_loss=False, preloaded=preloaded)
    return estimate(config, ds, launch), ds["zero_optimization"]


def linear_weights(c: dict) -> tuple[int, int]:
    """Every linear weight of a Llama, and its head, from the config: q, k, v, o, gate, up, down; V x h."""
    h, i, kv = c["hidden_size"], c["intermediate_size"], c["num_key_value_heads"] * h_dim(c)
    layer = h * h + 2 * h * kv + h * h + 3 * h * i
    return c["num_hidden_layers"] * layer + c["vocab_size"] * h, c["vocab_size"] * h


def h_dim(c: dict) -> int:
    return c["hidden_size"] // c["num_attention_heads"]


@pytest.mark.parametrize("checkpointing,cap", [(False, {}), (True, {}), (True, {"stage3_max_live_parameters": 0,
                          "stage3_prefetch_bucket_size": 0})], ids=["no-gc", "gc", "gc-nothing-kept"])  # fmt: skip
def test_before_0_19_4_the_forward_holds_the_gathered_linear_weights(checkpointing, cap):
    """2 bytes (fp16) for every linear weight without checkpointing, for the head alone with it, less what ZeRO-3
    keeps gathered anyway (the other ranks' shards up to its live cap); none from 0.19.4 on."""
    built, zero = llama_8b_estimate(None, checkpointing, **cap)
    old, _ = llama_8b_estimate(OLD, checkpointing, **cap)
    new, _ = llama_8b_estimate(NEW, checkpointing, **cap)
    linears, head = linear_weights(LLAMA3_8B)
    params = built.num_params
    kept = 2 * min(params * 7 / 8, zero["stage3_max_live_parameters"] + zero["stage3_prefetch_bucket_size"])
    extra = old.phases["forward_backward"]["device_bytes"] - built.phases["forward_backward"]["device_bytes"]
    assert extra == pytest.approx(max(0, 2 * (head if checkpointing else linears) - kept), abs=16)
    assert (extra > 0) == (not checkpointing or bool(cap))  # the head is within the default cap
    assert new.phases["forward_backward"] == built.phases["forward_backward"]
    assert any("0.19.4" in n for n in old.notes) == (extra > 0) and any("zero.Init" in n for n in old.notes)


def test_zero3_init_holds_the_whole_16_bit_model_and_the_host_a_copy_per_process():
    """engine.py moves the whole cast module to every GPU before ZeRO-3 partitions it: 2 bytes a parameter at init
    (16 GB for 8B, above an 8-GPU ZeRO-3 run's steady states), and every process loads it on the host first."""
    (built, _), (pre, _) = llama_8b_estimate(None), llama_8b_estimate(NEW)
    params = built.num_params
    assert pre.phases["init"]["device_bytes"] >= 2 * params > built.phases["init"]["device_bytes"]
    assert pre.phases["init"]["device_bytes"] < 2 * params * 1.02
    assert pre.per_node["cpu_bytes"] == 8 * 4 * params  # 8 processes, fp32 each


def test_below_zero3_only_the_host_changes():
    (built, _), (pre, _) = llama_8b_estimate(None, stage=2), llama_8b_estimate(OLD, stage=2)
    assert pre.phases == built.phases
    assert pre.per_node["cpu_bytes"] == 8 * 4 * built.num_params


def test_versions_read_as_releases():
    assert version_tuple("0.14.2") < (0, 19, 4) <= version_tuple("0.19.8+cu121") < version_tuple("0.20.0.dev0")
