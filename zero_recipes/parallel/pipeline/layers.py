"""A Hugging Face causal LM as DeepSpeed pipeline layers: the embedding, one layer per decoder block, the final
norm, the head, and train.py's loss as the pipeline's `loss_fn`.

DeepSpeed's PipelineModule runs a list of layers, each taking what the one before returned; only tensors (or
tuples of them) cross between stages, and a float tensor that does not require grad crashes the sender's
backward. So what a decoder block needs besides the hidden states travels as integer tensors: the position
ids (packed rows restart them per example). Each block recomputes the rotary embedding and transformers'
causal mask from them, as the model's own forward does once for all blocks, so a packed row attends per
example in every stage. Padded rows need no mask: train.py pads on the right, and under a causal mask no real
token sees the padding after it, whose targets are -100.

The weights are the HF model's own modules, built as train.py builds any model (pretrained or seeded per
module name, so PP trains the same initial weights as every other layout), then handed to the pipeline,
which keeps a stage's layers and drops the rest. A tied embedding and head are one `TiedLayerSpec` on the
first and last stages; DeepSpeed all-reduces the two copies' gradients. The head copy is a layer of its own
(not a forward_fn), so each stage saves and loads its copy in its layer file.

Families: those whose model forward is exactly embed -> (rotary, mask) -> blocks -> norm and whose logits are
lm_head(hidden) (SPLITTABLE). Others are refused in one line before any process group starts.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch
from deepspeed.pipe import PipelineModule, TiedLayerSpec
from torch import nn

from zero_recipes.errors import ConfigError

SPLITTABLE = frozenset({"llama", "mistral", "qwen2", "qwen3"})
"""Families whose decoder is embed_tokens -> layers (rotary and mask from position ids) -> norm, and whose head
is lm_head(norm(hidden)), with nothing between them (no embedding scale as Gemma's, no soft-capping)."""


def refusal(model_config, stages: int) -> Optional[str]:
    """Why this model cannot be split into `stages` pipeline stages, or None."""
    family = model_config.model_type
    if family not in SPLITTABLE:
        return (
            f"pipeline.stages = {stages}: model type '{family}' cannot be split into pipeline stages here (train.py "
            f"splits {', '.join(sorted(SPLITTABLE))}); train it with ZeRO-3 (ds_configs/zero3.json) instead"
        )
    layers = model_config.get_text_config().num_hidden_layers
    if stages > layers:
        return (
            f"pipeline.stages = {stages} exceeds the model's {layers} decoder layers: a stage would hold no block "
            f"of its own; use at most {layers} stages"
        )
    return None


class Embedding(nn.Module):
    """Layer 0: token ids -> hidden states; the position ids pass on."""

    def __init__(self, embed_tokens: nn.Module):
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, inputs):
        input_ids, position_ids = inputs
        return self.embed_tokens(input_ids), position_ids


class TiedEmbedding(nn.Module):
    """The tied embedding/head: on the first stage it embeds the token ids, on the last it is the head
    (logits = hidden @ weight.T). One `weight`, as DeepSpeed's tied_weight_attr names it."""

    def __init__(self, embed_tokens: nn.Embedding):
        super().__init__()
        self.weight = embed_tokens.weight
        self.padding_idx = embed_tokens.padding_idx

    def forward(self, inputs):
        if isinstance(inputs, tuple):
            input_ids, position_ids = inputs
            return nn.functional.embedding(input_ids, self.weight, self.padding_idx), position_ids
        return nn.functional.linear(inputs, self.weight)


class Block(nn.Module):
    """One decoder block. Its rotary embedding (no weights: inv_freq is not saved) and mask are recomputed
    from the position ids, as the model's forward computes them."""

    def __init__(self, layer: nn.Module, rotary: nn.Module, config, index: int):
        super().__init__()
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        self.layer, self.rotary, self.config = layer, rotary, config
        types = getattr(config, "layer_types", None)
        sliding = types[index] == "sliding_attention" if types else getattr(config, "sliding_window", None) is not None
        self.make_mask = create_sliding_window_causal_mask if sliding else create_causal_mask

    def forward(self, inputs):
        hidden, position_ids = inputs
        mask = self.make_mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=None,
            past_key_values=None,
            position_ids=position_ids,
        )
        rotary = self.rotary(hidden, position_ids=position_ids)
        out = self.layer(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=rotary)
        return out, position_ids


