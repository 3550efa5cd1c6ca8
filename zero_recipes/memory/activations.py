"""Activation memory of one micro-batch's forward and backward, traced through the installed model code.

The model is built under FakeTensorMode (no memory, no weights read) and runs forward with labels and
backward. A TorchDispatchMode counts every tensor storage the run creates and frees, so the peak is
what this transformers version really keeps: its attention kernel's saved tensors (sdpa/flash keep no
s x s matrix, eager does), GQA's smaller k/v, SwiGLU's gate and up, RMSNorm's fp32 upcasts, and the loss
region (logits, their fp32 copy, log-softmax and its gradient: about 14 s*b*V bytes in bf16).

Gradients are dropped as they are produced: DeepSpeed moves them into its own buffers, which
states.py counts. Only 1 and 2 layers are traced and the rest extrapolated (layers are identical), so a
70B model costs the same seconds as a tiny one. Where tracing cannot run (remote code that breaks under
fake tensors), a closed form after Korthikanti et al. (arXiv 2205.05198) stands in, and says so.

Measured against the torch profiler on real tensors (tests/unit/memory/test_estimate.py, test_memory_sp.py):
equal to the byte for sdpa in bf16 and fp32, with gradient checkpointing and with train.py's tiled loss and MLP.
(Before masks were created as in an eager run, `_eager_masks`, the trace held a causal s x s mask per layer that
real runs never allocate: +4 % at 2 x 512 tokens, +13 % at 2 x 2048, growing with the length.)

Sequence parallelism (sequence_parallel.py): one rank is traced at its s/N tokens with Ulysses' attention shapes.
train.py's own loss (zero_recipes.modeling.lm_loss: always under SP, tiled once a micro-batch exceeds one tile) and its
tiled MLP are installed on the traced model as train.py installs them, so their tiles are what is counted.

DPO (--objective dpo): the traced step is the preference runner's (objective.py), a row of pairs through its shared-
prompt attention and the answers' logits; equal to the byte to a real one in bf16 and fp32, 0.4 % under with
gradient checkpointing (tests/unit/memory/test_dpo_estimate.py).
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from dataclasses import dataclass


@dataclass
class Activations:
    bytes: int
    per_layer_bytes: int
    method: str  # "traced" or "closed form"


def _storage_key(t):
    return t.untyped_storage()._cdata


def _tracker_class():
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class LiveBytes(TorchDispatchMode):
        """Live bytes of the storages created inside the mode; a storage dies with its last tensor."""

        def __init__(self, existing):
            super().__init__()
            self.live = self.peak = 0
            # views of parameters (w.t() in every Linear) share their storage: not new memory
            self.refs = {_storage_key(t): [0, float("inf")] for t in existing}

        def _drop(self, key):
            entry = self.refs.get(key)
            if entry is not None:
                entry[1] -= 1
                if entry[1] == 0:
                    self.live -= entry[0]
                    del self.refs[key]

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            import torch

            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    key = _storage_key(t)
                    if key in self.refs:
                        self.refs[key][1] += 1
                    else:
                        nbytes = t.untyped_storage().nbytes()
                        self.refs[key] = [nbytes, 1]
                        self.live += nbytes
                        self.peak = max(self.peak, self.live)
                    weakref.finalize(t, self._drop, key)
            return out

    return LiveBytes


def _with_layers(config, layers: int):
    c = copy.deepcopy(config)
    text = c.get_text_config()
    text.num_hidden_layers = layers
    if isinstance(getattr(text, "layer_types", None), list):
        text.layer_types = text.layer_types[:layers]
    return c


def trace_peak(
    config,
    micro_batch: int,
    seq_len: int,
    dtype,
    gradient_checkpointing: bool,
    attn: str,
    lora=None,
    sp: int = 1,
    loss_tile: int | None = None,
    tiled_mlp: bool = False,
    objective: str = "lm",
    autocast: str | None = None,
    liger: bool = False,
) -> int:
    """`seq_len` is the whole sequence; with `sp` > 1 the model runs on its seq_len/sp slice with Ulysses'
    attention (sequence_parallel.ulysses_attention). `loss_tile`: None, the model's own loss; else train.py's
    (zero_recipes.modeling.lm_loss) with that many tokens per tile, 0 for its untiled path. `tiled_mlp`: every MLP
    through DeepSpeed's TiledMLP as train.py wraps it (lm_loss.install_tiled_mlp). `objective` "dpo": micro_batch
    pairs of seq_len tokens in one row, through DPO's own step (memory/objective.py). `autocast` ("bfloat16",
    "float16"): the forward and backward inside torch.autocast, as DeepSpeed's `torch_autocast` runs them
    (engine.py `forward` under torch_autocast.py `autocast_if_enabled`): each Linear computes in that dtype from
    a cast of its fp32 weight (autocast's cache keeps the casts until the region ends), the rest in fp32.
    `liger`: Liger-Kernel's SwiGLU and RMSNorm as their kernels hold memory (liger.py)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    from .moe import traceable_experts
    from .objective import dpo_batch, dpo_step

    attn = "sdpa" if attn.startswith("flash") else attn  # same memory class: no s x s matrix is kept
    if sp > 1:
        from .sequence_parallel import traced_attention

        attn = traced_attention(sp)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
        if gradient_checkpointing:
            from zero_recipes.modeling.model import enable_checkpointing

            enable_checkpointing(model)
        if loss_tile is not None or tiled_mlp:
            from zero_recipes.modeling import lm_loss

            if loss_tile is not None:  # zero3=False: no collective to agree on the tile count in a trace
                lm_loss.install(model, loss_tile or 1, bool(loss_tile), zero3=False)
            if tiled_mlp:
                lm_loss.install_tiled_mlp(model, zero3=False)
        if liger:
            from .liger import install

            install(model)
    if lora is not None:  # outside the fake mode (_peft_wrapped says why)
        model = _peft_wrapped(model, lora)
    with mode:
        model.train()
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(_drop_when_ready)
        ids = torch.zeros(micro_batch, seq_len // sp, dtype=torch.long)
        pairs = dpo_batch(micro_batch, seq_len) if objective == "dpo" else None
        tracker = _tracker_class()(list(model.parameters()) + list(model.buffers()))
        # "cpu": the fake tensors' device; autocast's rules for Linear are the same on a GPU. The forward runs in
        # the region, the backward after it, as DeepSpeed's engine runs them (DPO's step: both inside)
        region = torch.autocast("cpu", dtype=getattr(torch, autocast)) if autocast else contextlib.nullcontext()
        with tracker, _eager_masks(), traceable_experts():
            if pairs is not None:
                with region:
                    dpo_step(model, pairs)
            else:
                with region:
                    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
                del loss
    return tracker.peak


def _peft_wrapped(model, lora):
    """peft's LoRA layers as train.py wraps them (zero_recipes.adapters.lora.wrap): lora_A, lora_B and the dropout save
    their inputs, and autograd saves no input of a frozen weight's matmul for its (absent) grad. Wrapped outside
    the fake mode: peft moves each new adapter to its base layer's device, which fake parameters cannot be
    swapped for (an error, measured); the adapters of one or two layers are small real tensors.
    modules_to_save are wrapped without peft's copy of them: deep-copying fake parameters crashed the process (a
    segfault, measured, in the traced backward). A trainable copy of a module saves what the module itself saves
    once made trainable, so the originals are made trainable instead."""
    from peft import get_peft_model

    traced = copy.deepcopy(lora)
    to_save, traced.modules_to_save = list(traced.modules_to_save or []), None
    model = get_peft_model(model, traced, autocast_adapter_dtype=False)
    for name, module in model.named_modules():
        if any(name == t or name.endswith("." + t) for t in to_save):
            module.requires_grad_(True)
    return model


def _drop_when_ready(param) -> None:
    """A gradient leaves for DeepSpeed's buffers as it is made, except inside a tiled compute: DeepSpeed's
    sequence_tiled_compute and TiledMLP mark their weights `ds_grad_is_ready = False` until the last tile, and
    ZeRO then leaves the gradient in `param.grad` (stage_1_and_2.py and stage3.py skip the bucket), where autograd
    adds each tile's gradient to it: the weight's gradient held from the first tile to the last, plus one tile's."""
    if getattr(param, "ds_grad_is_ready", True):
        param.grad = None


@contextlib.contextmanager
def _eager_masks():
    """Mask creation as in an eager run on rows of one sequence each. transformers skips the causal mask for sdpa
    (is_causal instead) unless it is tracing, and it counts a fake tensor as tracing (masking_utils `is_tracing`,
    asked of the 0-d query offset), so under FakeTensorMode every layer got a materialised s x s mask, which the
    CPU sdpa converts and saves per layer: 2*b*s^2 bytes a layer that a real run never allocates (measured: the
    trace was +4 % over a real bf16 forward/backward at 2 x 512 tokens, +13 % at 2 x 2048). Within the trace that
    offset's fakeness is not taken for tracing, and the packed-rows detection (which reads position ids' values,
    which fake tensors have not) answers as for an unpacked row."""
    from transformers import masking_utils

    traced, packed = masking_utils.is_tracing, masking_utils.find_packed_sequence_indices
    masking_utils.is_tracing = lambda tensor=None: traced(None if tensor is not None and tensor.dim() == 0 else tensor)
    masking_utils.find_packed_sequence_indices = lambda *args, **kwargs: None
    try:
        yield
    finally:
        masking_utils.is_tracing, masking_utils.find_packed_sequence_indices = traced, packed


def loss_tile(config, micro_batch: int, seq_len: int, sp: int, tiled_loss: bool, loss_tile_tokens: int) -> int | None:
    """Which loss train.py runs, as trace_peak takes it: None for the model's own (transformers' ForCausalLMLoss),
    else zero_recipes.modeling.lm_loss's with this many tokens per tile (0: its untiled path). lm_loss.applies decides:
    always under SP, else when tiling is on and the micro-batch's local tokens exceed one tile."""
    from types import SimpleNamespace

    from zero_recipes.modeling import lm_loss

    cfg = SimpleNamespace(
        per_device_train_batch_size=micro_batch,
        block_size=seq_len,
        tiled_loss=tiled_loss,
        loss_tile_tokens=loss_tile_tokens,
    )
    if not lm_loss.applies(cfg, config, sp):
        return None
    return lm_loss.tile_tokens(cfg, config) if tiled_loss else 0


def closed_form(
    config,
    micro_batch: int,
    seq_len: int,
    bytes_per: int,
    gradient_checkpointing: bool,
    attn: str,
    tp: int = 1,
    vocab_parallel: bool = False,
    sp: int = 1,
    tile: int | None = None,
) -> Activations:
    """Korthikanti et al.: s*b*h*34 bytes per layer in 16-bit, plus 5*a*s^2*b without a fused attention
    kernel; full recompute keeps 2*s*b*h per layer (plus one layer's worth while it recomputes). The loss
    region is 14*s*b*V in 16-bit (16 in fp32). With tensor parallelism (their section 4.2.1) s*b*h*(10 + 24/t)
    and the attention matrix over t; the loss region over t only for a vocabulary-parallel head. With sequence
    parallelism every term of the s/sp local tokens; a tiled loss region is one tile's (plus the hidden states'
    gradient, s*b*h)."""
    t = config.get_text_config()
    s, b, h, layers = seq_len // sp, micro_batch, t.hidden_size, t.num_hidden_layers
    scale = bytes_per / 2
    per_layer = s * b * h * (10 + 24 / tp) * scale + (
        0 if attn in ("sdpa", "flash_attention_2") else 5 * t.num_attention_heads * s * s * b * scale / tp
    )
    loss_tokens = min(s * b, tile) if tile else s * b
    loss = loss_tokens * t.vocab_size * (14 if bytes_per == 2 else 16) / (tp if vocab_parallel else 1)
    if tile and loss_tokens < s * b:
        loss += s * b * h * bytes_per
    if gradient_checkpointing:
        total = layers * 2 * s * b * h * scale + per_layer + loss
    else:
        total = layers * per_layer + loss
    return Activations(int(total), int(per_layer), "closed form")


def activation_bytes(
    config,
    micro_batch: int,
    seq_len: int,
    dtype,
    gradient_checkpointing: bool,
    attn: str = "sdpa",
    lora=None,
    tp: int = 1,
    vocab_parallel: bool = False,
    sp: int = 1,
    tiled_loss: bool = True,
    loss_tile_tokens: int = 0,
    tiled_mlp: bool = False,
    objective: str = "lm",
    autocast: str | None = None,
    liger: bool = False,
) -> Activations:
    """`lora`: a peft LoraConfig (zero_recipes.adapters.lora.lora_config) to trace the peft-wrapped model, else None.
    `tp` > 1: one tensor-parallel rank's activations, traced through the model with its per-rank widths
    (tensor_parallel.local_config: heads and MLP width over tp, the residual stream and norms whole).
    `sp` > 1: one Ulysses rank's, the model run on seq_len/sp tokens with the all-to-alls' shapes around
    attention (sequence_parallel.py). `tiled_loss`, `loss_tile_tokens`, `tiled_mlp`: train.py's flags; the loss
    and the MLPs are traced through train.py's own code for them (zero_recipes.modeling.lm_loss). `objective` "dpo":
    DPO's step over micro_batch pairs of seq_len tokens, its answers' logits untiled (memory/objective.py).
    `autocast`: the torch_autocast dtype, traced with fp32 parameters inside torch.autocast (trace_peak). `liger`:
    Liger-Kernel's SwiGLU and RMSNorm (liger.py)."""
    import torch

    from .tensor_parallel import local_config

    layers = config.get_text_config().num_hidden_layers
    traced = local_config(config, tp, vocab_parallel) if tp > 1 else config
    tile = None if objective == "dpo" else loss_tile(config, micro_batch, seq_len, sp, tiled_loss, loss_tile_tokens)
    try:
        one, two = (
            trace_peak(
                _with_layers(traced, n),
                micro_batch,
                seq_len,
                dtype,
                gradient_checkpointing,
                attn,
                lora,
                sp,
                tile,
                tiled_mlp,
                objective,
                autocast,
                liger,
            )
            for n in (1, 2)
        )
    except Exception:  # noqa: BLE001 -- any model code that cannot run on fake tensors
        return closed_form(
            config,
            micro_batch,
            seq_len,
            2 if dtype != torch.float32 else 4,
            gradient_checkpointing,
            attn,
            tp,
            vocab_parallel,
            sp,
            tile,
        )
    per_layer = max(0, two - one)
    return Activations(one + (layers - 1) * per_layer, per_layer, "traced")
