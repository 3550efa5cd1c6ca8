"""A model that exists before DeepSpeed does (`--zero_init false`): what DeepSpeed then does with it on a GPU.

train.py builds the model inside `deepspeed.zero.Init` under ZeRO-3, so each rank only ever holds its partition.
Many scripts do not: the HF Trainer whenever `from_pretrained` runs before `TrainingArguments(deepspeed=...)`
(no HfDeepSpeedConfig exists yet, so transformers loads the whole model), DeepSpeed-Chat-style scripts that call
`deepspeed.initialize(model=...)` on a loaded model. Paths are DeepSpeed 0.19.8's, under deepspeed/runtime/:

- **Init, ZeRO-3.** engine.py `_configure_distributed_model` sees no `ds_id` on the parameters
  (`is_zero_init_model` false): it casts them to the 16-bit dtype on the host (`_cast_module_mixed_precision`) and
  moves the whole module to the GPU (`self.module.to(self.device)`), with or without offload_param. Only then does
  the ZeRO-3 optimizer partition it (zero/parameter_offload.py `_convert_to_zero_parameters` ->
  `Init(module=...)`), parameter by parameter, each partition allocated before its whole tensor is freed: p bytes
  for every parameter the rank holds, plus the largest one's partition. A model whose 16-bit weights do not fit one
  GPU runs out of memory here, whatever ZeRO-3 would save later. ZeRO-0/1/2 keep the whole 16-bit model on every
  GPU anyway: nothing changes on the device.
- **Host.** Every rank (process) holds the whole model in the dtype it was loaded in until it moves
  (`host_bytes`): fp32 under transformers 4 without torch_dtype, the checkpoint's dtype under transformers 5's
  `dtype="auto"`.
- **Forward, ZeRO-3, before DeepSpeed 0.19.4.** A module built under zero.Init gets DeepSpeed's
  `LinearFunctionForZeroStage3` in place of `F.linear` (zero/linear.py), which saves the parameter, not its data.
  A module passed in already built did not, until PR #8189 (0.19.4, "Enable ZeRO-3 linear wrapper for existing
  models"): torch's own linear saves `weight.t()`, a view of the gathered storage, for the input's gradient, so
  when ZeRO-3 releases the parameter after its forward (`param.data` emptied) the view keeps the whole gathered
  weight alive until that layer's backward. Without checkpointing, every linear weight is then held at the start
  of the backward (p bytes each), of which ZeRO-3 would have kept the last layers' anyway (its live-parameter
  cap); with checkpointing, the checkpointed layers keep nothing from their forward (they recompute it in the
  backward), and only the output head, which ZeRO-3 usually keeps gathered for its backward anyway, is held.
  gpjt's Llama-3-8B sweeps (DeepSpeed 0.14, model loaded first) show it: 33-36 GiB at a sequence of 1 token
  without checkpointing, where the states are 15 GiB.
"""

from __future__ import annotations

from dataclasses import dataclass

LINEAR_WRAPPER_FOR_BUILT_MODELS = (0, 19, 4)
"""The DeepSpeed release whose ZeRO-3 wraps F.linear for a model passed in already built (PR #8189)."""


def version_tuple(text: str) -> tuple[int, ...]:
    """ "0.14.2" -> (0, 14, 2); a suffix such as "+cu121" or ".dev0" is dropped."""
    import re

    parts = re.findall(r"\d+", text.split("+")[0])[:3]
    if not parts:
        raise ValueError(f"not a version: {text!r}")
    return tuple(int(p) for p in parts)


def installed_deepspeed() -> tuple[int, ...]:
    import deepspeed

    return version_tuple(deepspeed.__version__)


@dataclass(frozen=True)
class Preloaded:
    """What the estimate needs to know of a model built before DeepSpeed (`--zero_init false`)."""

    deepspeed_version: tuple[int, ...]
    load_bytes: int = 4
    """Bytes per parameter of the copy each process loads on the host (4: fp32, 2: bf16/fp16)."""

    @property
    def linear_wrapped(self) -> bool:
        return self.deepspeed_version >= LINEAR_WRAPPER_FOR_BUILT_MODELS


def init_device_bytes(stage: int, p: int, held_params: int, largest: int, shards: int) -> int:
    """The GPU's bytes while DeepSpeed partitions a model that arrived whole (module docstring): ZeRO-3 only."""
    if stage < 3:
        return 0
    return int(p * held_params + p * largest / shards)


def retained_linear_bytes(setup, pre: Preloaded, linear_params: int, head_params: int, checkpointing: bool) -> int:
    """Gathered linear weights that torch's linear keeps alive into the backward (module docstring), beyond what
    ZeRO-3 keeps gathered there anyway: it releases a parameter after its forward only past
    stage3_max_reuse_distance and stage3_max_live_parameters, so the last layers' weights are held either way, and
    the estimate already counts up to that cap gathered in the forward (states_gpu.py `gathered`). Measured on
    the CPU with real ZeRO-3 on 2 ranks and torch's linear put back (model B, bf16): +2 B for every linear weight
    with nothing kept gathered, that minus what the live cap keeps with one, and with checkpointing nothing once
    the cap holds the head. 0 from DeepSpeed 0.19.4 on, or below ZeRO-3."""
    from .states import Inputs
    from .states_gpu import gathered

    if setup.stage < 3 or pre.linear_wrapped:
        return 0
    t = Inputs.of(setup)
    held = setup.bytes_per_param * (head_params if checkpointing else linear_params)
    return int(max(0.0, held - gathered(t) * t.P))


def note(setup, shape, pre: Preloaded, checkpointing: bool) -> str:
    """The line the estimate prints for a model built before DeepSpeed."""
    stage, p = setup.stage, setup.bytes_per_param
    host_copy = pre.load_bytes * shape.model_params
    text = (f"model built before DeepSpeed (--zero_init false): each process holds it whole on the host first "
            f"({host_copy / 2**30:.2f} GiB)")  # fmt: skip
    if stage < 3:
        return text
    kept = retained_linear_bytes(setup, pre, shape.linear_params, shape.head_params, checkpointing)
    version = ".".join(map(str, pre.deepspeed_version))
    text += (
        f"; ZeRO-3 moves it whole to each GPU before partitioning it ({p * setup.num_params / 2**30:.2f} GiB at init)"
    )
    if kept:
        text += (f"; DeepSpeed {version} (before 0.19.4) leaves torch's linear holding views of the gathered weights, "
                 f"{kept / 2**30:.2f} GiB into the backward")  # fmt: skip
    return text + (". Built under zero.Init (HF: TrainingArguments(deepspeed=...) before from_pretrained) it does "
                   + ("neither" if kept else "not"))  # fmt: skip


def adjust(by_phase: dict, setup, shape, pre: Preloaded | None, checkpointing: bool) -> dict:
    """states.phases' result for a model that arrived whole: init holds it whole on the GPU under ZeRO-3, and before
    0.19.4 the forward keeps the gathered linear weights (both DeepSpeed's working memory, `buffers`)."""
    from dataclasses import replace

    if pre is None:
        return by_phase
    p, stage = setup.bytes_per_param, setup.stage
    out = dict(by_phase)
    init = out["init"]
    whole = init_device_bytes(stage, p, setup.num_params, setup.largest_param, setup.world)
    if whole > init.device:
        out["init"] = replace(init, buffers=init.buffers + whole - init.device)
    kept = retained_linear_bytes(setup, pre, shape.linear_params, shape.head_params, checkpointing)
    for name in ("forward", "forward_backward"):
        out[name] = replace(out[name], buffers=out[name].buffers + kept)
    return out
