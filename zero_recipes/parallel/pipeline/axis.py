"""Pipeline parallelism: DeepSpeed's PipelineModule (`"pipeline": {"stages": N}`), as one parallel axis.

The model's layers are split into N stages, one per rank of a pipeline; micro-batches flow stage to stage
(DeepSpeed's 1F1B schedule), and data parallelism (ZeRO-0 or ZeRO-1) runs across the pipelines. DeepSpeed
lays the pipe axis outermost (mesh.py). How the HF model becomes pipeline layers is parallel/pipeline/layers.py; how a
step runs (`engine.train_batch` over the whole step) is parallel/pipeline/runner.py; the memory a stage holds is
memory/pipeline.py.

DeepSpeed parses the `pipeline` block (stages, partition, seed_layers, activation_checkpoint_interval,
pipe_partitioned, grad_partitioned) but its engine reads only the last two; the module's arguments are the
model code's to give. train.py gives them from the block, so each setting means what it says:

    stages                          -> PipelineModule(num_stages=...), the mesh's pp
    partition                       -> partition_method: "parameters" (DeepSpeed's default; its parsed default
                                       "best" is no method of PipelineModule and means the same here),
                                       "uniform", or "type:REGEX"
    activation_checkpoint_interval  -> PipelineModule(activation_checkpoint_interval=...)
    seed_layers                     -> refused when true: the weights come from --seed per module name
"""

from __future__ import annotations

import contextlib
import io

from zero_recipes.errors import ConfigError
from zero_recipes.parallel.axis import ParallelAxis

PARTITIONS = ("parameters", "uniform")


class PipelineParallel(ParallelAxis):
    counts_tokens = True  # the loss is normalised by the whole step's label tokens (parallel/pipeline/runner.py)
    owns_loss = True  # the last stage's loss_fn (pipeline_model.StepLoss)
    live_eval_refusal = "each rank holds a stage of the layers, and lm-eval needs the whole model's logits"

    def configure(self, ds: dict) -> None:
        block = ds["pipeline"]
        if block.get("partition", "best") == "best":
            block["partition"] = "parameters"
        block.setdefault("activation_checkpoint_interval", 0)

    def check(self, model_config, ds: dict, cfg) -> tuple[str, ...]:
        from zero_recipes.modeling.model import meta_model
        from zero_recipes.parallel.pipeline import layers as pipeline_model

        block = ds["pipeline"]
        if problem := pipeline_model.refusal(model_config, self.mesh.pp):
            raise ConfigError(problem)
        partition = str(block["partition"])
        if partition not in PARTITIONS and not partition.startswith("type:"):
            raise ConfigError(
                f'pipeline.partition = {partition!r} is not a way to split layers; use "parameters" (balanced by '
                'parameter count), "uniform" (the same number of layers per stage) or "type:REGEX"'
            )
        # the split DeepSpeed will make, made now: a "type:REGEX" that matches no layer fails here, not after
        # the process groups have started
        layers = pipeline_model.pipeline_layers(meta_model(model_config))
        pipeline_model.stage_boundaries(layers, self.mesh.pp, partition)
        if block.get("seed_layers"):
            raise ConfigError(
                "pipeline.seed_layers = true: train.py seeds every module by its name from --seed, so the weights "
                "are the same whatever the layout; remove seed_layers"
            )
        interval = block["activation_checkpoint_interval"]
        if not isinstance(interval, int) or interval < 0:
            raise ConfigError(
                f"pipeline.activation_checkpoint_interval = {interval!r}: give a number of layers (0: off), or use "
                "--gradient_checkpointing true"
            )
        if ds.get("wall_clock_breakdown"):
            raise ConfigError(
                "wall_clock_breakdown = true with pipeline.stages: DeepSpeed 0.19.8 starts its bwd_microstep timer "
                "twice under a pipeline and every stage but the last dies at its first backward; set it false "
                "(tools/benchmark.py pipeline times the schedule's instructions instead)"
            )
        packs = cfg.packing and cfg.dataset_format != "text"
        if packs and cfg.attn_implementation.startswith("flash_attention") and cfg.per_device_train_batch_size > 1:
            # transformers' flash path finds packed examples from position ids for a one-row batch only, and the
            # collator's cut points (varying in size per batch) cannot travel between stages with the activations
            raise ConfigError(
                f"--attn_implementation {cfg.attn_implementation} with packed examples under pipeline.stages keeps "
                "the examples of a multi-row micro-batch apart only with one row: use --attn_implementation sdpa "
                "(exact per example), --per_device_train_batch_size 1, or --packing false"
            )
        if cfg.torch_compile:
            raise ConfigError(
                "--torch_compile with pipeline.stages: DeepSpeed's engine.compile() does not cover the pipeline "
                "engine's schedule; drop --torch_compile"
            )
        return ()

    def split(self, model, ds: dict, log):
        """The HF model as this rank's pipeline stage (pipeline_model.PipelinedCausalLM); the other stages'
        layers are dropped. DeepSpeed prints its partition table; the run logs its own line instead."""
        from zero_recipes.parallel.pipeline.layers import PipelinedCausalLM

        block = ds["pipeline"]
        with contextlib.redirect_stdout(io.StringIO()):
            module = PipelinedCausalLM(model, self.mesh.pp, block["partition"], block["activation_checkpoint_interval"])
        parts = module.parts
        spans = ", ".join(f"stage {s}: layers {parts[s]}-{parts[s + 1] - 1}" for s in range(self.mesh.pp))
        log(
            f"pipeline: {self.mesh.pp} stages of {len(module._layer_specs)} layers (embedding, "
            f"{module.n_layers} blocks, norm, head) by {block['partition']}: {spans}"
        )
        return module

    def runner(self):
        from zero_recipes.parallel.pipeline.runner import PipelineRunner

        return PipelineRunner
