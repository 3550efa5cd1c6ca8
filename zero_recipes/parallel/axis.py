"""The interface of a parallel axis, and a run's axes together.

Each axis (tensor_parallel.py, sequence_parallel.py, pipeline/axis.py, expert_parallel.py) is one class in its own
module with these hooks, in the order a run calls them. A hook an axis does not need keeps the default here, so
adding an axis is its module plus one line in modes.AXES: nothing else asks which axes a run has.

    adopt(ds)                 config intake, every axis, before the mesh exists: another project's spelling
    configure(ds)             config intake, active axes: what the axis sets in the DeepSpeed dict
    check(model_config, ds, cfg) -> notes   before any process group: what this model or run cannot split
    zero_init_config(ds)      the dict transformers hands zero.Init while it builds the model
    before_build(cfg, model_config, log)    after the process group, before the model: collective set-up
    split(model, ds, log) -> model          after the adapter wraps it: what deepspeed.initialize gets
    mpu()                     what deepspeed.initialize(mpu=...) takes
    runner() -> class         how one step runs, when not runner.EagerRunner (the pipeline's train_batch)
    count_group()             the group over which per-rank token counts add up once (None: the world)
    shard(batch, rank)        this rank's part of a micro-batch its group shares

Which axes combine, and with which ZeRO stages and adapters, is combinations.py's table; the arithmetic of
the ranks is mesh.py's.
"""

from __future__ import annotations

from zero_recipes.parallel.mesh import Mesh


class ParallelAxis:
    owns_attention = False
    """The axis installs the attention kernel itself (Ulysses wraps it), so nothing else may replace it."""
    counts_tokens = False
    """Every step's loss is normalised by its trained tokens (per-slice means would weight slices unequally)."""
    owns_loss = False
    """The axis computes the loss itself (the pipeline's last stage), so train.py's tiled loss is not installed."""
    live_eval_refusal = None
    """Why lm-eval cannot run on the live model under this axis (--eval_tasks, --eval_samples), or None. Every
    rank runs the same requests in the same order, so an axis whose forward takes whole rows on every rank
    (ZeRO-3's gathers, TP's all-reduces) needs nothing; one that takes slices or stages cannot."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh

    @staticmethod
    def adopt(ds: dict) -> tuple[str, ...]:
        return ()

    def configure(self, ds: dict) -> None:
        pass

    def check(self, model_config, ds: dict, cfg) -> tuple[str, ...]:
        return ()

    def zero_init_config(self, ds: dict) -> dict:
        return ds

    def before_build(self, cfg, model_config, log) -> None:
        pass

    def split(self, model, ds: dict, log):
        return model

    def mpu(self):
        return None

    def runner(self):
        return None

    def count_group(self):
        return None

    def shard(self, batch: dict, rank: int) -> dict:
        return batch


class Parallelism:
    """A run's active axes (size > 1) as one: each hook asks every active axis in turn. Today at most one axis
    is active (combinations.py refuses TP with SP), so the first axis's mpu and count group are the run's."""

    def __init__(self, mesh: Mesh, axes: list[ParallelAxis]):
        self.mesh, self.axes = mesh, axes

    @property
    def owns_attention(self) -> bool:
        return any(a.owns_attention for a in self.axes)

    @property
    def counts_tokens(self) -> bool:
        return any(a.counts_tokens for a in self.axes)

    @property
    def owns_loss(self) -> bool:
        return any(a.owns_loss for a in self.axes)

    @property
    def live_eval_refusal(self):
        return next((a.live_eval_refusal for a in self.axes if a.live_eval_refusal), None)

    def configure(self, ds: dict) -> None:
        for a in self.axes:
            a.configure(ds)

    def check(self, model_config, ds: dict, cfg) -> tuple[str, ...]:
        return tuple(note for a in self.axes for note in a.check(model_config, ds, cfg))

    def zero_init_config(self, ds: dict) -> dict:
        for a in self.axes:
            ds = a.zero_init_config(ds)
        return ds

    def before_build(self, cfg, model_config, log) -> None:
        for a in self.axes:
            a.before_build(cfg, model_config, log)

    def split(self, model, ds: dict, log):
        for a in self.axes:
            model = a.split(model, ds, log)
        return model

    def mpu(self):
        return next((m for a in self.axes if (m := a.mpu()) is not None), None)

    def runner(self, engine, plan, rank: int, sft: bool):
        """The run's runner: its axis's own (pipeline) or the eager one."""
        from zero_recipes.training.runner import EagerRunner

        cls = next((c for a in self.axes if (c := a.runner()) is not None), EagerRunner)
        return cls(engine, plan, rank, sft)

    def count_group(self):
        return next((g for a in self.axes if (g := a.count_group()) is not None), None)

    def shard(self, batch: dict, rank: int) -> dict:
        for a in self.axes:
            batch = a.shard(batch, rank)
        return batch
