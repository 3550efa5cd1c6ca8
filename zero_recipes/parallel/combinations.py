"""Which modes combine: one table, with the refusal beside each forbidden pair. A leaf (pure data).

A run's modes are its parallel axes of size > 1 (tensor, sequence, pipeline, expert), its ZeRO stage
where a stage matters (zero0, zero2, zero3), its adapter (lora; a QLoRA run is lora and qlora) and its objective
(dpo; the default language modelling is not a mode). train.py refuses a
forbidden pair before any process group starts, and the memory estimate refuses it the same way. A pair absent
from the table combines. Sizes in a refusal come from the run: {tp}, {sp}, {pp}, {ep}.
"""

from __future__ import annotations

from zero_recipes.errors import ConfigError

FORBIDDEN: dict[tuple[str, str], str] = {
    ("tensor", "sequence"): (
        "tensor_parallel.autotp_size = {tp} with sequence_parallel_size = {sp}: train.py does not combine AutoTP "
        "with Ulysses; use one of them (sequence parallelism for long sequences, tensor parallelism for a model "
        "too big for ZeRO-3's gathered layers)"
    ),
    ("tensor", "zero0"): (
        "tensor_parallel.autotp_size = {tp} with ZeRO-0: DeepSpeed saves such checkpoints without the optimizer "
        "partitions its universal conversion needs, so tools/export_hf.py could not export them nor a resume "
        "change the data-parallel size; use ds_configs/zero1.json (it costs nothing at one data-parallel replica "
        "and shards the optimizer states across more)"
    ),
    ("tensor", "lora"): (
        "tensor_parallel.autotp_size = {tp} with LoRA: AutoTP splits nn.Linear layers and PEFT's LoRA layers are "
        "not ones it can split; train LoRA with ZeRO (ds_configs/zero3.json) and no tensor_parallel"
    ),
    ("sequence", "zero0"): (
        "sequence_parallel_size = {sp} with ZeRO-0: DeepSpeed's ZeRO-0 bf16 path crashes under sequence "
        "parallelism (deepspeedai/DeepSpeed#7833) and its checkpoints lack what a universal resume needs; use "
        "ds_configs/zero1.json (free at one data-parallel replica) or zero3.json"
    ),
    ("sequence", "lora"): (
        "sequence_parallel_size = {sp} with LoRA: this combination is not tested here; train LoRA without "
        "sequence_parallel_size, or fine-tune fully with ds_configs/zero3.json plus the sp fragment"
    ),
    ("pipeline", "zero2"): (
        "pipeline.stages = {pp} with ZeRO-2: DeepSpeed's PipelineEngine takes ZeRO-0 or ZeRO-1 only (it schedules "
        "the gradient all-reduce itself, which ZeRO-2's partitioned gradients would take over); use "
        "ds_configs/zero1.json, which partitions the optimizer states across the data-parallel replicas"
    ),
    ("pipeline", "zero3"): (
        "pipeline.stages = {pp} with ZeRO-3: DeepSpeed's PipelineEngine takes ZeRO-0 or ZeRO-1 only (each stage "
        "already holds only its own layers); use ds_configs/zero1.json, or ZeRO-3 without the pipeline fragment"
    ),
    ("pipeline", "tensor"): (
        "pipeline.stages = {pp} with tensor_parallel.autotp_size = {tp}: train.py does not combine the pipeline "
        "with AutoTP; use one of them (the pipeline across nodes on slow links, AutoTP within a node)"
    ),
    ("pipeline", "sequence"): (
        "pipeline.stages = {pp} with sequence_parallel_size = {sp}: train.py does not combine the pipeline with "
        "Ulysses; use one of them (sequence parallelism for long sequences)"
    ),
    ("pipeline", "lora"): (
        "pipeline.stages = {pp} with LoRA: a PEFT adapter is saved, merged and reloaded through PEFT's whole "
        "model, which no rank holds when the layers are split into stages; train LoRA with ZeRO "
        "(ds_configs/zero3.json) and no pipeline fragment"
    ),
    ("expert", "tensor"): (
        "expert_parallel.autoep_size = {ep} with tensor_parallel.autotp_size = {tp}: train.py does not combine "
        "AutoEP with AutoTP (DeepSpeed folds them, untested here); use one of them (expert parallelism for a "
        "mixture of experts)"
    ),
    ("expert", "sequence"): (
        "expert_parallel.autoep_size = {ep} with sequence_parallel_size = {sp}: train.py does not combine AutoEP "
        "with Ulysses; use one of them (sequence parallelism with ZeRO-3 trains a mixture of experts at long "
        "context)"
    ),
    ("expert", "pipeline"): (
        "expert_parallel.autoep_size = {ep} with pipeline.stages = {pp}: train.py's pipeline splits dense "
        "families only; use one of them"
    ),
    ("expert", "lora"): (
        "expert_parallel.autoep_size = {ep} with LoRA: AutoEP replaces the sparse blocks PEFT would wrap, and "
        "the adapter could not be saved under the model's names; train LoRA with ZeRO (ds_configs/zero3.json) "
        "and no ep fragment"
    ),
    ("sequence", "dpo"): (
        "sequence_parallel_size = {sp} with --objective dpo: a pair's prompt and both answers must sit on one rank "
        "for the shared-prompt attention and the answers' log-probs; train DPO with ZeRO-3 (ds_configs/zero3.json) "
        "and no sequence-parallel fragment, or shorter pairs (--max_length)"
    ),
    ("pipeline", "dpo"): (
        "pipeline.stages = {pp} with --objective dpo: DeepSpeed's pipeline engine computes the loss from labels on "
        "its last stage, which a pair's loss (both answers' log-probs and the reference's) does not fit; train DPO "
        "with ZeRO-3 (ds_configs/zero3.json) and no pipeline fragment"
    ),
    ("qlora", "zero3"): (
        "--load_in_4bit with ZeRO-3 is not supported here: ZeRO-3 would partition bitsandbytes' packed 4-bit "
        "weights and lose their quantisation state. Use ZeRO-2 (ds_configs/zero2.json): the 4-bit base is a "
        "quarter of its bf16 size on every GPU, and the adapters' states are partitioned"
    ),
}


def modes(axes: dict[str, int], zero_stage: int, adapter: str, objective: str = "lm") -> dict[str, int]:
    """A run's modes by name, each with its size (1 for the ones without one). `axes`: Mesh.sizes;
    `adapter`: lora_options.adapter_name ('full', 'lora' or 'qlora'); `objective`: TrainConfig.objective."""
    out = {axis: n for axis, n in axes.items() if n > 1}
    if objective != "lm":
        out[objective] = 1
    if zero_stage in (0, 2, 3):
        out[f"zero{zero_stage}"] = 1
    if adapter != "full":
        out["lora"] = 1
    if adapter == "qlora":
        out["qlora"] = 1
    return out


def refuse(active: dict[str, int]) -> None:
    """Raise the first forbidden pair among `active` (modes by name, with their sizes)."""
    for (a, b), text in FORBIDDEN.items():
        if a in active and b in active:
            sizes = {axis[0] + "p": active.get(axis, 1) for axis in ("tensor", "sequence", "pipeline", "expert")}
            raise ConfigError(text.format(**sizes))