class Norm(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, inputs):
        return self.norm(inputs[0])


class Head(nn.Module):
    def __init__(self, lm_head: nn.Module):
        super().__init__()
        self.lm_head = lm_head

    def forward(self, hidden):
        return self.lm_head(hidden)


class StepLoss:
    """The pipeline's loss_fn: the summed cross-entropy of a micro-batch's targets divided by `normaliser`,
    which the runner sets before each step to the whole step's label tokens over every replica, scaled so
    that DeepSpeed's 1/accumulation and data-parallel mean leave the global token mean (runner.py's
    `num_items_in_batch`). With `rows` set (eval), it returns each row's (loss sum, label tokens, wrong argmax
    tokens) instead, as lm_loss.eval_row_stats does."""

    def __init__(self):
        self.normaliser = None
        self.rows = False

    def __call__(self, logits, targets):
        import torch.nn.functional as F

        logits = logits.float()
        if self.rows:
            valid = targets != -100
            ce = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100, reduction="none")
            wrong = (logits.argmax(-1) != targets) & valid
            return torch.stack([ce.sum(1), valid.sum(1).to(ce.dtype), wrong.sum(1).to(ce.dtype)], dim=1).double()
        summed = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100, reduction="sum"
        )
        return summed / self.normaliser


def stage_boundaries(layers: list, stages: int, partition: str) -> list[int]:
    """DeepSpeed's `_partition_layers` boundaries for `layers` (the first layer of each stage, then the end),
    through its own counting and matching, which read only the layer list: what PipelineModule will do, known
    before any process group (the axis's check, the memory estimate)."""
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime import utils as ds_utils

    module = SimpleNamespace(_layer_specs=layers)
    method = partition.lower()
    if method == "uniform":
        return ds_utils.partition_uniform(num_items=len(layers), num_parts=stages)
    if method == "parameters":
        return ds_utils.partition_balanced(weights=PipelineModule._count_layer_params(module), num_parts=stages)
    if method.startswith("type:"):
        try:
            found = set(PipelineModule._find_layer_type(module, method.split(":")[1]))
        except RuntimeError as err:
            names = ", ".join(dict.fromkeys(_layer_name(layer) for layer in layers))
            raise ConfigError(
                f"pipeline.partition = {partition!r} matches no layer (DeepSpeed: {err}); the layers are {names}: "
                'name one of them, or use "parameters"'
            ) from None
        weights = [int(i in found) for i in range(len(layers))]
        return ds_utils.partition_balanced(weights=weights, num_parts=stages)
    raise ConfigError(f"pipeline.partition = {partition!r} is not a way to split layers")


def _layer_name(layer) -> str:
    return getattr(layer, "typename", type(layer)).__name__


def tied(model_config) -> bool:
    return bool(getattr(model_config.get_text_config(), "tie_word_embeddings", False))


def pipeline_layers(model) -> list:
    """The HF model's modules as the pipeline's layer list (see hf_name for their names)."""
    decoder, config = getattr(model, model.base_model_prefix), model.config.get_text_config()
    blocks = [Block(layer, decoder.rotary_emb, config, i) for i, layer in enumerate(decoder.layers)]
    if tied(model.config):
        head = TiedLayerSpec("embed", TiedEmbedding, decoder.embed_tokens, tied_weight_attr="weight")
        return [head, *blocks, Norm(decoder.norm), head]
    return [Embedding(decoder.embed_tokens), *blocks, Norm(decoder.norm), Head(model.get_output_embeddings())]


def hf_name(index: int, key: str, n_layers: int, tied_head: bool, prefix: str = "model") -> Optional[str]:
    """The HF state-dict name of pipeline layer `index`'s key `key` (its layer_XX-model_states.pt file holds
    the layer's own state dict); None for the tied head's copy of the embedding (the export stores it once)."""
    if index == 0:
        return f"{prefix}.embed_tokens.weight" if tied_head else f"{prefix}.{key}"
    if index <= n_layers:
        return f"{prefix}.layers.{index - 1}.{key.removeprefix('layer.')}"
    if index == n_layers + 1:
        return f"{prefix}.{key}"
    return None if tied_head else key


