"""A mixture of experts written as remote-code checkpoints write them (DeepSeek-V2's hub code, older Mixtral
ports): every expert its own module in an `nn.ModuleList`, and only the experts that received tokens run. Under
ZeRO-3 a rank whose tokens skip an expert then skips that expert's gather, and the ranks deadlock
(DeepSpeed#5066), unless the block is a ZeRO-3 leaf. tests/integration/parallel/test_moe.py saves it with its code
(`trust_remote_code`) under model_type "deepseek_v2", as the hub checkpoint is."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput


class PerExpertMoeConfig(PretrainedConfig):
    model_type = "deepseek_v2"

    def __init__(self, vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=2, **kwargs):
        self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers
        self.intermediate_size = self.moe_intermediate_size = intermediate_size
        self.n_routed_experts, self.num_experts_per_tok = kwargs.pop("n_routed_experts", 8), 1
        self.num_attention_heads = self.num_key_value_heads = 4  # read by the FLOPs count; no attention here
        self.max_position_embeddings = 512
        super().__init__(**kwargs)


class Expert(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.up = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


class PerExpertMoeBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate = nn.Linear(config.hidden_size, config.n_routed_experts, bias=False)
        self.experts = nn.ModuleList(Expert(config) for _ in range(config.n_routed_experts))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        weight, chosen = F.softmax(self.gate(flat), dim=-1).max(dim=-1)  # top-1
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows = (chosen == e).nonzero().squeeze(-1)
            if rows.numel() == 0:
                continue  # this expert's parameters are not used on this rank: its ZeRO-3 gather is skipped
            out[rows] = expert(flat[rows]) * weight[rows, None]
        return out.reshape(x.shape)


class PerExpertMoeForCausalLM(PreTrainedModel):
    config_class = PerExpertMoeConfig
    base_model_prefix = "model"
    _no_split_modules = ["PerExpertMoeBlock"]
    _supports_sdpa = True  # no attention at all: train.py asks for sdpa

    def __init__(self, config):
        super().__init__(config)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.layers = nn.ModuleList(PerExpertMoeBlock(config) for _ in range(config.num_hidden_layers))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.2)

    def forward(self, input_ids=None, labels=None, num_items_in_batch=None, **kwargs):
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            h = h + layer(h)
        logits = self.lm_head(h).float()
        loss = None
        if labels is not None:
            target = labels[:, 1:].reshape(-1)
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), target, ignore_index=-100, reduction="sum"
            )
            loss = loss / (num_items_in_batch if num_items_in_batch is not None else (target != -100).sum())
        return CausalLMOutput(loss=loss, logits=logits)
