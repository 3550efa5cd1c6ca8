"""What a launch is, for the estimate: GPUs, micro-batch and sequence, and the settings of the run's own stack
(attention, optimizer, loss, a model built before DeepSpeed) that change its memory."""

from __future__ import annotations

from dataclasses import dataclass

from .moe import EXPERT_IMBALANCE
from .preloaded import Preloaded


@dataclass
class Launch:
    num_gpus: int = 1  # per node
    num_nodes: int = 1
    micro_batch_size: int = 1
    seq_len: int = 2048
    gradient_checkpointing: bool = False
    attn_implementation: str = "sdpa"
    accelerator: str = "gpu"
    """"gpu": device and host apart, by DeepSpeed's GPU code path (states.gpu_phases). "cpu": the CPU accelerator's
    one pool (states.cpu_phases), for checking against CPU runs."""
    optim: str = "adamw_torch_fused"
    """train.py's --optim: the optimizer step's temporaries follow it (states.adam_temporaries)."""
    optimizer_temporaries: int | None = None
    """Bytes per stepped element the optimizer step allocates, for another project's optimizer (torch's
    single-tensor AdamW 8, foreach 4, fused 0). None: train.py's, by `optim` and the accelerator."""
    tiled_loss: bool = True
    """train.py's --tiled_loss: the head and loss over tiles once a micro-batch has more tokens than one tile."""
    loss_tile_tokens: int = 0
    """train.py's --loss_tile_tokens (0: one tile's fp32 logits at most 256 MiB)."""
    tiled_mlp: bool = False
    """train.py's --tiled_mlp: every MLP through DeepSpeed's TiledMLP."""
    objective: str = "lm"
    """train.py's --objective: "dpo" traces a preference step (memory/objective.py; its loss is never tiled)."""
    expert_imbalance: float = EXPERT_IMBALANCE
    """Under expert parallelism: the most-loaded rank's routed rows over the balanced tokens x k (memory/moe.py)."""
    preloaded: Preloaded | None = None
    """A model built before DeepSpeed (--zero_init false, preloaded.py); None: built under zero.Init, as train.py does."""
    liger: bool = False
    """Liger-Kernel's SwiGLU and RMSNorm in the trace (liger.py); its fused cross-entropy is the tiled loss."""
    moment_bytes: float | None = None
    """Bytes of each optimizer moment for another stack's optimizer (bitsandbytes' 8-bit Adam: 1); None: the config's."""

    @property
    def world(self) -> int:
        return self.num_gpus * self.num_nodes
