"""Resuming a run: where it loads from (its own layout, or DeepSpeed's universal conversion for another world
size or ZeRO stage), what cannot be converted (refused before any process group starts), and restoring the
engine, every rank's RNG and the data order's position."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from zero_recipes.checkpointing.checkpoint import UNIVERSAL_SUFFIX, has_frozen, resolve_resume
from zero_recipes.checkpointing.integrity import LAYOUT
from zero_recipes.checkpointing.rng import set_rng_state
from zero_recipes.errors import ConfigError
from zero_recipes.parallel.mesh import ranks_in_words


def layout_change(where: tuple[Path, str], mesh, stage: int) -> Optional[dict]:
    """The saved layout (data-parallel size "world", tensor-parallel size, stage) when it differs from this
    run's; None when it matches. A change DeepSpeed's universal checkpoint cannot make is refused in one line."""
    f = where[0] / where[1] / LAYOUT
    if not f.is_file():
        return None  # saved before layouts were recorded: load as is
    saved = json.loads(f.read_text())
    saved_tp = saved.get("tensor_parallel", 1)
    if saved_tp != mesh.tp:
        # DeepSpeed 0.19.8's universal checkpoint re-slices AutoTP weights only at the degree they were saved
        # with (its AutoTP conversion is not TP-degree-aware), so loading at another would mix shards.
        raise ConfigError(
            f"cannot resume a checkpoint saved with tensor_parallel.autotp_size {saved_tp} at autotp_size "
            f"{mesh.tp}: DeepSpeed's universal checkpoint changes the data-parallel size only. Resume with "
            f"autotp_size {saved_tp}, or export it (tools/export_hf.py) and start from the export with "
            "--model_name_or_path"
        )
    saved_pp = saved.get("pipeline_parallel", 1)
    if saved_pp != mesh.pp:
        # each stage's optimizer states (ZeRO-0: mp_rank_XX, ZeRO-1: its partitions) belong to its layers
        raise ConfigError(
            f"cannot resume a checkpoint saved with pipeline.stages {saved_pp} at {mesh.pp} stage(s): each stage's "
            f"optimizer states belong to its own layers, and DeepSpeed's universal checkpoint changes the "
            f"data-parallel size only. Resume with {saved_pp} stages, or export it (tools/export_hf.py) and start "
            "from the export with --model_name_or_path"
        )
    saved_ep = saved.get("expert_parallel", 1)
    if (saved_ep > 1 or mesh.ep > 1) and (saved_ep, saved["world"], saved["zero_stage"]) != (mesh.ep, mesh.dp, stage):
        # not tested here: DeepSpeed's universal conversion of AutoEP checkpoints (autoep_universal.py) is new
        raise ConfigError(
            f"cannot resume a ZeRO-{saved['zero_stage']} checkpoint of {ranks_in_words(saved)} on {mesh.describe()} "
            f"with ZeRO-{stage}: train.py resumes an expert-parallel run only on the layout it was saved with. "
            "Resume with that layout, or export it (the run's output directory) and start from the export with "
            "--model_name_or_path"
        )
    saved_sp = saved.get("sequence_parallel", 1)
    if saved["world"] == mesh.dp and saved_sp == mesh.sp and saved["zero_stage"] == stage:
        return None
    if loads_as_saved(saved, stage):
        return saved
    if saved_tp > 1 and 3 in (saved["zero_stage"], stage):
        raise ConfigError(
            f"cannot resume this ZeRO-{saved['zero_stage']} checkpoint of {ranks_in_words(saved)} as ZeRO-{stage} with "
            f"{mesh.dp} data-parallel ranks: DeepSpeed 0.19.8's universal conversion fails on ZeRO-3 + "
            f"tensor-parallel checkpoints (ds_to_universal: 'exceeds dimension size'). Resume with "
            f"{saved['world']} data-parallel x {saved_tp} tensor-parallel ranks and ZeRO-{saved['zero_stage']}"
        )
    a, b = saved["zero_stage"], stage
    if a == 0 or b == 0 or (a == 3) != (b == 3):
        raise ConfigError(
            f"cannot resume a ZeRO-{a} checkpoint as ZeRO-{b}: DeepSpeed's universal checkpoint changes "
            "the world size for ZeRO-1/2/3 and converts between ZeRO-1 and 2, nothing else. Resume "
            f"with ZeRO-{a}, or export it (tools/export_hf.py) and start from the export with "
            "--model_name_or_path"
        )
    return saved


def loads_as_saved(saved: dict, stage: int) -> bool:
    """A layout change the engine loads without conversion: a pipeline's ZeRO-0 checkpoint onto another
    number of pipelines (each stage's files hold its whole states, the same for every replica)."""
    return saved.get("pipeline_parallel", 1) > 1 and saved["zero_stage"] == stage == 0


def to_universal(where: tuple[Path, str], rank: int) -> tuple[Path, str]:
    """Convert a checkpoint once with DeepSpeed's own ds_to_universal (rank 0; the others wait on the host group:
    a 70B conversion takes longer than --ddp_timeout)."""
    import torch

    from zero_recipes.distributed.process_group import host_group

    error = [None]
    if rank == 0:
        try:
            convert_to_universal(where)
        except ConfigError as e:
            error[0] = str(e)
    torch.distributed.broadcast_object_list(error, src=0, group=host_group())
    if error[0]:
        raise ConfigError(error[0])
    return where[0], where[1] + UNIVERSAL_SUFFIX


def convert_to_universal(where: tuple[Path, str], out: Optional[Path] = None) -> Path:
    """DeepSpeed's universal form of a checkpoint, in `out` or next to it (made once): one full fp32 tensor
    per parameter in zero/<name>/fp32.pt, its ZeRO partitions and AutoTP shards merged by DeepSpeed's
    ds_to_universal. One process, no process group."""
    import subprocess
    import sys

    load_dir, tag = where
    out = out or load_dir / (tag + UNIVERSAL_SUFFIX)
    if (out / "zero").is_dir():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            str(load_dir / tag),
            "--output_folder",
            str(tmp),
            "--inject_missing_state",
        ],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(
            f"converting {load_dir / tag} to a universal checkpoint failed: "
            + (proc.stderr.strip().splitlines() or ["no output"])[-1]
        )
    for f in (load_dir / tag).glob("layer_*-model_states.pt"):  # a pipeline's weights, which ds_to_universal
        shutil.copy2(f, tmp / f.name)  # leaves out and PipelineEngine loads its module from
    tmp.replace(out)
    return out


