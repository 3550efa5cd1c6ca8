"""What pipeline parallelism (DeepSpeed's PipelineModule, `"pipeline": {"stages": N}`) leaves on each stage.

The layers are parallel/pipeline/layers.py's own: [embedding, one per decoder block, final norm, head], a tied embedding/head
one TiedLayerSpec on the first and the last stage. They are built on the meta model and split as DeepSpeed splits
them (pipe/module.py `_partition_layers`): its `partition_balanced` over its own per-layer parameter counts
(`_count_layer_params`) for "parameters", over its own type match (`_find_layer_type`) for "type:REGEX", its
`partition_uniform` for "uniform". So a stage holds what its rank will hold: the embedding on the first, norm and
head on the last, the tied embedding on both, and the blocks DeepSpeed gives it. Its model states are states.py's
over those parameters, ZeRO-0 or ZeRO-1 over the stage's data-parallel replicas (Mesh.zero_shards).

Activations follow DeepSpeed's 1F1B schedule (pipe/schedule.py `TrainSchedule`), run instruction by instruction on
the stage's real layers under FakeTensorMode (pipeline_trace.py): stage s holds min(stages - s, micro-batches)
forwards in flight, so the first holds the most. The buffers are pipe/engine.py's: a received activation is cloned
out of one persistent receive buffer (`_exec_recv_activations`) and cloned again for the forward
(`_exec_forward_pass`), kept with its gradient until `SendGrad`; a stage's outputs stay until their backward; the
gradient from the next stage lands in one persistent buffer, shared with the receive buffer
(`_allocate_or_extend_buffers`). The last stage computes pipeline_model.StepLoss on the whole logits (their fp32
upcast, no tiling) and never clears its outputs: the last two micro-batches' logits stay in its two buffers
through the optimizer step and into the next step (`num_pipe_buffers` is at least 2). Parameter gradients are
kept as they accumulate over the step's micro-batches (ZeRO-0/1 hold them in param.grad until the step), so a
later micro-batch's forward runs beside the earlier ones' gradients. With --gradient_checkpointing each block
keeps its input per micro-batch in flight (transformers' checkpointing inside each block, as train.py enables
it). DeepSpeed's own pipeline.activation_checkpoint_interval is not modelled (the estimate is then of the
activations without it, and says so). ZeRO-0 in bf16 under a pipeline steps through DeepSpeed's BF16_Optimizer,
whose states are bf16_optimizer.py's.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Stage:
    index: int
    start: int
    """The first of its pipeline layers (0: the embedding, 1..L the blocks, L+1 the norm, L+2 the head)."""
    stop: int
    """One past its last layer."""
    blocks: int
    params: int
    """What the stage's rank holds: its layers' parameters, the tied embedding counted on both stages holding it."""
    largest_param: int
    in_flight: int
    """Forwards whose activations the stage holds at once under DeepSpeed's 1F1B schedule."""
    embeds: bool
    norms: bool
    heads: bool

    def describe(self) -> str:
        parts = ["embedding"] if self.embeds else []
        parts += [f"{self.blocks} block{'s' if self.blocks != 1 else ''}"] if self.blocks else []
        parts += (["norm"] if self.norms else []) + (["head"] if self.heads else [])
        return f"layers {self.start}-{self.stop - 1} ({', '.join(parts)})"


@dataclass
class StageActivations:
    peak: int
    """Live bytes at the stage's peak in forward/backward: activations in flight, DeepSpeed's pipeline buffers and
    the parameter gradients accumulated by then."""
    grads_at_peak: int
    """Of those, the parameter gradients."""
    resident: int
    """What stays through the optimizer step: the last stage's stale logits, the persistent buffers."""

    def scaled(self, micro: int) -> "StageActivations":
        """At `micro` rows a micro-batch, from a trace at one: linear in the rows (sdpa/flash), gradients not."""
        acts = self.peak - self.grads_at_peak
        return StageActivations(acts * micro + self.grads_at_peak, self.grads_at_peak, self.resident * micro)


def bubble(stages: int, micro_batches: int) -> float:
    """The 1F1B pipeline's idle fraction, (p - 1) / (m + p - 1) for p stages and m micro-batches a step."""
    return (stages - 1) / (micro_batches + stages - 1) if stages > 1 else 0.0


