"""The parallel mesh: how a launch's ranks split into data-parallel replicas and tensor-parallel groups.

    world = data-parallel x tensor-parallel        rank = dp_rank * tp + tp_rank

Tensor parallelism is DeepSpeed's AutoTP (`"tensor_parallel": {"autotp_size": N}`): each linear layer of a
transformer block is split across the N ranks of a group along the model's own TP plan, and ZeRO shards
the model states across the data-parallel replicas. DeepSpeed lays the mesh out as (data, tensor) with the
tensor dimension innermost (`utils/groups._init_tp_mesh_device`), so a TP group is N consecutive ranks: on
one node when N divides the GPUs per node, which is where TP's all-reduces belong (NVLink, not the network).

Every rank of a TP group must feed the same batch (DeepSpeed checks the first one: "Data inconsistency
within the TP group"), so the data order, eval and every count are sharded by data-parallel rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .config import ConfigError


def tensor_parallel_size(ds: dict) -> int:
    """The AutoTP degree a DeepSpeed dict asks for (1: none)."""
    block = ds.get("tensor_parallel") or {}
    return max(1, int(block.get("autotp_size", 0) or 0)) if isinstance(block, dict) else 1


@dataclass(frozen=True)
class Mesh:
    world: int
    tp: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel replicas: the ranks that see different batches."""
        return self.world // self.tp

    def coords(self, rank: int) -> tuple[int, int]:
        """(dp_rank, tp_rank) of a global rank."""
        return divmod(rank, self.tp)

    def dp_rank(self, rank: int) -> int:
        return rank // self.tp

    def describe(self) -> str:
        """The launch line: `8 ranks = 4 data-parallel x 2 tensor-parallel`."""
        ranks = f"{self.world} rank{'s' if self.world != 1 else ''}"
        if self.tp == 1:
            return f"{ranks} = {self.dp} data-parallel"
        return f"{ranks} = {self.dp} data-parallel x {self.tp} tensor-parallel"

    def deepspeed_mpu(self):
        """What `deepspeed.initialize(mpu=...)` takes: DeepSpeed's own groups module with its (data, tensor)
        mesh created, or None without TP. Passed so DeepSpeed's batch check counts data-parallel ranks, not
        the world (DeepSpeedConfig asks the mpu; without one it takes the world and rejects micro x gas x dp).
        Collective the first time; the engine then finds the mesh made and reuses it."""
        if self.tp == 1:
            return None
        from deepspeed.utils import groups

        groups._init_tp_mesh_device(tensor_model_parallel_size=self.tp)
        return groups

    def dp_group(self):
        """The process group of this rank's data-parallel peers (one rank of each TP group): sums over it
        count each batch once. None (the whole world) without TP."""
        mpu = self.deepspeed_mpu()
        return None if mpu is None else mpu.get_data_parallel_group()


def picture(mesh: Mesh, gpus_per_node: Optional[int] = None) -> str:
    """The mesh as a grid of global ranks: a row per data-parallel replica (dp), a column per
    tensor-parallel index (tp), and the node each row sits on when the GPUs per node are given. TP's
    per-layer all-reduces run along a row; ZeRO's gradient and parameter collectives run down a column."""
    width = max(4, len(str(mesh.world - 1)) + 1)
    node_col = gpus_per_node is not None
    head = (
        ("        " if node_col else "") + "      " + "".join(f"{'tp ' + str(t):>{width + 2}}" for t in range(mesh.tp))
    )
    rows = [head.rstrip()]
    for d in range(mesh.dp):
        node = f"node {d * mesh.tp // gpus_per_node:<3}" if node_col else ""
        rows.append(f"{node}dp {d:<3}" + "".join(f"{d * mesh.tp + t:>{width + 2}}" for t in range(mesh.tp)))
    return "\n".join(rows)


def check_mesh(mesh: Mesh) -> None:
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
