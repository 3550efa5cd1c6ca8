"""Turn a DeepSpeed checkpoint of any ZeRO stage and world size into a Hugging Face model directory.

    python tools/export_hf.py outputs/tiny-llama/checkpoints/step-100 exported/ [--dtype bf16|fp32|fp16]
    python tools/export_hf.py outputs/tiny-llama exported/          # its newest complete checkpoint

The result holds config.json, generation_config.json, the tokenizer and sharded safetensors with an
index; `AutoModelForCausalLM.from_pretrained(OUT_DIR)` loads it. A LoRA run's checkpoint becomes a PEFT
adapter directory (`PeftModel.from_pretrained(base, OUT_DIR)`), or with --merge the base with the adapter
merged in; the base is read from where the adapter config names it.

    python tools/export_hf.py outputs/tiny-lora-sft merged/ --merge The weights come from DeepSpeed's own
consolidation (`deepspeed.utils.zero_to_fp32`), in its lazy mode: one parameter is gathered from the
rank files at a time and written shard by shard, so memory stays near one copy of the weights in the
output dtype. A pipeline checkpoint's layer files are whole layers: their names are mapped to the HF model's. It runs on one CPU process whatever the world size that saved the checkpoint.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from zero_recipes.adapters.lora import is_adapter_dir, peft_model_from
from zero_recipes.checkpointing.checkpoint import HF_FILES, UNIVERSAL_SUFFIX, find_checkpoint
from zero_recipes.checkpointing.integrity import LAYOUT, check_intact
from zero_recipes.checkpointing.resume import convert_to_universal
from zero_recipes.errors import ConfigError

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def locate(path: Path) -> tuple[Path, str]:
    """(directory holding the tag dirs, tag), found as `--resume_from_checkpoint` finds it, and intact: a
    damaged one (a file missing, cut short or unreadable) is refused, not replaced by an older one unasked."""
    found = find_checkpoint(path)
    if found is None:
        raise ConfigError(
            f"{path} holds no DeepSpeed checkpoint; give an output_dir, its checkpoints/ directory "
            "or a checkpoints/step-N directory"
        )
    check_intact(found)
    return found


def check_complete(ckpt: Path) -> int:
    """The rank files DeepSpeed wrote must all be there; a save killed midway leaves some out. A checkpoint
    with a manifest has passed check_intact already; this counts them for one saved before manifests."""
    import torch

    model_files = sorted(f for f in ckpt.glob("*model_states.pt") if not is_layer_file(f))
    if not model_files:
        raise ConfigError(f"{ckpt} has no model_states.pt file: the save did not finish; export an earlier checkpoint")
    state = torch.load(model_files[0], map_location="cpu", weights_only=False, mmap=True)  # only its header is read
    stage = int(state.get("ds_config", {}).get("zero_optimization", {}).get("stage", 0))
    # one optimizer-state file per (data-parallel, tensor-parallel or pipeline-stage) rank
    world = int(state.get("dp_world_size", 1)) * int(state.get("mp_world_size", 1) or 1)
    if pipeline_layer_files(ckpt) and len(model_files) != int(state.get("mp_world_size", 1) or 1):
        raise ConfigError(
            f"{ckpt} is incomplete: {len(model_files)} of {state['mp_world_size']} pipeline stages' files"
        )
    optim = sorted(ckpt.glob("*optim_states.pt"))
    if stage >= 1 and len(optim) != world:
        raise ConfigError(
            f"{ckpt} is incomplete: {len(optim)} of {world} optimizer-state files (ZeRO-{stage}); "
            "the save did not finish. Export an earlier checkpoint"
        )
    if stage == 3 and len(model_files) != world:
        raise ConfigError(f"{ckpt} is incomplete: {len(model_files)} of {world} model-state files (ZeRO-3)")
    if not (ckpt / HF_FILES / "config.json").is_file():
        raise ConfigError(
            f"{ckpt} has no {HF_FILES}/config.json (written by train.py with each checkpoint); "
            "it was not saved by zero-recipes' train.py"
        )
    return stage


def tensor_parallel_degree(ckpt: Path) -> int:
    """The AutoTP degree that saved a checkpoint (1: none): its model-state files hold TP shards then."""
    import torch

    if pipeline_layer_files(ckpt):
        return 1  # a pipeline's model-parallel size is its stage count; its layers are whole
    state = torch.load(next(ckpt.glob("*model_states.pt")), map_location="cpu", weights_only=False, mmap=True)
    return int(state.get("mp_world_size", 1) or 1)


def is_layer_file(f: Path) -> bool:
    return f.name.startswith("layer_")


def pipeline_layer_files(ckpt: Path) -> list[Path]:
    """A pipeline checkpoint's per-layer weights, in layer order (DeepSpeed's layer_XX-model_states.pt)."""
    return sorted((f for f in ckpt.glob("layer_*-model_states.pt")), key=lambda f: int(f.name[6:].split("-")[0]))


def write_pipeline(ckpt: Path, out: Path, dtype, max_shard_size: str) -> None:
    """A pipeline checkpoint holds one file per pipeline layer, each that layer's own state dict (whole
    weights, whatever the ZeRO stage: ZeRO-1 partitions only the optimizer states). Their keys become the HF
    names (pipeline_model.hf_name, which knows the layer order train.py split the model into)."""
    import torch
    from huggingface_hub import save_torch_state_dict
    from transformers import AutoConfig

    from zero_recipes.parallel.pipeline.layers import hf_name, tied

    config = AutoConfig.from_pretrained(ckpt / HF_FILES)
    n_layers = config.get_text_config().num_hidden_layers
    sd = {}
    for f in pipeline_layer_files(ckpt):
        index = int(f.name[6:].split("-")[0])
        for key, value in torch.load(f, map_location="cpu", weights_only=True).items():
            if (name := hf_name(index, key, n_layers, tied(config))) is not None:
                sd[name] = value.to(dtype) if value.is_floating_point() else value
    save_torch_state_dict(sd, str(out), max_shard_size=max_shard_size, safe_serialization=True)


def expert_files(ckpt: Path) -> list[Path]:
    """An expert-parallel (AutoEP) checkpoint's per-expert weights: layer_L_expert_E_mp_rank_XX_model_states.pt."""
    return sorted(ckpt.glob("layer_*_expert_*_model_states.pt"))


