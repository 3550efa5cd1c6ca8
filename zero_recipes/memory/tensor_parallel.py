"""What tensor parallelism (DeepSpeed 0.19.8's AutoTP, `"tensor_parallel": {"autotp_size": N}`) leaves on one rank.

AutoTP splits a transformer's linear layers by the model's Hugging Face TP plan: runtime/engine.py
`_apply_autotp_partitioning` merges `config.base_model_tp_plan` with the CausalLM class's `_tp_plan`
(runtime/tensor_parallel/config.py `_get_hf_tp_plan`), converts it to layer specs
(module_inject/tp_plan_converter.py `TPPlanConverter.convert`) and matches every parameter against them
(module_inject/autotp_config.py `AutoTPConfig.find_matching_spec`). This module asks those same functions,
on the meta model, which parameters are split:

- column-parallel (q, k, v, gate, up; "colwise"): weight and bias split along the outputs
  (module_inject/layers.py `LinearLayer.uneven_partition`);
- row-parallel (o, down; "rowwise"): the weight split along the inputs, the bias replicated
  (`LinearAllreduce.uneven_partition`: "don't slipt bias");
- the output head ("colwise_gather_output"): split along the vocabulary, its output all-gathered
  (`GatherFromTensorParallelRegion`), so the logits are full-size on every rank;
- everything else (embeddings, norms; "embedding_rowwise" is a SKIP spec) stays whole on every rank.

A tied embedding and head is the exception: with "embedding_rowwise" in the plan and the head's weight the
embedding's, `_apply_autotp_partitioning` turns on `vocab_parallel_lm_head` unless the config sets it false,
and both become one vocabulary shard (`VocabParallelEmbedding`, `VocabParallelLinear`) with a vocabulary-parallel
loss (sequence/cross_entropy.py): logits stay V/tp wide. With `vocab_parallel_lm_head: false` the tied pair
stays replicated (auto_tp.py `_configure_gathered_column_tie_fallbacks`).

Activations follow from the same split: one TP rank runs the same model code with heads/tp attention heads
(and key-value heads) and intermediate/tp MLP width, the residual stream, norms and the column layers' inputs
whole (`ColumnParallel.forward` returns its input; the matmul saves it whole, as without TP). So the
activations are traced through a copy of the config with those widths (`local_config`); the head keeps its
full vocabulary unless it is vocabulary-parallel. The gathered head's transient (its V/tp output and the
all-gather buffer, freed on return; nothing of it is saved for backward) is smaller than the loss region
that follows it, so it never sets the peak and is not added.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from zero_recipes.modeling.model import num_params

from ..errors import ConfigError


@dataclass
class TPSplit:
    tp: int
    params_per_rank: int
    """What one TP rank holds: the split parameters' shards plus everything replicated."""
    largest_per_rank: int
    split_params: int
    """Parameters of the whole model that AutoTP splits (before the split)."""
    replicated_params: int
    vocab_parallel: bool
    """The tied embedding and head split along the vocabulary, logits V/tp wide."""


def _shard(n: int, tp: int) -> int:
    """The largest shard of n rows among tp ranks: DeepSpeed gives the remainder to the first ranks."""
    return -(-n // tp)


def vocab_parallel_head(model, plan: dict, tp_block: dict) -> bool:
    """`_apply_autotp_partitioning`'s choice: an explicit `vocab_parallel_lm_head`, else on for a head tied to
    the embedding when the plan asks `embedding_rowwise`."""
    import torch

    setting = (tp_block or {}).get("vocab_parallel_lm_head")
    if setting is not None:
        return bool(setting)
    if not any(str(style).lower() == "embedding_rowwise" for style in plan.values()):
        return False
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    return any(
        isinstance(m, torch.nn.Linear)
        and name.split(".")[-1] in ("lm_head", "embed_out")
        and id(m.weight) in embeddings
        for name, m in model.named_modules()
    )


def split(model, tp: int, tp_block: dict | None = None) -> TPSplit:
    """Per-rank parameter count of `model` (a meta model, or any) under AutoTP with `tp` ranks per group."""
    import torch
    from deepspeed.module_inject.autotp_config import AutoTPConfig, PartitionType
    from deepspeed.module_inject.tp_plan_converter import TPPlanConverter
    from deepspeed.runtime.tensor_parallel.config import _get_hf_tp_plan

    plan = _get_hf_tp_plan(model)
    if not plan:
        raise ConfigError(
            f"model type '{model.config.model_type}' has no tensor-parallel plan in transformers "
            "(base_model_tp_plan); the estimate knows AutoTP's split from that plan alone"
        )
    specs = AutoTPConfig(tp_size=tp, layer_specs=TPPlanConverter.convert(plan))
    vocab = vocab_parallel_head(model, plan, tp_block or {})
    model_type = getattr(model.config, "model_type", None)
    per_rank, largest, split_n, seen = 0, 0, 0, set()
    for mod_name, module in model.named_modules():
        for p_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # a tied weight is one parameter
                continue
            seen.add(id(param))
            spec = specs.find_matching_spec(f"{mod_name}.weight", model_type)
            kind = spec.partition_type if spec is not None else PartitionType.SKIP
            is_vocab = (
                vocab
                and isinstance(module, (torch.nn.Embedding, torch.nn.Linear))
                and (isinstance(module, torch.nn.Embedding) or mod_name.split(".")[-1] in ("lm_head", "embed_out"))
            )
            if is_vocab or kind == PartitionType.COLUMN or (kind == PartitionType.ROW and p_name == "weight"):
                dim = 1 if (kind == PartitionType.ROW and not is_vocab) else 0
                shape = list(param.shape)
                shape[dim] = _shard(shape[dim], tp)
                n = int(torch.Size(shape).numel())
                split_n += param.numel()
            else:
                n = param.numel()
            per_rank += n
            largest = max(largest, n)
    total = num_params(model)
    return TPSplit(tp, per_rank, largest, split_n, total - split_n, vocab)


def local_config(config, tp: int, vocab_parallel: bool = False):
    """The config one TP rank's code effectively runs: heads, key-value heads and MLP width divided by tp,
    head_dim and the hidden size kept; the vocabulary divided only when the head is vocabulary-parallel."""
    c = copy.deepcopy(config)
    text = c.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    text.head_dim = head_dim  # kept: the per-head width does not change, the head count does
    text.num_attention_heads = _shard(heads, tp)
    kv = getattr(text, "num_key_value_heads", None)
    if kv:
        text.num_key_value_heads = _shard(kv, tp)
    for key in ("intermediate_size", "n_inner", "ffn_dim"):
        if getattr(text, key, None):
            setattr(text, key, _shard(getattr(text, key), tp))
    if vocab_parallel:
        text.vocab_size = _shard(text.vocab_size, tp)
    return c