def pipeline_block(ds: dict, world: int) -> dict:
    """The resolved `pipeline` block, as pipeline_parallel.PipelineParallel.configure completes it."""
    import copy

    from zero_recipes.parallel.mesh import Mesh
    from zero_recipes.parallel.pipeline.axis import PipelineParallel

    tried = copy.deepcopy({"pipeline": ds.get("pipeline") or {}})
    PipelineParallel(Mesh.of(world, ds)).configure(tried)
    return tried["pipeline"]


def in_flight(stages: int, stage: int, micro_batches: int) -> int:
    """The most forwards without their backward yet on `stage`, read off DeepSpeed's own TrainSchedule."""
    from deepspeed.runtime.pipe.schedule import BackwardPass, ForwardPass, TrainSchedule

    live = most = 0
    for cmds in TrainSchedule(micro_batches, stages, stage).steps():
        for cmd in cmds:
            live += isinstance(cmd, ForwardPass) - isinstance(cmd, BackwardPass)
            most = max(most, live)
    return most


def micro_batches(ds: dict) -> int:
    """The micro-batches of one pipeline step: the engine's `micro_batches`, its gradient accumulation steps."""
    gas = ds.get("gradient_accumulation_steps")
    return gas if isinstance(gas, int) and gas > 0 else 1


def candidates(by_phase: dict, acts: StageActivations, full_params: int, accelerator: str) -> dict:
    """What may set each phase's peak on a stage, as (states and buffers, activations on top) for estimate.py's
    phase table: forward/backward's own (the gradients' reduction after the last backward) or the forward's
    states with the traced peak on top (its gradients counted with the states); the step with the buffers and
    stale logits that stay; init, on the CPU accelerator's one pool, also the whole model train.py builds in
    fp32 on every rank before the pipeline keeps this stage's layers (on a GPU that is host memory, per node)."""
    from dataclasses import replace

    fwd, fb, step, init = (by_phase[k] for k in ("forward", "forward_backward", "optimizer_step", "init"))
    with_grads = replace(fwd, states=fwd.states + acts.grads_at_peak)
    inits = [(init, 0)]
    if accelerator == "cpu":
        inits.append((replace(init, states=4 * full_params, buffers=0, host_states=0, host_buffers=0), 0))
    return {
        "init": inits,
        "forward_backward": [(fb, 0), (with_grads, acts.peak - acts.grads_at_peak)],
        "optimizer_step": [(step, acts.resident)],
    }


def stage_row(stage: Stage, table: dict) -> dict:
    """One stage in the Estimate's `pipeline`: its layers and parameters, forwards in flight, and its peak."""
    phase = max(table, key=lambda n: table[n]["device_bytes"])
    return {
        "stage": stage.index,
        "layers": [stage.start, stage.stop - 1],
        "holds": stage.describe(),
        "params": stage.params,
        "in_flight": stage.in_flight,
        "peak_bytes": table[phase]["device_bytes"],
        "peak_phase": phase,
        "activations_bytes": table["forward_backward"]["activations_bytes"],
        "phases": table,
    }


def split(model_config, stages: int, partition: str, micro_batches: int) -> list[Stage]:
    """The stages DeepSpeed makes of this model: each one's layers, parameters and forwards in flight."""
    from zero_recipes.modeling.model import meta_model
    from zero_recipes.parallel.pipeline.layers import pipeline_layers, stage_boundaries

    layers = pipeline_layers(meta_model(model_config))
    parts = stage_boundaries(layers, stages, partition)
    sizes = [_layer_params(layer) for layer in layers]
    n = len(layers) - 3
    out = []
    for s in range(stages):
        start, stop = int(parts[s]), int(parts[s + 1])  # DeepSpeed's are numpy integers
        mine = [p for layer in sizes[start:stop] for p in layer]
        out.append(
            Stage(
                s,
                start,
                stop,
                sum(1 <= i <= n for i in range(start, stop)),
                sum(mine),
                max(mine, default=0),
                in_flight(stages, s, micro_batches),
                start == 0,
                start <= n + 1 < stop,
                stop == len(layers),
            )
        )
    return out


def _layer_params(layer) -> list[int]:
    """Each trainable parameter's size in one pipeline layer, a LayerSpec built as DeepSpeed builds it to count."""
    from deepspeed.pipe import LayerSpec

    module = layer.build() if isinstance(layer, LayerSpec) else layer
    return [p.numel() for p in module.parameters() if p.requires_grad]
