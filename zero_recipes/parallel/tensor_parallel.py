"""Tensor parallelism: DeepSpeed's AutoTP (`"tensor_parallel": {"autotp_size": N}`), as one parallel axis.

Each linear layer of a transformer block is split across the N ranks of a group along the model's own TP plan
(transformers' `base_model_tp_plan`), and ZeRO shards the model states across the data-parallel replicas.
Every rank of a TP group must feed the same batch (DeepSpeed checks the first one: "Data inconsistency within
the TP group"), so the data order, eval and every count are sharded by data-parallel rank (mesh.py). What
this axis checks, sets and hands DeepSpeed is here; the memory it leaves on a rank is memory/tensor_parallel.py.
"""

from __future__ import annotations

from typing import Optional

from zero_recipes.errors import ConfigError
from zero_recipes.parallel.axis import ParallelAxis


class TensorParallel(ParallelAxis):
    def configure(self, ds: dict) -> None:
        gather_logits(ds["tensor_parallel"])

    def check(self, model_config, ds: dict, cfg) -> tuple[str, ...]:
        check_split(self.mesh.tp, model_config, ds)
        return ()

    def zero_init_config(self, ds: dict) -> dict:
        return zero_init_config(ds)

    def mpu(self):
        """DeepSpeed's own groups module with its (data, tensor) mesh created, passed so DeepSpeed's batch check
        counts data-parallel ranks, not the world (DeepSpeedConfig asks the mpu; without one it takes the world
        and rejects micro x gas x dp); collective the first time, the engine then finds the mesh made and
        reuses it."""
        from deepspeed.utils import groups

        groups._init_tp_mesh_device(tensor_model_parallel_size=self.mesh.tp)
        return groups

    def count_group(self):
        """One rank per TP group: its ranks share rows, so a token is counted once over the data-parallel group."""
        return self.mpu().get_data_parallel_group()


def tp_plan(model_config) -> Optional[dict]:
    """The model family's tensor-parallel layout in transformers (`base_model_tp_plan`), which AutoTP
    follows; None for a family without one (GPT-2's Conv1D layers, for example)."""
    plan = getattr(model_config.get_text_config(), "base_model_tp_plan", None)
    return plan or None


def check_split(tp: int, model_config, ds: dict) -> None:
    """Refuse, before any process group starts, a TP size this model cannot be split by."""
    text = model_config.get_text_config()
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


def zero_init_config(ds: dict) -> dict:
    """The DeepSpeed dict transformers hands to `zero.Init` while it builds the model. transformers passes no
    mpu there, so DeepSpeed checks the batch against the whole world (micro x accumulation x world) and
    rejects the data-parallel batch of a TP run; without train_batch_size DeepSpeed derives it instead, and
    zero.Init reads nothing else of the batch. `deepspeed.initialize` gets the real dict, with the mpu."""
    return {k: v for k, v in ds.items() if k != "train_batch_size"}
