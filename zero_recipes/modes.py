"""The registry: every parallel axis and every adapter train.py knows, each one line. A new mode is its own
module plus its line here (docs/architecture.md, "Adding a parallelism or an adapter").

The run picks its modes once, in setup (`plan.parallelism`, `plan.adapter`); the training loop never asks.
"""

from __future__ import annotations

from . import lora_options
from .adapter import FullFineTuning
from .axis import Parallelism
from .expert_parallel import ExpertParallel
from .lora import Lora, QLora
from .mesh import Mesh
from .pipeline_parallel import PipelineParallel
from .sequence_parallel import SequenceParallel
from .tensor_parallel import TensorParallel

AXES = {
    "tensor": TensorParallel,
    "sequence": SequenceParallel,
    "pipeline": PipelineParallel,
    "expert": ExpertParallel,
}
"""By Mesh.sizes' names."""

ADAPTERS = {"full": FullFineTuning, "lora": Lora, "qlora": QLora}
"""By lora_options.adapter_name."""


def adopt(ds: dict) -> tuple[str, ...]:
    """Every axis reads the other projects' spellings of its size into DeepSpeed's, before the mesh exists."""
    return tuple(note for axis in AXES.values() for note in axis.adopt(ds))


def parallelism_for(mesh: Mesh) -> Parallelism:
    """The run's active axes: those of size > 1."""
    return Parallelism(mesh, [AXES[name](mesh) for name, n in mesh.sizes.items() if n > 1 and name in AXES])


def adapter_for(cfg):
    return ADAPTERS[lora_options.adapter_name(cfg)](cfg)
