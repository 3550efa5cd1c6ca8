"""The parallel mesh: how a launch's ranks split into data-parallel replicas and tensor-parallel or
sequence-parallel groups.

    world = data-parallel x tensor-parallel        rank = dp_rank * tp + tp_rank
    world = data-parallel x sequence-parallel      rank = dp_rank * sp + sp_rank

Tensor parallelism is DeepSpeed's AutoTP (`"tensor_parallel": {"autotp_size": N}`): each linear layer of a
transformer block is split across the N ranks of a group along the model's own TP plan, and ZeRO shards
the model states across the data-parallel replicas. DeepSpeed lays the mesh out as (data, tensor) with the
tensor dimension innermost (`utils/groups._init_tp_mesh_device`), so a TP group is N consecutive ranks: on
one node when N divides the GPUs per node, which is where TP's all-reduces belong (NVLink, not the network).

Every rank of a TP group must feed the same batch (DeepSpeed checks the first one: "Data inconsistency
within the TP group"), so the data order, eval and every count are sharded by data-parallel rank.

Sequence parallelism is DeepSpeed's Ulysses (ALST, `"sequence_parallel_size": N`; sequence_parallel.py):
the N ranks of a group (consecutive, as DeepSpeed's parallel_state_sp lays them out) take the same rows and
each trains a 1/N slice of every sequence; attention all-to-alls to whole sequences with 1/N of the heads.
ZeRO shards over all ranks and DeepSpeed sums gradients over the SP group. TP and SP do not combine here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .config import ConfigError


def tensor_parallel_size(ds: dict) -> int:
    """The AutoTP degree a DeepSpeed dict asks for (1: none)."""
    block = ds.get("tensor_parallel") or {}
    return max(1, int(block.get("autotp_size", 0) or 0)) if isinstance(block, dict) else 1


def sequence_parallel_size(ds: dict) -> int:
    """The Ulysses degree a DeepSpeed dict asks for (1: none)."""
    return max(1, int(ds.get("sequence_parallel_size", 1) or 1))


def adopt_llamafactory_sequence_parallel(ds: dict) -> tuple[str, ...]:
    """LLaMA-Factory's `"sequence_parallel": {"enabled", "size", "mode"}` block (its own code reads it,
    DeepSpeed does not) becomes DeepSpeed's `sequence_parallel_size`, so its ALST configs run unchanged."""
    block = ds.get("sequence_parallel")
    if not isinstance(block, dict):
        return ()
    ds.pop("sequence_parallel")
    if not block.get("enabled"):
        return ('dropped LLaMA-Factory\'s disabled "sequence_parallel" block',)
    mode, size = str(block.get("mode", "ulysses")).lower(), block.get("size")
    if mode != "ulysses" or not isinstance(size, int) or size < 1:
        raise ConfigError(
            f'"sequence_parallel" (LLaMA-Factory\'s block) asks for mode {mode!r}, size {size!r}: train.py runs '
            'DeepSpeed\'s Ulysses only; replace the block with "sequence_parallel_size": N'
        )
    if ds.get("sequence_parallel_size", size) != size:
        raise ConfigError(
            f'"sequence_parallel" says size {size} but sequence_parallel_size is {ds["sequence_parallel_size"]}; '
            "keep one of them"
        )
    ds["sequence_parallel_size"] = size
    return (f'LLaMA-Factory\'s "sequence_parallel" block read as DeepSpeed\'s "sequence_parallel_size": {size}',)


