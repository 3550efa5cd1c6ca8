"""The DeepSpeed engine: optimizer, LR schedule and `deepspeed.initialize`.

When the DeepSpeed config has its own `optimizer`/`scheduler` blocks, DeepSpeed builds them (with the
"auto"s already filled). Otherwise, as the HF Trainer does, we build AdamW and the HF Trainer's schedule (lr_schedule.py):
torch AdamW (fused, as the HF Trainer's default) is bitwise-resumable; with optimizer offload DeepSpeed requires its C++
DeepSpeedCPUAdam, which is fast but recomputes beta^t differently after a reload (1-ULP drift, measured).
"""

from __future__ import annotations

from zero_recipes.config.train_config import TrainConfig
from zero_recipes.ds.facts import expert_parallel_size, offloads
from zero_recipes.ds.intake import warmup_steps
from zero_recipes.training import lr_schedule


def param_groups(model, weight_decay: float) -> list[dict]:
    """No weight decay on biases and norm weights (1-D tensors), as the HF Trainer."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if getattr(p, "ds_shape", p.shape).__len__() >= 2 else no_decay).append(p)
    return [  # named: DeepSpeed's MoE split keys its groups by name (expert parallelism)
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]


def make_optimizer(cfg: TrainConfig, model, ds: dict):
    if "optimizer" in ds:
        return None
    if expert_parallel_size(ds) > 1:
        # AutoEP replaces the sparse blocks inside deepspeed.initialize, and ZeRO-1/2 then want the experts'
        # parameters in groups of their own ("None of the param groups are marked as MoE", measured); DeepSpeed
        # makes them only for an optimizer it builds itself, or one it is handed as a callable of the
        # replaced parameters: the callable, with DeepSpeed's own split.
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        return lambda groups: adamw(cfg, split_params_into_different_moe_groups_for_optimizer(groups), ds)
    return adamw(cfg, param_groups(model, cfg.weight_decay), ds)


def adamw(cfg: TrainConfig, groups: list[dict], ds: dict):
    import torch

    betas = (cfg.adam_beta1, cfg.adam_beta2)
    if offloads(ds)[0] is not None:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=cfg.learning_rate, betas=betas, eps=cfg.adam_epsilon, adamw_mode=True)
    # Fused on every device, as the HF Trainer's default `adamw_torch_fused`: on a CPU torch's default is the
    # per-tensor loop (foreach is CUDA-only), 8x slower over a ZeRO flat partition and the whole of the 9 % the
    # Trainer was ahead on the 100M benchmark (docs/speed.md). GPUs were fused before; both resume bitwise.
    return torch.optim.AdamW(
        groups, lr=cfg.learning_rate, betas=betas, eps=cfg.adam_epsilon, fused=cfg.optim == "adamw_torch_fused"
    )


def make_scheduler(cfg: TrainConfig, ds: dict, total_steps: int):
    """A callable DeepSpeed applies to the optimizer it ends up with (its own or ours)."""
    if "scheduler" in ds:
        return None
    warmup = warmup_steps(cfg, total_steps)
    name = "constant_with_warmup" if cfg.lr_scheduler_type == "constant" and warmup else cfg.lr_scheduler_type

    def build(optimizer):
        return lr_schedule.build(name, optimizer, warmup, total_steps)

    return build


def import_muon_uncompiled_unless_used(ds: dict) -> None:
    """DeepSpeed's ZeRO and bf16 optimizers import its Muon module during `deepspeed.initialize` only to ask
    `isinstance(optimizer, MuonWithAuxAdam)` (runtime/zero/utils.py, stage_1_and_2.py, stage3.py,
    bf16_optimizer.py). That module wraps its kernels in @torch.compile at import, and the wrapping imports
    torch's inductor: 1.4 CPU-s per rank here, a fifth of a rank's start-up, in every run, Muon or not. A run
    whose optimizer is not Muon imports the module first with TorchDynamo off (TORCHDYNAMO_DISABLE, which
    torch.compile reads when it wraps a function): the class exists for the checks and the kernels, never
    called, stay plain functions. The variable is restored at once, so --torch_compile compiles as before. A
    Muon run (`"optimizer": {"type": "Muon"}`) imports it as DeepSpeed does."""
    import os
    import sys

    block = ds.get("optimizer")
    if isinstance(block, dict) and "muon" in str(block.get("type", "")).lower():
        return
    name = "deepspeed.runtime.zero.muon.muon_optimizer"
    if name in sys.modules:
        return
    before = os.environ.get("TORCHDYNAMO_DISABLE")
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        __import__(name)
    finally:
        if before is None:
            os.environ.pop("TORCHDYNAMO_DISABLE", None)
        else:
            os.environ["TORCHDYNAMO_DISABLE"] = before


def ask_cpuinfo_once() -> None:
    """DeepSpeedCPUAdam (optimizer offload) asks py-cpuinfo for the CPU three times as it starts: its __init__,
    then its op's build flags (op_builder cpu_arch and simd_width, even when the op is already built). Each
    `cpuinfo.get_cpu_info()` starts a fresh Python interpreter to read it (1.3 s here), one after another on
    every rank. The CPU does not change within a process: the first answer is kept, and each caller gets its
    own copy."""
    import functools

    import cpuinfo

    if getattr(cpuinfo.get_cpu_info, "asked_once", False):
        return
    first = functools.cache(cpuinfo.get_cpu_info)

    def get_cpu_info() -> dict:
        return dict(first())

    get_cpu_info.asked_once = True
    cpuinfo.get_cpu_info = get_cpu_info


def make_engine(cfg: TrainConfig, model, ds: dict, total_steps: int, mpu=None):
    """`mpu`: the run's axes' groups (axis.Parallelism.mpu) under tensor or sequence parallelism, else None."""
    import deepspeed

    import_muon_uncompiled_unless_used(ds)
    ask_cpuinfo_once()
    optimizer = make_optimizer(cfg, model, ds)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        model_parameters=param_groups(model, cfg.weight_decay) if optimizer is None or callable(optimizer) else None,
        lr_scheduler=make_scheduler(cfg, ds, total_steps),
        config=ds,
        mpu=mpu,
    )
    report_gradient_norm_under_muon(engine, ds)
    return engine


def muon_split(engine) -> str:
    """The log's line for a Muon run (empty otherwise): how many tensors DeepSpeed tagged `use_muon`, which under
    ZeRO-3 it reads from the layer shape `zero.Init` records (deepspeed#8438 tagged none there)."""
    if engine.optimizer_name() != "muon":
        return ""
    params = [p for p in engine.module.parameters() if p.requires_grad]
    muon = sum(bool(getattr(p, "use_muon", False)) for p in params)
    return f"muon: {muon} of {len(params)} tensors (the 2-D non-embedding ones) take Muon, the rest AdamW"


def report_gradient_norm_under_muon(engine, ds: dict) -> None:
    """DeepSpeed 0.19.8's ZeRO-1/2/3 take the norm they report (and clip by) over Muon's orthogonalized updates,
    not over the gradients (deepspeed#8439; docs/dev/deepspeed-bugs.md#muon): 61 where the gradient's is 2 on the
    quick start's model. The intake refuses clipping with Muon at ZeRO-1/2/3, so only the reported norm is left
    wrong: here each Muon group's norm is taken over its gradient, as ZeRO-0 and every other optimizer's are, just
    before DeepSpeed replaces the gradient with the update. Without optimizer offload; with it (CPU or NVMe,
    another path, not checked here) the norm stays DeepSpeed's."""
    opt = engine.optimizer
    if engine.optimizer_name() != "muon" or engine.zero_optimization_stage() == 0 or offloads(ds)[0]:
        return
    if engine.zero_optimization_stage() == 3:
        _stage3_raw_norm(opt)
    else:
        _stage12_raw_norm(opt)


def _stage3_raw_norm(opt) -> None:
    """ZeRO-3 runs Muon at the step, on the accumulated partitions (deepspeed#8443's fix): their norms first."""
    apply_muon, norm_groups, raw = opt._apply_muon_to_accumulated_grads, opt._get_norm_groups, []

    def apply_muon_after_the_norm():
        raw.append(norm_groups())
        apply_muon()

    opt._apply_muon_to_accumulated_grads = apply_muon_after_the_norm
    opt._get_norm_groups = lambda: raw.pop() if raw else norm_groups()


def _stage12_raw_norm(opt) -> None:
    """ZeRO-1/2 run Muon as they flatten a group's partition at the end of the step's backward
    (get_flat_partition): the partition's raw slices, DeepSpeed's own, are measured first."""
    import torch
    from deepspeed import comm as dist
    from deepspeed.runtime.utils import combine_grad_norm_groups

    flat_partition, norm_direct, squares = opt.get_flat_partition, opt.get_grad_norm_direct, {}

    def get_flat_partition(tensor_list, *args, param_group_idx, **kwargs):
        if tensor_list and opt._is_muon_group(tensor_list):
            for t in tensor_list:
                t.use_muon = False
            try:
                kw = {**kwargs, "param_group_idx": param_group_idx, "return_tensor_list": True}
                raw = flat_partition(tensor_list, *args, **kw)
            finally:
                for t in tensor_list:
                    t.use_muon = True
            grads = (g for g in raw if not getattr(g, "_zero_padding", False))
            squares[param_group_idx] = sum(torch.linalg.vector_norm(g.float()) ** 2 for g, _ in zip(grads, tensor_list))
        return flat_partition(tensor_list, *args, param_group_idx=param_group_idx, **kwargs)

    def scaled_global_norm(norm_type=2):
        norms = []
        for i, group in enumerate(opt.bit16_groups):
            if group and getattr(group[0], "use_muon", False):
                total = torch.as_tensor(squares.pop(i, 0.0), dtype=torch.float32).clone()
                dist.all_reduce(total, op=dist.ReduceOp.SUM, group=opt.dp_process_group)
                norms.append(total.sqrt())  # a raw gradient carries the loss scale
            else:
                norms.append(norm_direct(opt.averaged_gradients[i], opt.params_in_partition[i]))
        return combine_grad_norm_groups(norms, norm_type=norm_type)

    opt.get_flat_partition = get_flat_partition
    opt.scaled_global_norm = scaled_global_norm
