"""The resolved run: every option of a launch worked out once, in one object that flows down.

    plan = RunPlan.from_args(argv)              # schema <- recipe <- flags; DeepSpeed JSON merged and resolved
    plan = plan.complete(total_steps, tokenizer)  # once the data gives the step count

After `complete` nothing changes it: train.py, the engine, checkpoints and metrics only read it. A plan is
frozen; `complete` returns a new one (with its own copy of the model config it sizes to the tokenizer).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from zero_recipes import modes
from zero_recipes.config import lora_options, lr_defaults
from zero_recipes.config.cli import parse_args
from zero_recipes.config.train_config import RUN_CONTROL_FIELDS, TrainConfig, parse_inline_or_file, parse_model_config
from zero_recipes.distributed.launcher_env import rank_info
from zero_recipes.ds import intake as ds_config
from zero_recipes.ds.facts import precision, precision_words, zero_stage
from zero_recipes.errors import ConfigError
from zero_recipes.modeling import hub, model as modeling, moe
from zero_recipes.parallel import combinations
from zero_recipes.parallel.axis import Parallelism
from zero_recipes.parallel.mesh import Mesh


@dataclass(frozen=True)
class RunPlan:
    cfg: TrainConfig
    """The typed config, with the values the DeepSpeed file sets explicitly adopted."""
    raw_ds: dict
    """The DeepSpeed fragments merged as given, "auto"s and all: what the run signature records."""
    ds: dict
    """The DeepSpeed dict `deepspeed.initialize` gets: every "auto" filled (the step counts once complete)."""
    notes: tuple[str, ...]
    """What resolution decided on the user's behalf (adopted values), printed at launch."""
    model_config: Any
    """The HF model config; sized to the tokenizer's vocabulary by `complete`."""
    mesh: Mesh
    """How the ranks split: data-parallel replicas x tensor- or sequence-parallel groups."""
    signature: dict
    """What makes two launches the same run (see run_dir.check_output_dir)."""
    total_steps: Optional[int] = None
    """Optimizer steps to train; None until `complete`."""

    @classmethod
    def from_args(cls, argv: list[str]) -> RunPlan:
        cfg, explicit = parse_args(argv)
        raw = ds_config.load_fragments(cfg.deepspeed) if cfg.deepspeed else {}
        model_config, notes = hub.dry_run_model_config(cfg) if cfg.dry_run else (modeling.load_model_config(cfg), ())
        world = rank_info().world_size
        group = Mesh.of(1, raw)
        needed = max(group.group, group.ep)  # expert-parallel ranks are not a group sharing rows, but need ranks
        if cfg.dry_run and world == 1 and needed > 1:  # `python train.py --dry_run` on a login node
            world = needed
            kind = next(f"{axis}-parallel" for axis, n in group.sizes.items() if n > 1)
            notes += (
                f"dry run without a launcher: planned for {world} ranks (one {kind} group); set WORLD_SIZE "
                "(and LOCAL_WORLD_SIZE, the GPUs per node) to plan the real mesh",
            )
        resolved = ds_config.resolve(raw, cfg, explicit, world, modeling.hidden_size(model_config))
        cfg = resolved.cfg
        notes += lr_defaults.note(cfg, explicit)  # after resolve: a DeepSpeed file's value is adopted, not a default
        ds_config.with_steps(resolved.ds, cfg, max(cfg.max_steps, 1))  # an "auto" nobody can fill fails now
        mesh = Mesh.of(world, resolved.ds)
        adapter = lora_options.adapter_name(cfg)
        active = combinations.modes(mesh.sizes, zero_stage(resolved.ds), adapter, cfg.objective)
        combinations.refuse(active)
        modes.objective_for(cfg).check(cfg, active)
        notes += resolved.notes + modes.parallelism_for(mesh).check(model_config, resolved.ds, cfg)
        modeling.check_attention(model_config)  # after the axes' checks: they name the attention SP needs
        moe.check(model_config, zero_stage(resolved.ds), resolved.ds)
        coef = moe.enable_balancing_loss(model_config, cfg.router_aux_loss_coef)
        if coef is not None:
            notes += (
                f"balancing loss: router_aux_loss_coef {coef:g} x aux_loss added to the loss, logged as aux_loss",
            )
        modes.adapter_for(cfg).check(model_config)  # a LoRA target the model lacks fails here, on the meta model
        return cls(cfg, raw, resolved.ds, notes, model_config, mesh, run_signature(cfg, raw))

    def complete(self, total_steps: int, tokenizer=None) -> RunPlan:
        """The plan with the step count filled into the DeepSpeed dict and the model config sized to the
        tokenizer (a random-init model takes its vocabulary and special ids from it)."""
        if self.total_steps is not None:
            raise RuntimeError("RunPlan.complete called twice")
        model_config = self.model_config
        if tokenizer is not None:
            model_config = copy.deepcopy(model_config)
            cfg = self.cfg
            if cfg.model_name_or_path is None and cfg.model_config is None:
                model_config.vocab_size = len(tokenizer)  # the embedded model is sized to the embedded tokenizer
            elif len(tokenizer) > model_config.get_text_config().vocab_size:
                raise ConfigError(
                    f"tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
                    f"{model_config.get_text_config().vocab_size}; use the model's own tokenizer"
                )
            if cfg.model_name_or_path is None:  # random init: generate() must stop where the tokenizer ends text
                modeling.use_tokenizer_special_ids(model_config, tokenizer)
        ds = ds_config.with_steps(self.ds, self.cfg, total_steps)
        return dataclasses.replace(self, ds=ds, model_config=model_config, total_steps=total_steps)

    def steps_to_train(self, micro_batches_per_rank: int) -> int:
        """`max_steps`, or the epochs' worth of optimizer steps over a rank's micro-batches per epoch."""
        cfg = self.cfg
        if cfg.max_steps > 0:
            return cfg.max_steps
        steps_per_epoch = micro_batches_per_rank // cfg.gradient_accumulation_steps
        return max(1, math.ceil(cfg.num_train_epochs * steps_per_epoch))

    # ---- read-only views -------------------------------------------------------------------------
    @property
    def world(self) -> int:
        """Ranks in the job."""
        return self.mesh.world

    @property
    def output_dir(self) -> Path:
        return Path(self.cfg.output_dir)

    @property
    def zero_stage(self) -> int:
        return zero_stage(self.ds)

    @property
    def precision(self) -> str:
        return precision(self.ds)

    @property
    def precision_words(self) -> str:
        """The precision as the log and --dry_run say it: autocast and bf16 states named (ds.facts)."""
        return precision_words(self.ds)

    @property
    def parallelism(self) -> Parallelism:
        """The run's parallel axes (modes.AXES), picked once from the mesh."""
        return modes.parallelism_for(self.mesh)

    @property
    def adapter(self):
        """How the model is adapted (modes.ADAPTERS: full fine-tuning, LoRA, QLoRA), picked from the config."""
        return modes.adapter_for(self.cfg)

    @property
    def objective(self):
        """What the run optimises (modes.OBJECTIVES: language modelling, preference optimisation)."""
        return modes.objective_for(self.cfg)

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step, all data-parallel replicas together (a TP group shares its rows)."""
        return self.ds["train_batch_size"]


def run_signature(cfg: TrainConfig, raw_ds: dict) -> dict:
    """What makes two launches the same run: every field but the per-launch controls, plus DeepSpeed."""
    d = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in RUN_CONTROL_FIELDS}
    d["model_config"] = parse_model_config(cfg.model_config)
    d["dataset_mixture"] = parse_inline_or_file("dataset_mixture", cfg.dataset_mixture)
    d["deepspeed"] = raw_ds
    return json.loads(json.dumps(d, sort_keys=True, default=str))
