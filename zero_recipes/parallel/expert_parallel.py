"""Expert parallelism: DeepSpeed AutoEP (`"expert_parallel": {"enabled": true, "autoep_size": N}`), one axis.

At `deepspeed.initialize` AutoEP replaces every sparse block of a known family by its AutoEPMoELayer: each
rank of an expert-parallel group of N holds num_experts / N of every layer's experts, and tokens travel to
their experts' ranks by all-to-all and back. Unlike the other axes every rank still trains its own rows: in
DeepSpeed's sense world = expert-data-parallel x expert-parallel, the dense weights replicated on every rank
and ZeRO sharding the experts over the world / N ranks that hold the same ones (mesh.Mesh.expert_shards).
So the data order, the counts and eval stay per rank, as without the axis. Which family maps to which AutoEP
preset is moe.py's; what a rank holds is memory/moe.py's.

Measured on 2 CPU ranks (DeepSpeed 0.19.8): AutoEP runs there (its per-expert loop path), under ZeRO-0 to 3,
with ZeRO-0's per-step losses to 1e-6.
"""

from __future__ import annotations

from zero_recipes.errors import ConfigError
from zero_recipes.modeling import moe
from zero_recipes.parallel.axis import ParallelAxis


class ExpertParallel(ParallelAxis):
    live_eval_refusal = "its experts exchange tokens across ranks inside the training step's batches"

    def check(self, model_config, ds: dict, cfg) -> tuple[str, ...]:
        """Refuse what AutoEP cannot split; fill the preset it needs from the model's family (the one hook
        that sees both the model config and the DeepSpeed dict), unless the config names its own layout."""
        ep, block = self.mesh.ep, ds["expert_parallel"]
        text, family = moe.text_config(model_config), moe.family(model_config)
        if not moe.is_moe(model_config):
            raise ConfigError(
                f"expert_parallel.autoep_size = {ep}: model type '{text.model_type}' has no experts to split; "
                "remove the ep fragment (expert parallelism is for mixtures of experts)"
            )
        custom = block.get("preset_model") or block.get("moe_layer_pattern")
        if not custom and (family is None or family.autoep_preset is None):
            presets = sorted({f.autoep_preset for f in moe.FAMILIES.values() if f.autoep_preset})
            raise ConfigError(
                f"expert_parallel.autoep_size = {ep}: DeepSpeed AutoEP has no preset for model type "
                f"'{text.model_type}' (its presets: {', '.join(presets)}); train it without the ep fragment "
                "(ZeRO-3 gathers a layer's experts whole), or give its layout in expert_parallel.moe_layer_pattern"
            )
        experts = moe.num_experts(model_config)
        if experts % ep:
            raise ConfigError(
                f"expert_parallel.autoep_size = {ep} does not divide the model's {experts} experts; use an "
                f"autoep_size that divides {experts} (each rank holds whole experts)"
            )
        if not custom:
            block["preset_model"] = family.autoep_preset
        return ()

    def before_build(self, cfg, model_config, log) -> None:
        accept_autoep_registry_lookups()
        log(
            f"expert parallelism: each rank holds {moe.num_experts(model_config) // self.mesh.ep} of every layer's "
            f"{moe.num_experts(model_config)} experts; tokens reach them by all-to-all (DeepSpeed AutoEP)"
        )


def accept_autoep_registry_lookups() -> None:
    """Work around a DeepSpeed 0.19.8 / transformers 5.23 mismatch. AutoEP retargets transformers' router-logit
    recorders (so `aux_loss` still sees the router) by calling `_CAN_RECORD_REGISTRY.get(class_name, default)`,
    a plain dict's signature; transformers 5.23 made the registry a dict subclass whose `get(model)` takes a
    model and keys by its class, so every AutoEP launch died with "_CanRecordRegistry.get() takes 2 positional
    arguments but 3 were given" (measured). A string key is looked up as the dict it is; a model as before."""
    from transformers.utils import output_capturing

    registry = output_capturing._CanRecordRegistry
    if getattr(registry.get, "accepts_keys", False):
        return
    by_model = registry.get

    def get(self, key, default=None):
        return dict.get(self, key, default) if isinstance(key, str) else by_model(self, key)

    get.accepts_keys = True
    registry.get = get


def expert_layers(module) -> dict:
    """AutoEP's layers by their module path ({} when the model has none)."""
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    return {name: m for name, m in module.named_modules() if isinstance(m, AutoEPMoELayer)}


def whole_experts(layer, rank: int):
    """(w1, w2, w3) of every expert of one AutoEP layer on rank 0's CPU, None elsewhere. Each rank's own experts
    are gathered from their ZeRO-3 partitions when partitioned (collective over the world), then the
    expert-parallel group that holds rank 0 gathers them to it (group rank r holds the r-th contiguous block:
    AutoEP's expert_placement_descriptor). The other groups hold the same experts and send nothing; a sender
    sends its tensors as they are and keeps no copy. An all-gather here left every rank a CPU copy of all the
    experts until the export returned: about 57 GB a rank for Qwen3-30B-A3B."""
    from contextlib import nullcontext

    import deepspeed
    import torch
    import torch.distributed as dist

    weights = [layer.experts.w1, layer.experts.w2, layer.experts.w3]
    gather = deepspeed.zero.GatheredParameters(weights) if hasattr(weights[0], "ds_id") else nullcontext()
    sends = 0 in dist.get_process_group_ranks(layer.ep_group)
    out = []
    with gather:
        for w in weights if sends else []:
            local = w.detach().contiguous()
            parts = [torch.empty_like(local) for _ in range(layer.ep_size)] if rank == 0 else None
            dist.gather(local, parts, dst=0, group=layer.ep_group)
            if rank == 0:
                out.append(torch.cat(parts).cpu())
    return out if rank == 0 else None


