"""A model's parameter counts for the estimate, built on the meta device from its config alone: the whole model,
LoRA's trainable share (peft's own count), QLoRA's quantised linears, and one tensor-parallel rank's AutoTP shard."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


@dataclass
class ModelShape:
    num_params: int
    """Parameters one rank holds before ZeRO: the whole model, or with tensor parallelism its AutoTP shard."""
    largest_param: int
    trainable: int | None = None
    """LoRA: the parameters the optimizer steps (adapters, modules_to_save); None: all (full fine-tuning)."""
    largest_trainable: int = 0
    quantized: int = 0
    """QLoRA: parameters stored in NF4 (every Linear weight but the output head); 0 without --load_in_4bit."""
    largest_quantized: int = 0
    tp: int = 1
    """Tensor-parallel ranks per group (AutoTP's autotp_size)."""
    full_params: int = 0
    """The whole model's parameters when tp > 1 (num_params is then one rank's share); 0: num_params."""
    vocab_parallel: bool = False
    """tp > 1 and the tied embedding/head split along the vocabulary (logits V/tp wide)."""
    muon_params: int = 0
    """The parameters DeepSpeed's Muon steps with Muon: 2-D or more, their names free of "embed" and "lm_head"
    (deepspeed/__init__.py `set_optimizer_flags`); counted for full fine-tuning without TP (0 otherwise)."""
    linear_params: int = 0
    """The weights every nn.Linear of the model (the head too) multiplies by: what torch's linear can keep
    gathered under ZeRO-3 for a model built before DeepSpeed (preloaded.py); 0 under TP (not modelled)."""
    head_params: int = 0
    """The output head's weight (the embedding's, when tied)."""

    @property
    def model_params(self) -> int:
        return self.full_params or self.num_params

    @classmethod
    def of(cls, config, lora=None, load_in_4bit: bool = False, tp: int = 1, tp_block=None) -> "ModelShape":
        """Built on the meta device from the config alone: no weights read, no memory. With `lora` (a peft
        LoraConfig, zero_recipes.adapters.lora.lora_config), wrapped by peft's own `get_peft_model` as train.py wraps it,
        so the adapters' count is peft's, for any architecture and target list. With `tp` > 1, one rank's
        share under AutoTP, split by DeepSpeed's own reading of the model's TP plan (tensor_parallel.split)."""
        import copy

        from zero_recipes.adapters.lora import quantized_linears, trainable_count
        from zero_recipes.modeling.model import meta_model, num_params

        model = meta_model(config)
        if tp > 1:
            if lora is not None or load_in_4bit:
                raise ConfigError("the estimate does not model LoRA or 4-bit weights with tensor parallelism")
            from .tensor_parallel import split

            s = split(model, tp, tp_block)
            return cls(
                s.params_per_rank,
                s.largest_per_rank,
                tp=tp,
                full_params=num_params(model),
                vocab_parallel=s.vocab_parallel,
            )
        quantized = [m.weight.numel() for _, m in quantized_linears(model)] if load_in_4bit else []
        linears = linear_counts(model)
        if lora is None:
            return cls(num_params(model), max(p.numel() for p in model.parameters()), muon_params=muon_count(model),
                       linear_params=linears[0], head_params=linears[1])  # fmt: skip
        from peft import get_peft_model

        model = get_peft_model(model, copy.deepcopy(lora), autocast_adapter_dtype=False)
        trainable = [p for p in model.parameters() if p.requires_grad]
        return cls(
            num_params(model),
            max(p.numel() for p in model.parameters()),
            trainable_count(model)[0],
            max((p.numel() for p in trainable), default=0),
            sum(quantized),
            max(quantized, default=0),
            linear_params=linears[0],
            head_params=linears[1],
        )


def linear_counts(model) -> tuple[int, int]:
    """(weights of every nn.Linear, the output head's weight), counted before any adapter wraps the model."""
    import torch

    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    head = model.get_output_embeddings()
    return linear, head.weight.numel() if head is not None else 0


def muon_count(model) -> int:
    """DeepSpeed's Muon split (deepspeed/__init__.py `set_optimizer_flags`): parameters of 2 or more dimensions
    whose names hold neither "embed" nor "lm_head" take Muon; a tied head is the embedding, counted once."""
    return sum(
        p.numel()
        for name, p in model.named_parameters()
        if p.dim() >= 2 and not any(k in name.lower() for k in ("embed", "lm_head"))
    )
