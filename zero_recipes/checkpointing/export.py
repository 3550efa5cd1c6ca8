"""Export: one view of the full parameters, whatever holds them, and what makes them a model directory.

The trained weights may be ZeRO-3 partitions (each rank a 1/N slice of every parameter), AutoTP shards (each
rank a slice of each split layer), or whole on every rank. `gathered_parameters` is the one view of them all:
full-size tensors on rank 0's CPU, one layer at a time. Everything that writes or checks weights (the HF
export, the LoRA adapter and its merge, the export check) reads through it. Pipeline stages (each rank a
few whole layers) are the model's own answer (pipeline_model.PipelinedCausalLM.full_state_dict, which knows
the stages' HF names); `full_state_dict` asks it.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Optional

from zero_recipes.checkpointing import atomic, storage
from zero_recipes.modeling import model as modeling
from zero_recipes.parallel import expert_parallel


def partitioned(module) -> bool:
    """Whether ZeRO-3 has partitioned this module's parameters (each then carries its DeepSpeed id)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def tensor_parallel(module) -> bool:
    """Whether AutoTP has split this model's layers (its parameters are then shards)."""
    from deepspeed.module_inject.layers import DS_IS_REPLACED_MODULE

    return any(getattr(p, DS_IS_REPLACED_MODULE, False) for p in module.parameters())


def gathered_parameters(module, rank: int, trainable_only: bool = False) -> Optional[dict]:
    """The parameters (or only the trainable ones: a LoRA adapter), full-size, on rank 0's CPU; None elsewhere.
    One layer at a time: its ZeRO-3 partitions are gathered (without that a ZeRO-3 save writes the empty
    placeholders), then its AutoTP shards (DeepSpeed's GatherReplacedLayerParams, which takes the layer's
    [weight, bias] in order and re-splits them on exit), so no rank holds more than one full layer.
    Collective under ZeRO-3 and tensor parallelism: every rank walks the same layers."""
    import torch
    from deepspeed.module_inject.layers import GatherReplacedLayerParams

    zero3 = partitioned(module)
    sd, seen = ({} if rank == 0 else None), set()
    for prefix, owner in module.named_modules():
        params = list(owner.parameters(recurse=False))
        wanted = [p for p in params if p.requires_grad or not trainable_only]
        if not wanted:
            continue
        zero_gather = nullcontext()
        if zero3:
            import deepspeed

            zero_gather = deepspeed.zero.GatheredParameters(wanted, modifier_rank=None)
        with zero_gather, GatherReplacedLayerParams(params, owner, enabled=True):
            if rank != 0:
                continue
            for name, param in owner.named_parameters(recurse=False):
                if id(param) in seen or (trainable_only and not param.requires_grad):
                    continue  # a tied weight is stored once, under its first name (as named_parameters does)
                seen.add(id(param))
                sd[f"{prefix}.{name}" if prefix else name] = param.detach().cpu().clone()
    if zero3 or tensor_parallel(module):
        torch.distributed.barrier()
    return sd


def full_state_dict(module, rank: int) -> Optional[dict]:
    """The trained weights as a CPU state dict on rank 0 (None elsewhere): the gathered parameters plus the
    persistent buffers. ZeRO-3 saves with empty placeholder weights (LLaMA-Factory #253) come from skipping the
    gather; under tensor parallelism a shard is never written as if it were the whole weight, nor a pipeline
    stage's layers as if they were the model."""
    if hasattr(module, "full_state_dict"):  # pipeline stages: each rank sends its layers under their HF names
        return module.full_state_dict(rank)
    sd = _held_state_dict(module, rank)
    if expert_parallel.expert_layers(module):  # AutoEP's layers: every rank's experts, under the HF names
        sd = expert_parallel.hf_state_dict(module, sd, rank, hf_shapes(module.config))
    return sd


def _held_state_dict(module, rank: int) -> Optional[dict]:
    """The module's own state dict (its names), full-size, on rank 0."""
    if not partitioned(module) and not tensor_parallel(module):
        if rank != 0:
            return None
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    sd = gathered_parameters(module, rank)
    if rank == 0:
        for name, buf in module.named_buffers():
            if buf is not None:
                sd[name] = buf.detach().cpu().clone()
        # drop non-persistent buffers (e.g. rotary inv_freq) that state_dict() would not contain
        persistent = set(module.state_dict().keys())
        sd = {k: v for k, v in sd.items() if k in persistent}
    return sd