def hf_state_dict(module, sd, rank: int, hf_shapes: dict):
    """`sd` (rank 0's gathered state dict of the AutoEP model; None elsewhere) under the HF family's names and
    layout, with every rank's experts. `hf_shapes`: the HF model's tensor shapes by name. Collective
    (whole_experts), one layer at a time: rank 0 puts each layer's experts into `sd` as they arrive, so it
    holds what it writes and one layer's gather; the other ranks keep nothing."""
    layers = expert_layers(module)
    params = {f"{prefix}.{n}" for prefix, layer in layers.items() for n, _ in layer.named_parameters()}
    for prefix, layer in layers.items():
        experts = whole_experts(layer, rank)
        if rank == 0:
            layer_to_hf_names(sd, prefix, experts, hf_shapes, params)
    return sd if rank == 0 else None


def to_hf_names(sd: dict, experts: dict, hf_shapes: dict, params=None) -> dict:
    """An AutoEP state dict under the HF family's names, `experts` (module path -> (w1, w2, w3) of every
    expert) emptied into it layer by layer (layer_to_hf_names)."""
    for prefix in list(experts):
        layer_to_hf_names(sd, prefix, experts.pop(prefix), hf_shapes, params)
    return sd


def layer_to_hf_names(sd: dict, prefix: str, experts, hf_shapes: dict, params=None) -> None:
    """One AutoEP layer of `sd` (at module path `prefix`) under the HF family's names, in place: its experts
    (w1, w2, w3 of every expert, [E, I, H], [E, H, I], [E, I, H]) in `experts.gate_up_proj` /
    `experts.down_proj` (w1 and w3 are the gate and up halves, as AutoEP's ep_repack cut them), the router as
    `gate`, the shared experts as the family names them. A tensor with no HF name is AutoEP's own (its token
    counts, the router's alias) and is dropped; a parameter in `params` without one is an error."""
    import torch

    w1, w2, w3 = experts
    for name in [k for k in sd if k.startswith(prefix + ".")]:
        value, rest = sd.pop(name), name[len(prefix) + 1 :]
        if rest.startswith("experts."):
            continue
        target = next((c for c in _hf_names(prefix, rest) if c in hf_shapes), None)
        if target is not None:
            sd.setdefault(target, value)
        elif params is not None and name in params:
            raise RuntimeError(f"export: no HF name for AutoEP parameter {name}")
    gate_up, down = f"{prefix}.experts.gate_up_proj", f"{prefix}.experts.down_proj"
    if hf_shapes[gate_up][1] == 2 * w1.shape[1]:  # [E, 2I, H]
        sd[gate_up] = torch.cat([w1, w3], dim=1)
    else:  # the transposed layout [E, H, 2I]
        sd[gate_up] = torch.cat([w1, w3], dim=1).transpose(1, 2).contiguous()
    sd[down] = w2 if tuple(hf_shapes[down]) == tuple(w2.shape) else w2.transpose(1, 2).contiguous()


def experts_from_files(files) -> dict:
    """Every expert of every layer from DeepSpeed's expert checkpoint files (one per layer and global expert:
    `layer_L_expert_E_mp_rank_00_model_states.pt`, keys `<module path>.experts.w1.<E>`), stacked by expert id
    as `to_hf_names` takes them."""
    import torch

    by_layer: dict = {}
    for f in files:
        for key, value in torch.load(f, map_location="cpu", weights_only=True).items():
            prefix, _, tail = key.partition(".experts.")
            weight, expert = tail.split(".")
            by_layer.setdefault(prefix, {}).setdefault(weight, {})[int(expert)] = value
    return {
        prefix: tuple(torch.stack([w[e] for e in sorted(w)]) for w in (ws["w1"], ws["w2"], ws["w3"]))
        for prefix, ws in by_layer.items()
    }


def _hf_names(prefix: str, rest: str) -> list[str]:
    """Candidate HF names of an AutoEP layer's non-expert tensor (router, shared experts)."""
    if rest.startswith("router."):
        return [f"{prefix}.{rest.replace('router.gate.', 'gate.').replace('router.', 'gate.')}"]
    if rest.startswith("shared_experts_gate."):
        return [f"{prefix}.{rest.replace('shared_experts_gate.', 'shared_expert_gate.')}"]
    if rest.startswith("shared_experts."):
        return [f"{prefix}.{rest}", f"{prefix}.{rest.replace('shared_experts.', 'shared_expert.')}"]
    return [f"{prefix}.{rest}"]