def data_position(
    saved_at: tuple[Path, str], rank_state: dict, layout_changed: bool, micro: int, world: int
) -> Optional[dict]:
    """Where this rank's data order continues. On the same layout, its own saved position; on another
    data-parallel size, rank 0's position recounted: the same rows consumed, in this run's micro-batches x
    data-parallel ranks (rounded down); `world` counts data-parallel ranks. saved_at is the original checkpoint, not its universal conversion (which has no rank files)."""
    if not layout_changed:
        return rank_state.get("data")
    import torch

    saved = torch.load(saved_at[0] / saved_at[1] / "rng_state_0.pt", weights_only=False)["data"]
    rows = saved["index"] * saved["micro"] * saved["world"]
    return {"epoch": saved["epoch"], "index": rows // (micro * world), "world": world, "micro": micro}


def load(engine, where: tuple[Path, str], rank: int) -> tuple[dict, dict]:
    """Returns (the client state rank 0 saved, this rank's own state)."""
    import torch

    load_dir, tag = where
    path, client_state = engine.load_checkpoint(
        str(load_dir),
        tag=tag,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
        load_module_strict=not has_frozen(engine),  # frozen weights were left out; they are the base's
    )
    if path is None:
        raise ConfigError(f"could not load checkpoint {load_dir / tag}")
    rng_file = load_dir / tag / f"rng_state_{rank}.pt"
    own = {}
    if rng_file.is_file():
        own = torch.load(rng_file, weights_only=False)
        set_rng_state(own)
    return client_state or {}, own


@dataclass(frozen=True)
class ResumePlan:
    """Where a resumed run loads from. On another world size or ZeRO stage it loads DeepSpeed's universal
    conversion of the checkpoint (a pipeline's ZeRO-0 files as saved), while its data position still comes
    from the checkpoint as saved."""

    saved_at: tuple[Path, str]
    """The checkpoint as saved: (directory holding the tags, tag)."""
    load_from: tuple[Path, str]
    """What the engine loads: `saved_at`, or its universal conversion."""
    saved_layout: Optional[dict] = None
    """The saved world size and stage when they differ from this run's, else None."""

    def engine_config(self, ds: dict) -> dict:
        """The DeepSpeed dict to build the engine with: a universal checkpoint needs `load_universal`."""
        if self.load_from == self.saved_at:
            return ds
        return {**ds, "checkpoint": {**ds.get("checkpoint", {}), "load_universal": True}}


def check_resume_layout(request: Optional[str], plan) -> None:
    """Refuse, before any process group starts, a resume onto another world size or ZeRO stage that cannot
    be converted (layout_change refuses the stage changes DeepSpeed cannot make)."""
    where, _ = resolve_resume(plan.output_dir, request)  # a damaged checkpoint is refused or passed over here
    saved = layout_change(where, plan.mesh, plan.zero_stage) if where else None
    if saved is None:
        return
    if refusal := plan.adapter.resume_refusal(saved, ranks_in_words(saved)):
        raise ConfigError(refusal)
    if plan.cfg.streaming:
        raise ConfigError(
            f"this streamed run was saved by {ranks_in_words(saved)}; a stream's per-rank "
            "position cannot move to another world size. Resume with the same number of ranks"
        )


def plan_resume(request: Optional[str], plan, rank: int, log) -> Optional[ResumePlan]:
    """The checkpoint this launch resumes from, converted for a new layout when needed; None to start
    from scratch. `request` is what check_output_dir decided ('auto', a path or None). Collective when a
    conversion runs (rank 0 converts, the others wait)."""
    where, passed_over = resolve_resume(plan.output_dir, request)
    if passed_over:
        log(passed_over)
    if where is None:
        if request is not None:
            log(f"resume: no checkpoint in {plan.output_dir}, starting from scratch")
        return None
    saved = layout_change(where, plan.mesh, plan.zero_stage)
    if saved is None:
        return ResumePlan(where, where)
    now = plan.mesh.layout()
    if loads_as_saved(saved, plan.zero_stage):
        log(
            f"resume: {where[1]} was saved by {ranks_in_words(saved)}, this run has "
            f"{ranks_in_words(now).removesuffix(' rank(s)')}; every replica loads its stage's files as saved"
        )
        return ResumePlan(where, where, saved)
    log(
        f"resume: {where[1]} was saved by {ranks_in_words(saved)} with ZeRO-{saved['zero_stage']}, this run has "
        f"{ranks_in_words(now).removesuffix(' rank(s)')} with ZeRO-{plan.zero_stage}; converting it with DeepSpeed's "
        "universal checkpoint"
    )
    return ResumePlan(where, to_universal(where, rank), saved)


def restore(engine, resume: ResumePlan, order, plan, rank: int, log) -> int:
    """Load the engine's states, this rank's RNG and the data order's position. Returns the step."""
    state, rank_state = load(engine, resume.load_from, rank)
    step = int(state.get("step", engine.global_steps))
    position = data_position(
        resume.saved_at, rank_state, resume.saved_layout is not None, plan.cfg.per_device_train_batch_size, plan.mesh.dp
    )
    if position is not None:
        order.load_state_dict(position)
    log(f"resume: loaded {resume.load_from[0] / resume.load_from[1]} at step {step}")
    return step