def hf_shapes(model_config) -> dict:
    """Every tensor of the HF model of `model_config` by name, with its shape (the meta model: no memory)."""
    return {name: tuple(t.shape) for name, t in modeling.meta_model(model_config).state_dict().items()}


def hf_files_writer(model_config, tokenizer):
    """What makes a weights file a model directory: config, generation config, tokenizer."""

    def write(out_dir: Path) -> None:
        import copy

        from transformers import GenerationConfig

        out_dir.mkdir(parents=True, exist_ok=True)
        config = copy.deepcopy(model_config)
        config.use_cache = True
        config.save_pretrained(out_dir)
        GenerationConfig.from_model_config(config).save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)

    return write


def export_hf_model(engine, tokenizer, out_dir: Path, rank: int) -> None:
    """Leave a complete HF model directory in `out_dir`, as the HF Trainer does."""

    sd = full_state_dict(engine.module, rank)

    def write(stage: Path) -> None:
        model = engine.module
        model.config.use_cache = True
        if expert_parallel.expert_layers(model):  # saved through the HF class, whose names `sd` now has
            model = modeling.meta_model(model.config)
        model.save_pretrained(stage, state_dict=sd, safe_serialization=True)
        tokenizer.save_pretrained(stage)

    write_model_dir(out_dir, rank, write, state_bytes(sd))


def state_bytes(sd: Optional[dict]) -> Optional[int]:
    """What a state dict's tensors take on disk, give or take the headers (None off rank 0)."""
    return None if sd is None else sum(t.numel() * t.element_size() for t in sd.values())


def write_model_dir(out_dir: Path, rank: int, write: Callable[[Path], None], needed: Optional[int] = None) -> None:
    """Collective: rank 0's `write(stage)` fills a staging directory, whose files then replace their namesakes in
    out_dir (atomic.replaced_files). Should storage fail, the previous export stays whole and every rank stops
    with the same StorageError, which says where the trained weights still are."""

    def rank0_writes() -> None:
        if rank == 0:
            with atomic.replaced_files(out_dir) as stage:
                write(stage)

    failure = storage.agree(storage.attempt(rank0_writes, "export", out_dir))
    if failure:
        raise storage.StorageError(
            f"{storage.describe(failure, needed)}. {out_dir}'s previous files are untouched; the newest checkpoint "
            f"holds the trained weights: `python tools/export_hf.py {out_dir} OTHER_DIR` exports it"
        )


def verify_export(
    engine, probe, rank: int, reload: Callable[[], object], engine_logits: Callable[[object], object]
) -> Optional[float]:
    """Reload the export on rank 0 with `reload` (the adapter's: plain `from_pretrained`, or a PEFT adapter
    onto its base) and return the max |logit difference| against the engine on the same input, whose logits
    `engine_logits` gives on rank 0 (the runner's: all ranks run the engine, as ZeRO-3 forwards and a
    pipeline's stages are collective)."""
    import torch
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from zero_recipes.distributed.process_group import host_group

    engine.eval()
    with torch.no_grad():
        ref = engine_logits(probe)
        ref = ref.float().cpu() if ref is not None else None
    diff = None
    if rank == 0:
        unset_hf_deepspeed_config()  # a plain load, as a user's, not one inside zero.Init
        with torch.no_grad():
            got = reloaded_logits(reload(), probe).float().cpu()
        diff = (got - ref).abs().max().item()
    torch.distributed.barrier(group=host_group())  # rank 0's reload of a large export can outlast --ddp_timeout
    return diff


def reloaded_logits(model, input_ids):
    """The logits of a reloaded export, fed on the device it was loaded onto. A full or LoRA export reloads on
    the CPU (as a user's `from_pretrained` does) and QLoRA's 4-bit base on the GPU, while the probe comes from
    the engine's device: on a GPU the two differ."""
    device = next(model.parameters()).device
    return model(input_ids=input_ids.to(device)).logits