@dataclass(frozen=True)
class Mesh:
    world: int
    tp: int = 1
    sp: int = 1

    @classmethod
    def of(cls, world: int, ds: dict) -> "Mesh":
        """The mesh a DeepSpeed dict asks for on `world` ranks."""
        return cls(world, tensor_parallel_size(ds), sequence_parallel_size(ds))

    @property
    def group(self) -> int:
        """Ranks that train the same rows together: a TP group, an SP group, or 1."""
        return self.tp * self.sp

    @property
    def dp(self) -> int:
        """Data-parallel replicas: the groups of ranks that see different batches."""
        return self.world // self.group

    def coords(self, rank: int) -> tuple[int, int]:
        """(dp_rank, index within the TP or SP group) of a global rank."""
        return divmod(rank, self.group)

    def dp_rank(self, rank: int) -> int:
        return rank // self.group

    def sp_rank(self, rank: int) -> int:
        """Which slice of each sequence this rank trains (0 without SP)."""
        return rank % self.sp

    def describe(self) -> str:
        """The launch line: `8 ranks = 4 data-parallel x 2 tensor-parallel`."""
        ranks = f"{self.world} rank{'s' if self.world != 1 else ''}"
        if self.tp > 1:
            return f"{ranks} = {self.dp} data-parallel x {self.tp} tensor-parallel"
        if self.sp > 1:
            return f"{ranks} = {self.dp} data-parallel x {self.sp} sequence-parallel"
        return f"{ranks} = {self.dp} data-parallel"

    def deepspeed_mpu(self):
        """What `deepspeed.initialize(mpu=...)` takes, or None without TP or SP. TP: DeepSpeed's own groups
        module with its (data, tensor) mesh created, passed so DeepSpeed's batch check counts data-parallel
        ranks, not the world (DeepSpeedConfig asks the mpu; without one it takes the world and rejects micro x
        gas x dp); collective the first time, the engine then finds the mesh made and reuses it. SP: the
        groups that sequence_parallel.register_ulysses created (sequence_parallel.deepspeed_mpu)."""
        if self.sp > 1:
            from .sequence_parallel import deepspeed_mpu

            return deepspeed_mpu()
        if self.tp == 1:
            return None
        from deepspeed.utils import groups

        groups._init_tp_mesh_device(tensor_model_parallel_size=self.tp)
        return groups

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

    def count_group(self):
        """The process group over which per-rank token counts add up to the global batch's, each token once:
        under TP one rank per TP group (its ranks share rows); under SP every rank (each holds its own slice
        of the rows); else the world. None means the world."""
        if self.tp == 1:
            return None
        return self.deepspeed_mpu().get_data_parallel_group()


def picture(mesh: Mesh, gpus_per_node: Optional[int] = None) -> str:
    """The mesh as a grid of global ranks: a row per data-parallel replica (dp), a column per
    tensor-parallel (tp) or sequence-parallel (sp) index, and the node each row sits on when the GPUs per
    node are given. TP's per-layer all-reduces and SP's all-to-alls run along a row; ZeRO's gradient and
    parameter collectives run down a column (under SP, across every rank)."""
    width = max(4, len(str(mesh.world - 1)) + 1)
    node_col = gpus_per_node is not None
    axis, n = ("sp", mesh.sp) if mesh.sp > 1 else ("tp", mesh.tp)
    head = (
        ("        " if node_col else "") + "      " + "".join(f"{axis + ' ' + str(t):>{width + 2}}" for t in range(n))
    )
    rows = [head.rstrip()]
    for d in range(mesh.dp):
        node = f"node {d * n // gpus_per_node:<3}" if node_col else ""
        rows.append(f"{node}dp {d:<3}" + "".join(f"{d * n + t:>{width + 2}}" for t in range(n)))
    return "\n".join(rows)


def check_mesh(mesh: Mesh) -> None:
    if mesh.tp > 1 and mesh.sp > 1:
        raise ConfigError(
            f"tensor_parallel.autotp_size = {mesh.tp} with sequence_parallel_size = {mesh.sp}: train.py does not "
            "combine AutoTP with Ulysses; use one of them (sequence parallelism for long sequences, tensor "
            "parallelism for a model too big for ZeRO-3's gathered layers)"
        )
    if mesh.world % mesh.sp:
        raise ConfigError(
            f"{mesh.world} rank(s) cannot split into sequence-parallel groups of {mesh.sp}: the world size must be "
            f"a multiple of sequence_parallel_size; launch {max(mesh.sp, mesh.world - mesh.world % mesh.sp)} "
            "ranks or pick a sequence_parallel_size that divides the world size"
        )
    if mesh.world % mesh.tp:
        raise ConfigError(
            f"{mesh.world} rank(s) cannot split into tensor-parallel groups of {mesh.tp}: the world size must be a "
            f"multiple of tensor_parallel.autotp_size; launch {max(mesh.tp, mesh.world - mesh.world % mesh.tp)} "
            "ranks or pick an autotp_size that divides the world size"
        )