class PipelinedCausalLM(PipelineModule):
    """The pipeline of one HF causal LM. It answers what train.py's export asks of a model
    (`config`, `save_pretrained`, the full state dict with HF names) though each rank holds one stage."""

    def __init__(self, model, stages: int, partition: str, checkpoint_interval: int):
        self.hf_class, self.prefix = type(model), model.base_model_prefix
        layers = pipeline_layers(model)
        self.n_layers = len(layers) - 3
        super().__init__(
            layers,
            num_stages=stages,
            loss_fn=StepLoss(),
            partition_method=partition,
            activation_checkpoint_interval=checkpoint_interval,
            # DeepSpeed would checkpoint any chunk with parameters, the embedding's too, whose integer inputs
            # leave its recomputed output without a grad_fn ("element 0 of tensors does not require grad")
            checkpointable_layers=["Block"],
            dynamic_shape=True,  # eval batches, unpacked SFT rows and the export probe differ in shape
        )
        self.config = model.config
        self.tied_head = tied(model.config)
        # DeepSpeed keeps the whole layer list (it reads it only while building); the other stages' layers
        # would stay alive through it on every rank, the whole model's weights. Keep this stage's.
        local = range(self._local_start, self._local_stop)
        self._layer_specs = [spec if i in local else None for i, spec in enumerate(self._layer_specs)]

    def stage_tensors(self) -> dict:
        """This stage's weights under their HF names, the tied head's copy left out: the module's own tensors,
        not copies."""
        out = {}
        for offset, layer in enumerate(self.forward_funcs):
            if not isinstance(layer, nn.Module):
                continue
            for key, value in layer.state_dict().items():
                name = hf_name(self._local_start + offset, key, self.n_layers, self.tied_head, self.prefix)
                if name is not None:
                    out[name] = value.detach()
        return out

    def full_state_dict(self, rank: int) -> Optional[dict]:
        """Every stage's weights, whole, as a CPU state dict on rank 0 (None elsewhere): the state dict the
        export writes. The first pipeline's stages send theirs to rank 0 (stage 0) one tensor at a time, point
        to point on the host group (gloo: no CUDA buffer on rank 0, no NCCL communicator per pair of ranks);
        the other pipelines hold the same weights and send nothing. So rank 0 holds the model once, and a
        sender one tensor's host copy: `gather_object` padded every rank's pickled stage to the largest, and
        on NCCL rank 0 allocated world x that in CUDA bytes (32 x 17.5 GB at 70B pp8 x dp4)."""
        if self._grid.get_data_parallel_rank() != 0:
            return None
        own = self.stage_tensors()
        if rank != 0:
            _send_stage(own)
            return None
        # rank 0 is stage 0 of the first pipeline in DeepSpeed's topology. Copies: views of a flat buffer
        # (ZeRO-1's) would read as shared tensors to save_pretrained
        sd = {name: value.to("cpu", copy=True) for name, value in own.items()}
        for stage in range(1, self.num_stages):
            sd.update(_receive_stage(self._grid.stage_to_global(stage)))
        return sd

    def save_pretrained(self, out_dir, state_dict: dict, **kwargs) -> None:
        """The HF model directory of `state_dict`, written through the model class's own save_pretrained on a
        weightless (meta) instance: the same files, names and tied-weight handling as an unsplit model's."""
        with torch.device("meta"):
            shell = self.hf_class._from_config(self.config)
        shell.save_pretrained(out_dir, state_dict=state_dict, **kwargs)


def _send_stage(tensors: dict) -> None:
    """To rank 0 on the host group: the names, shapes and dtypes first (one small object), then each tensor,
    copied to the host one at a time (a CPU tensor as it is)."""
    import torch.distributed as dist

    from zero_recipes.distributed.process_group import host_group

    group = host_group()
    dist.send_object_list([[(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]], dst=0, group=group)
    for t in tensors.values():
        dist.send(t.cpu().contiguous(), dst=0, group=group)


def _receive_stage(src: int) -> dict:
    """On rank 0: what `_send_stage` sent from rank `src`, each tensor received into the CPU tensor kept."""
    import torch.distributed as dist

    from zero_recipes.distributed.process_group import host_group

    group = host_group()
    meta = [None]
    dist.recv_object_list(meta, src=src, group=group)
    out = {}
    for name, shape, dtype in meta[0]:
        out[name] = torch.empty(shape, dtype=dtype)
        dist.recv(out[name], src=src, group=group)
    return out