def expert_parallel(ckpt: Path) -> bool:
    """Whether the run that saved `ckpt` split its experts (its layout says so; DeepSpeed's expert files)."""
    import json

    layout = json.loads((ckpt / LAYOUT).read_text()) if (ckpt / LAYOUT).is_file() else {}
    return layout.get("expert_parallel", 1) > 1 or bool(expert_files(ckpt))


def write_expert_parallel(ckpt: Path, stage: int, out: Path, dtype, max_shard_size: str) -> None:
    """Under ZeRO-0/1/2 an AutoEP checkpoint holds the dense weights whole in mp_rank_00_model_states.pt and
    each expert in a file of its own: together, under the HF names (expert_parallel.to_hf_names)."""
    import torch
    from huggingface_hub import save_torch_state_dict
    from transformers import AutoConfig

    from zero_recipes.checkpointing.export import hf_shapes
    from zero_recipes.parallel.expert_parallel import experts_from_files, to_hf_names

    if stage == 3:
        raise ConfigError(
            f"{ckpt} is a ZeRO-3 + expert-parallel checkpoint, whose partitioned experts this tool does not "
            "consolidate; relaunch the run's own command (same ranks and configs): it resumes from this "
            "checkpoint, and the output_dir it finishes is the exported model"
        )
    dense = torch.load(ckpt / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    sd = to_hf_names(
        dense, experts_from_files(expert_files(ckpt)), hf_shapes(AutoConfig.from_pretrained(ckpt / HF_FILES))
    )
    sd = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in sd.items()}
    save_torch_state_dict(sd, str(out), max_shard_size=max_shard_size, safe_serialization=True)