def tp_plan(model_config) -> Optional[dict]:
    """The model family's tensor-parallel layout in transformers (`base_model_tp_plan`), which AutoTP
    follows; None for a family without one (GPT-2's Conv1D layers, for example)."""
    plan = getattr(model_config.get_text_config(), "base_model_tp_plan", None)
    return plan or None


def check_tensor_parallel(mesh: Mesh, model_config, ds: dict, cfg) -> tuple[str, ...]:
    """Refuse, before any process group starts, a TP size this model or run cannot be split by; return
    notes for what is allowed but worth knowing."""
    if mesh.tp == 1:
        return ()
    tp, text = mesh.tp, model_config.get_text_config()
    block = ds.get("tensor_parallel") or {}
    custom_layout = bool(block.get("partition_config") or block.get("preset_model"))
    if tp_plan(model_config) is None and not custom_layout:
        raise ConfigError(
            f"tensor_parallel.autotp_size = {tp}: model type '{model_config.model_type}' has no tensor-parallel "
            "plan in transformers (base_model_tp_plan), so AutoTP would guess its layout; train it with ZeRO-3 "
            "instead, or give the layout in tensor_parallel.partition_config"
        )
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    for what, n in (("attention heads", heads), ("key-value heads", kv_heads)):
        if n is not None and n % tp:
            raise ConfigError(
                f"tensor_parallel.autotp_size = {tp} does not divide the model's {n} {what}; use an autotp_size "
                f"that divides {n} (each TP rank holds whole heads)"
            )
    from .ds_config import zero_stage  # here: ds_config imports this module

    if zero_stage(ds) == 0:
        raise ConfigError(
            f"tensor_parallel.autotp_size = {tp} with ZeRO-0: DeepSpeed saves such checkpoints without the "
            "optimizer partitions its universal conversion needs, so tools/export_hf.py could not export them "
            "nor a resume change the data-parallel size; use ds_configs/zero1.json (it costs nothing at one "
            "data-parallel replica and shards the optimizer states across more)"
        )
    if cfg.lora_r:
        raise ConfigError(
            f"tensor_parallel.autotp_size = {tp} with LoRA: AutoTP splits nn.Linear layers and PEFT's LoRA layers "
            "are not ones it can split; train LoRA with ZeRO (ds_configs/zero3.json) and no tensor_parallel"
        )
    return ()


def gather_logits(block: dict) -> None:
    """Keep the logits whole: `vocab_parallel_lm_head` false unless the config says otherwise. DeepSpeed
    otherwise splits a tied embedding/head along the vocabulary (engine.py `_apply_autotp_partitioning`,
    for Llama-3.2 and every other tied model), and the model then returns each rank's V/tp slice of the
    logits, which eval, exact match and the export check read as whole. The tied pair stays replicated."""
    if block.get("vocab_parallel_lm_head") is True:
        raise ConfigError(
            "tensor_parallel.vocab_parallel_lm_head = true: the model would return each rank's slice of the "
            "vocabulary's logits, and train.py's eval, exact match and export check read whole logits; remove it"
        )
    if block.get("vocab_parallel_lm_head") is None:  # absent or null: DeepSpeed's automatic choice
        block["vocab_parallel_lm_head"] = False


def zero_init_config(ds: dict, mesh: Mesh) -> dict:
    """The DeepSpeed dict transformers hands to `zero.Init` while it builds the model. transformers passes no
    mpu there, so DeepSpeed checks the batch against the whole world (micro x accumulation x world) and
    rejects the data-parallel batch of a TP run; without train_batch_size DeepSpeed derives it instead, and
    zero.Init reads nothing else of the batch. `deepspeed.initialize` gets the real dict, with the mpu."""
    if mesh.tp == 1:
        return ds
    return {k: v for k, v in ds.items() if k != "train_batch_size"}
