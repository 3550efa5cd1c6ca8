"""The estimate of the run train.py starts (tools/estimate_memory.py's, for its flags), and the line it logs."""

from __future__ import annotations

from ..modeling import lm_loss
from . import objective
from .estimate import Estimate, Launch, estimate


def for_run(model_config, ds: dict, cfg, world: int) -> tuple[Estimate | None, str]:
    """tools/estimate_memory.py's estimate for this train.py run (with its --optim), and it in one
    line for the log. (None, why) when it cannot be made: an estimate must never stop a run."""
    import torch

    try:
        from zero_recipes.adapters.lora import lora_config
        from zero_recipes.config.lora_options import enabled
        from zero_recipes.distributed.launcher_env import rank_info

        # the launcher's ranks on this node: host memory is per node
        per_node = min(world, rank_info().local_world_size or world)
        e = estimate(
            model_config,
            ds,
            Launch(
                per_node,
                -(-world // per_node),
                cfg.per_device_train_batch_size,
                cfg.block_size,
                cfg.gradient_checkpointing,
                cfg.attn_implementation or "sdpa",
                "gpu" if torch.cuda.is_available() else "cpu",
                tiled_loss=lm_loss.tiles_loss(cfg),
                loss_tile_tokens=getattr(cfg, "loss_tile_tokens", 0),
                tiled_mlp=getattr(cfg, "tiled_mlp", False),
                optim=getattr(cfg, "optim", "adamw_torch_fused"),
                objective=getattr(cfg, "objective", "lm"),
            ),
            lora=lora_config(cfg) if enabled(cfg) else None,
            load_in_4bit=cfg.load_in_4bit,
        )
    except Exception as err:  # noqa: BLE001
        return None, f"memory: no estimate ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
    g = e.per_gpu
    return e, (
        f"memory: estimated peak {g['peak_bytes'] / 2**30:.2f} GiB per GPU in {g['peak_phase']} (states "
        f"{g['model_states_bytes'] / 2**30:.2f}, activations {g['activations_bytes'] / 2**30:.2f}, buffers "
        f"{g['buffers_bytes'] / 2**30:.2f}); host {e.per_node['cpu_bytes'] / 2**30:.2f} GiB per node "
        f"(tools/estimate_memory.py for the breakdown and --table)"
        + (f"; {said}" if (said := objective.summary(getattr(cfg, "objective", "lm"))) else "")
    )
