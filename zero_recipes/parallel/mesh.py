"""The parallel mesh: how a launch's ranks split along every axis. Pure arithmetic (no torch, no DeepSpeed):
the single home of the divisibility rules, rank -> coordinates, the data-parallel rank that shards batches,
what DeepSpeed averages gradients over and what a metric counts once per group.

    world = data-parallel x tensor-parallel        rank = dp_rank * tp + tp_rank
    world = data-parallel x sequence-parallel      rank = dp_rank * sp + sp_rank
    world = pipeline stages x data-parallel        rank = stage * dp + dp_rank

The model-parallel axes (tensor, sequence) sit innermost, as DeepSpeed lays them out: its (data, tensor) mesh
puts the tensor dimension innermost (`utils/groups._init_tp_mesh_device`) and parallel_state_sp makes an SP group of consecutive ranks. So a group is `group` consecutive ranks, on one node
when it divides the GPUs per node, which is where its all-reduces and all-to-alls belong (NVLink, not the
network). Every rank of a group feeds the same rows, so the data order, eval and every count are sharded by
data-parallel rank. Pipeline stages sit outermost, as DeepSpeed's PipeDataParallelTopology lays them out
(axes ['pipe', 'data']): a stage's replicas are consecutive ranks, so its gradient all-reduce stays on a node
and only the activations between stages cross nodes, the traffic a pipeline is for. What each axis does with
its group is its own module's (tensor_parallel.py, sequence_parallel.py, pipeline/axis.py); which axes and
modes combine is combinations.py's table. Expert parallelism is no group that shares rows: every rank trains its
own, and only the experts are split over `ep` ranks (`expert_shards`; expert_parallel.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from zero_recipes.ds.facts import (
    expert_parallel_size,
    pipeline_parallel_size,
    sequence_parallel_size,
    tensor_parallel_size,
)
from zero_recipes.errors import ConfigError
from zero_recipes.parallel import combinations


@dataclass(frozen=True)
class Mesh:
    world: int
    tp: int = 1
    sp: int = 1
    pp: int = 1
    """Pipeline stages (DeepSpeed's PipelineModule: parallel/pipeline/axis.py)."""
    ep: int = 1
    """Expert-parallel ranks (DeepSpeed AutoEP: expert_parallel.py). Not a group that shares rows: every rank
    trains its own, and only the experts are split, so it leaves `group` and `dp` alone."""

    @classmethod
    def of(cls, world: int, ds: dict) -> "Mesh":
        """The mesh a DeepSpeed dict asks for on `world` ranks."""
        return cls(
            world,
            tensor_parallel_size(ds),
            sequence_parallel_size(ds),
            pipeline_parallel_size(ds),
            expert_parallel_size(ds),
        )

    @property
    def sizes(self) -> dict[str, int]:
        """Each model-parallel axis by the name combinations.py and the checkpoint layout use."""
        return {"tensor": self.tp, "sequence": self.sp, "pipeline": self.pp, "expert": self.ep}

    @property
    def group(self) -> int:
        """Ranks that train the same rows together: a TP group, an SP group, a pipeline, or 1."""
        return self.tp * self.sp * self.pp

    @property
    def dp(self) -> int:
        """Data-parallel replicas: the groups of ranks that see different batches."""
        return self.world // self.group

    @property
    def zero_shards(self) -> int:
        """Ranks ZeRO partitions the model states over: the data-parallel ones under TP (DeepSpeed's (data,
        tensor) mesh), every rank under SP (its seq_data_parallel_group is the world), a stage's replicas under
        PP (each stage has its own ZeRO-1 optimizer)."""
        return self.world // (self.tp * self.pp)

    @property
    def expert_shards(self) -> int:
        """Ranks ZeRO partitions an expert's states over: those holding the same experts (DeepSpeed's expert-data-
        parallel group, world / ep), where the dense weights' are every rank's."""
        return self.world // self.ep

    def coords(self, rank: int) -> tuple[int, int]:
        """(dp_rank, index within the TP or SP group, or pipeline stage) of a global rank."""
        if self.pp > 1:
            stage, dp_rank = divmod(rank, self.dp)
            return dp_rank, stage
        return divmod(rank, self.group)

    def dp_rank(self, rank: int) -> int:
        return self.coords(rank)[0]

    def stage(self, rank: int) -> int:
        """The pipeline stage a rank runs (0 without PP)."""
        return rank // self.dp if self.pp > 1 else 0

    def sp_rank(self, rank: int) -> int:
        """Which slice of each sequence this rank trains (0 without SP)."""
        return rank % self.sp

    def describe(self) -> str:
        """The launch line: `8 ranks = 4 data-parallel x 2 tensor-parallel`."""
        ranks = f"{self.world} rank{'s' if self.world != 1 else ''}"
        inner = "".join(f" x {n} {name}-parallel" for name, n in self.sizes.items() if n > 1 and name != "expert")
        experts = f"; experts split {self.ep} ways (expert-parallel groups of {self.ep})" if self.ep > 1 else ""
        return f"{ranks} = {self.dp} data-parallel{inner}{experts}"

    def layout(self) -> dict:
        """What a checkpoint records of the mesh (integrity.LAYOUT), and what a resume compares with it."""
        return {
            "world": self.dp,
            "tensor_parallel": self.tp,
            "sequence_parallel": self.sp,
            "pipeline_parallel": self.pp,
            "expert_parallel": self.ep,
        }

    def eval_shard(self, rank: int) -> tuple[int, int]:
        """(this rank's share, shares) of the eval rows. Under SP, eval runs whole rows without SP (see
        sequence_parallel.py), so every rank takes its own; under TP a TP group evaluates the same rows."""
        if self.sp > 1:
            return rank, self.world
        return self.dp_rank(rank), self.dp

    def gradient_divisor(self, zero_stage: int) -> int:
        """What DeepSpeed divides the sum of all ranks' gradients by. ZeRO-1/2 sum over a sequence-parallel
        group and average over the data-parallel replicas; ZeRO-3's reduce-scatter (its default path) averages
        over every rank, SP or not (stage3.py `__avg_scatter_grads`: measured, SP=2 gave half the gradient).
        Each rank's loss is scaled by this, so the step's gradient is the global batch's mean either way."""
        return self.world if (self.sp > 1 and zero_stage == 3) else self.dp

    def loss_shares(self, zero_stage: int) -> int:
        """How many ranks' logged losses make one replica's: under SP a rank's loss is its slice's share of
        the replica's, scaled by gradient_divisor / dp (metrics_log.LogWindow)."""
        return self.sp * self.dp // self.gradient_divisor(zero_stage)

    def check(self) -> None:
        """The axes combine (combinations.py) and each divides the world."""
        combinations.refuse({axis: n for axis, n in self.sizes.items() if n > 1})
        for axis, n, key, short in (
            ("sequence", self.sp, "sequence_parallel_size", "a sequence_parallel_size"),
            ("tensor", self.tp, "tensor_parallel.autotp_size", "an autotp_size"),
            ("pipeline", self.pp, "pipeline.stages", "a stage count"),
            ("expert", self.ep, "expert_parallel.autoep_size", "an autoep_size"),
        ):
            if self.world % n:
                raise ConfigError(
                    f"{self.world} rank(s) cannot split into {axis}-parallel groups of {n}: the world size must be a "
                    f"multiple of {key}; launch {max(n, self.world - self.world % n)} ranks or pick {short} that "
                    "divides the world size"
                )


def ranks_in_words(layout: dict) -> str:
    """A checkpoint's layout (Mesh.layout, as saved) in words: "2 rank(s)", or "2 data-parallel x 2
    tensor-parallel rank(s)"."""
    inner = "".join(
        f" x {layout[key]} {axis}-parallel"
        for axis, key in (
            ("tensor", "tensor_parallel"),
            ("sequence", "sequence_parallel"),
            ("pipeline", "pipeline_parallel"),
            ("expert", "expert_parallel"),
        )
        if layout.get(key, 1) > 1
    )
    return f"{layout['world']} data-parallel{inner} rank(s)" if inner else f"{layout['world']} rank(s)"


def picture(mesh: Mesh, gpus_per_node: Optional[int] = None) -> str:
    """The mesh as a grid of global ranks: a row per data-parallel replica (dp), a column per
    tensor-parallel (tp) or sequence-parallel (sp) index or pipeline stage (pp), and the node each row sits on
    when the GPUs per node are given. TP's per-layer all-reduces, SP's all-to-alls and a pipeline's activations
    run along a row; ZeRO's gradient and parameter collectives run down a column (under SP, across every
    rank). Under PP a stage's replicas are consecutive ranks, so a column, not a row, shares a node."""
    width = max(4, len(str(mesh.world - 1)) + 1)
    node_col = gpus_per_node is not None and mesh.pp == 1
    axis, n = ("sp", mesh.sp) if mesh.sp > 1 else ("pp", mesh.pp) if mesh.pp > 1 else ("tp", mesh.tp)

    def rank_of(d: int, t: int) -> int:
        return t * mesh.dp + d if mesh.pp > 1 else d * n + t

    head = (
        ("        " if node_col else "") + "      " + "".join(f"{axis + ' ' + str(t):>{width + 2}}" for t in range(n))
    )
    rows = [head.rstrip()]
    for d in range(mesh.dp):
        node = f"node {d * n // gpus_per_node:<3}" if node_col else ""
        rows.append(f"{node}dp {d:<3}" + "".join(f"{rank_of(d, t):>{width + 2}}" for t in range(n)))
    if gpus_per_node is not None and mesh.pp > 1:
        spans = [(rank_of(0, t) // gpus_per_node, rank_of(mesh.dp - 1, t) // gpus_per_node) for t in range(n)]
        cells = [str(a) if a == b else f"{a}-{b}" for a, b in spans]
        rows.append("node  " + "".join(f"{c:>{width + 2}}" for c in cells))
    return "\n".join(rows)
