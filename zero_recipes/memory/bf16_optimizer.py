"""Model states of DeepSpeed's BF16_Optimizer, the optimizer ZeRO-0 in bf16 steps through under a pipeline.

engine.py `_do_optimizer_sanity_check`: without ZeRO, bf16 parameters with bf16 gradient accumulation (no
`data_types.grad_accum_dtype`) get the BFLOAT16 wrapper when `pipeline_parallelism`, the FP16 one otherwise
(states.py's ZeRO-0). runtime/bf16_optimizer.py `_setup_for_real_optimizer` then makes, per parameter, with N the
data-parallel replicas of the stage (it partitions over them, as ZeRO-1 does):

- `bf16_groups_flat`: the bf16 parameters as one flat tensor (p; the module's own storage is swapped onto it);
- `fp32_groups_flat_partition`: the fp32 master of this rank's partition (4/N); Adam's two moments on it at the
  first step (8/N);
- `fp32_groups_gradients_flat`: the gradient accumulator, in grad_acc_dtype, the model's dtype here (p, whole);
- the bf16 gradients autograd leaves in param.grad (p), added to the accumulator after each backward.

The step (`step`) casts this rank's accumulator partition to fp32 for the optimizer (4/N) and torch's AdamW steps
the flat partition with its temporaries (Setup.adam_temporaries / N). The gradient all-reduce
(engine.py `buffered_allreduce_fallback` over `get_grads_for_reduction`) flattens the accumulator into a bucket of
at most 5e8 elements (`allreduce_bucket`). Measured on the CPU accelerator (probe.py, 2 ranks, PP2, 4
micro-batches): 8 B per parameter after init, 18 B before a step, the step's peak 30 B, as derived; both stages'
forward/backward peaks within 0.1 %. (One step of nine measured peaked 2 B per parameter higher.)
"""

from __future__ import annotations

from .states import PhaseBytes, Setup

ALLREDUCE_BUCKET = 5e8  # pipe/engine.py MEMORY_OPT_ALLREDUCE_SIZE: elements per all-reduce bucket


def applies(zero_stage: int, precision: str, pipeline: bool) -> bool:
    """DeepSpeed steps through BF16_Optimizer: ZeRO-0 in bf16 under a pipeline (module docstring)."""
    return pipeline and zero_stage == 0 and precision == "bf16"


def phases(s: Setup) -> dict[str, PhaseBytes]:
    """One rank's bytes per phase (plus "steady" and "forward"), activations excluded; all on the device."""
    P, N, p = s.num_params, s.world, s.bytes_per_param
    accumulator = p
    steady = p + accumulator + 12 / N  # flat bf16 params, the accumulator, the fp32 master and Adam's moments
    bucket = accumulator * min(1.0, ALLREDUCE_BUCKET / P)
    states = {
        "steady": steady,
        "forward": steady,
        "forward_backward": steady + p,  # the bf16 gradients in param.grad
        "optimizer_step": steady + p + 4 / N,  # and the fp32 copy of this rank's accumulator partition
        # the bf16 module flattened (its copy beside it), then the master partition and the accumulator
        "init": max(2 * p, p + accumulator + 4 / N),
    }
    buffers = dict.fromkeys(states, 0.0)
    buffers["forward_backward"] = bucket
    buffers["optimizer_step"] = s.adam_temporaries / N
    return {k: PhaseBytes(int(states[k] * P), int(buffers[k] * P), 0) for k in states}
