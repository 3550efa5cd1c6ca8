"""The export check's reload, fed where the reloaded model lives."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from zero_recipes.checkpointing.export import reloaded_logits


def test_a_reload_on_another_device_than_the_probe_still_runs():
    # On a GPU the probe is on cuda while a full or LoRA export reloads on the CPU (and QLoRA's on cuda against a
    # CPU reference). The CPU has one other device to show it with: a model reloaded onto "meta".
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    # meta accepts CPU inputs silently where cuda would raise, so look at what reaches the embedding
    fed = []
    model.model.embed_tokens.register_forward_pre_hook(lambda module, args: fed.append(args[0].device.type))
    probe = torch.randint(0, 64, (1, 8))  # on the CPU, as the engine's probe on another device
    logits = reloaded_logits(model, probe)
    assert fed == ["meta"]
    assert logits.shape == (1, 8, 64)
