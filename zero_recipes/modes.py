"""The registry: every parallel axis and every adapter train.py knows, each one line. A new mode is its own
module plus its line here (docs/architecture.md, "Adding a parallelism or an adapter").

The run picks its modes once, in setup (`plan.parallelism`, `plan.adapter`); the training loop never asks.
"""

from __future__ import annotations

from zero_recipes.adapters.base import FullFineTuning
from zero_recipes.adapters.lora import Lora, QLora
from zero_recipes.config import lora_options
from zero_recipes.parallel.axis import Parallelism
from zero_recipes.parallel.expert_parallel import ExpertParallel
from zero_recipes.parallel.mesh import Mesh
from zero_recipes.parallel.pipeline.axis import PipelineParallel
from zero_recipes.parallel.sequence_parallel import SequenceParallel
from zero_recipes.parallel.tensor_parallel import TensorParallel
from zero_recipes.preference.objective import Preference
from zero_recipes.training.objective import LanguageModeling

AXES = {
    "tensor": TensorParallel,
    "sequence": SequenceParallel,
    "pipeline": PipelineParallel,
    "expert": ExpertParallel,
}
"""By Mesh.sizes' names."""

ADAPTERS = {"full": FullFineTuning, "lora": Lora, "qlora": QLora}
"""By lora_options.adapter_name."""

OBJECTIVES = {"lm": LanguageModeling, "dpo": Preference}
"""By TrainConfig.objective."""


def adopt(ds: dict) -> tuple[str, ...]:
    """Every axis reads the other projects' spellings of its size into DeepSpeed's, before the mesh exists."""
    return tuple(note for axis in AXES.values() for note in axis.adopt(ds))


def parallelism_for(mesh: Mesh) -> Parallelism:
    """The run's active axes: those of size > 1."""
    return Parallelism(mesh, [AXES[name](mesh) for name, n in mesh.sizes.items() if n > 1 and name in AXES])


def adapter_for(cfg):
    return ADAPTERS[lora_options.adapter_name(cfg)](cfg)


def objective_for(cfg):
    return OBJECTIVES[cfg.objective](cfg)