def export(checkpoint: Path, out_dir: Path, dtype: str, max_shard_size: str, merge: bool = False) -> Path:
    import torch

    base, tag = locate(checkpoint)
    ckpt = base / tag
    stage = check_complete(ckpt)
    adapter = is_adapter_dir(ckpt / HF_FILES)
    if merge and not adapter:
        raise ConfigError(f"--merge merges a LoRA adapter; {ckpt} is a full fine-tuning checkpoint (drop --merge)")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ConfigError(f"{out_dir} is not empty; export into a new directory (nothing there is overwritten)")
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True)
    try:
        if adapter:
            export_lora(base, tag, stage, tmp, getattr(torch, DTYPES[dtype]), merge, max_shard_size)
            if out_dir.exists():
                out_dir.rmdir()
            tmp.replace(out_dir)
            return ckpt
        if pipeline_layer_files(ckpt):
            write_pipeline(ckpt, tmp, getattr(torch, DTYPES[dtype]), max_shard_size)
        elif expert_parallel(ckpt):
            write_expert_parallel(ckpt, stage, tmp, getattr(torch, DTYPES[dtype]), max_shard_size)
        elif tensor_parallel_degree(ckpt) > 1:
            if stage == 3:
                raise ConfigError(
                    f"{ckpt} is a ZeRO-3 + tensor-parallel checkpoint, which DeepSpeed 0.19.8 cannot convert "
                    "(ds_to_universal fails on it: 'exceeds dimension size'). Relaunch the run's own command "
                    "(same ranks and configs): it resumes from this checkpoint, and the output_dir it finishes "
                    "is the exported model"
                )
            write_tensor_parallel(base, tag, tmp, getattr(torch, DTYPES[dtype]), max_shard_size)
        elif stage == 0:
            # ZeRO-0 saves the whole module in one file; zero_to_fp32 handles only partitioned stages
            from huggingface_hub import save_torch_state_dict

            module = torch.load(next(ckpt.glob("*model_states.pt")), map_location="cpu", weights_only=False)["module"]
            sd = {k: (v.to(getattr(torch, DTYPES[dtype])) if v.is_floating_point() else v) for k, v in module.items()}
            save_torch_state_dict(sd, str(tmp), max_shard_size=max_shard_size, safe_serialization=True)
        else:
            from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict

            convert_zero_checkpoint_to_state_dict(
                str(base),
                str(tmp),
                dtype=DTYPES[dtype],
                max_shard_size=max_shard_size,
                safe_serialization=True,
                tag=tag,
            )
        for f in (ckpt / HF_FILES).iterdir():
            shutil.copy2(f, tmp / f.name)
        set_config_dtype(tmp, DTYPES[dtype])
        if out_dir.exists():
            out_dir.rmdir()
        tmp.replace(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ckpt


def write_tensor_parallel(base: Path, tag: str, out: Path, dtype, max_shard_size: str) -> None:
    """An AutoTP checkpoint holds each rank's shard of the split layers, which zero_to_fp32 would write as
    if they were whole weights. DeepSpeed's universal conversion merges the shards (and the ZeRO partitions)
    into one full fp32 tensor per parameter; those are the weights. Converted in a scratch directory that
    is removed afterwards, or read from the conversion a resume already made."""
    import tempfile

    import torch
    from huggingface_hub import save_torch_state_dict

    made = base / (tag + UNIVERSAL_SUFFIX)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".universal-") as scratch:
        universal = made if (made / "zero").is_dir() else convert_to_universal((base, tag), Path(scratch) / "u")
        sd = {}
        for param_dir in sorted(p for p in (universal / "zero").iterdir() if (p / "fp32.pt").is_file()):
            tensor = torch.load(param_dir / "fp32.pt", map_location="cpu", weights_only=False)["param"]
            sd[param_dir.name] = tensor.to(dtype)
        save_torch_state_dict(sd, str(out), max_shard_size=max_shard_size, safe_serialization=True)


def export_lora(base: Path, tag: str, stage: int, out: Path, dtype, merge: bool, max_shard_size: str) -> None:
    """The checkpoint holds the adapter only (the frozen base was left out); peft puts it back on its base."""
    import torch

    ckpt = base / tag
    if stage == 0:
        module = torch.load(next(ckpt.glob("*model_states.pt")), map_location="cpu", weights_only=False)["module"]
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        module = get_fp32_state_dict_from_zero_checkpoint(str(base), tag=tag, exclude_frozen_parameters=True)
    from peft import LoraConfig

    model = peft_model_from(LoraConfig.from_pretrained(str(ckpt / HF_FILES)), module, dtype)
    if merge:
        model.merge_and_unload().save_pretrained(out, max_shard_size=max_shard_size, safe_serialization=True)
    else:
        model.save_pretrained(out, safe_serialization=True)
    skip = {"config.json", "generation_config.json", "adapter_config.json"}  # written by save_pretrained
    for f in (ckpt / HF_FILES).iterdir():
        if f.name not in skip:
            shutil.copy2(f, out / f.name)


def set_config_dtype(out: Path, dtype: str) -> None:
    import json

    p = out / "config.json"
    cfg = json.loads(p.read_text())
    cfg["dtype"] = dtype
    p.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path, help="an output_dir, its checkpoints/ dir, or a checkpoints/step-N dir")
    ap.add_argument("out_dir", type=Path, help="new directory for the HF model")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="weights dtype (default fp32)")
    ap.add_argument("--max_shard_size", default="5GB", help="largest safetensors shard (default 5GB)")
    ap.add_argument("--merge", action="store_true", help="LoRA checkpoints: merge the adapter into its base")
    args = ap.parse_args(argv)
    try:
        ckpt = export(args.checkpoint, args.out_dir, args.dtype, args.max_shard_size, args.merge)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    loader = (
        f"PeftModel.from_pretrained(base, '{args.out_dir}')"
        if is_adapter_dir(args.out_dir)
        else f"AutoModelForCausalLM.from_pretrained('{args.out_dir}')"
    )
    print(f"exported {ckpt} -> {args.out_dir} ({args.dtype}); {loader} loads it")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
