"""A pipeline stage's activations, traced: DeepSpeed's 1F1B schedule (pipe/schedule.py `TrainSchedule`) run
instruction by instruction on the stage's real layers (parallel/pipeline/layers.py's, on a model built under
FakeTensorMode), with the memory of pipe/engine.py's buffers, while activations.py's tracer counts every storage.
What the stage holds and why is pipeline.py's docstring; this module is how it is measured.
"""

from __future__ import annotations

from .pipeline import Stage, StageActivations


def all_stages(model_config, stages: list, micro_batches: int, launch, bytes_per_param: int) -> list:
    """Every stage's activations for this launch (an estimate.Launch), in the run's dtype: bf16 for bf16 and fp16
    alike, as activations.py traces them."""
    import torch

    dtype = torch.float32 if bytes_per_param == 4 else torch.bfloat16
    return [stage_activations(model_config, st, len(stages), micro_batches, launch, dtype) for st in stages]


def stage_activations(model_config, stage: Stage, stages: int, micro_batches: int, launch, dtype) -> StageActivations:
    """The stage's activations at the launch's micro-batch, sequence length, checkpointing, attention and tiled
    MLP: traced with one and two of its blocks, extrapolated to its own count; a stage without blocks as it is."""
    runs = min(micro_batches, stage.in_flight + 2)  # warm-up, a steady 1F1B pair, and the last stage's 2 buffers
    if not stage.blocks:
        return _trace_stage(model_config, stage, 0, stages, runs, launch, dtype)
    one, two = (_trace_stage(model_config, stage, n, stages, runs, launch, dtype) for n in (1, 2))
    extra = stage.blocks - 1
    return StageActivations(
        one.peak + extra * max(0, two.peak - one.peak),
        one.grads_at_peak + extra * max(0, two.grads_at_peak - one.grads_at_peak),
        one.resident + extra * max(0, two.resident - one.resident),
    )


def _trace_stage(model_config, stage: Stage, blocks: int, stages: int, runs: int, launch, dtype) -> StageActivations:
    """DeepSpeed's schedule for this stage with `blocks` blocks, on fake tensors: one step, or for the stage
    holding the head two, the second's peak (the first's logits still in their buffers)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    from zero_recipes.parallel.pipeline.layers import StepLoss, pipeline_layers

    from .activations import _eager_masks, _with_layers

    attn = launch.attn_implementation
    attn = "sdpa" if attn.startswith("flash") else attn  # same memory class: no s x s matrix is kept
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        model = AutoModelForCausalLM.from_config(_with_layers(model_config, max(blocks, 1)), dtype=dtype,
                                                 attn_implementation=attn)  # fmt: skip
        if launch.gradient_checkpointing:
            from zero_recipes.modeling.model import enable_checkpointing

            enable_checkpointing(model)
        if launch.tiled_mlp:  # train.py installs it under a pipeline too (lm_loss.install_for_run)
            from zero_recipes.modeling.lm_loss import install_tiled_mlp

            install_tiled_mlp(model, zero3=False)
        model.train()
        layers = _stage_layers(pipeline_layers(model), stage, blocks)
        params = list({id(p): p for layer in layers for p in layer.parameters()}.values())
        tracker = _tracker(params + [b for layer in layers for b in layer.buffers()])
        loss_fn = StepLoss()
        loss_fn.normaliser = 1.0
        text = model_config.get_text_config()
        rows = (launch.micro_batch_size, launch.seq_len)
        sim = _Schedule(layers, loss_fn, stage, stages, rows, text.hidden_size, dtype)
        with tracker, _eager_masks():
            for _ in range(2 if stage.heads else 1):  # what outlives a step: the last stage's logits
                tracker.peak, tracker.grads_at_peak = tracker.live, tracker.grads
                sim.step(runs)
                peak, grads = tracker.peak, tracker.grads_at_peak
                tracker.zero_grad(params)
    return StageActivations(peak, grads, tracker.live)


def _stage_layers(layers: list, stage: Stage, blocks: int) -> list:
    """The stage's layers out of a traced model's list with `blocks` blocks; a tied LayerSpec built."""
    from deepspeed.pipe import LayerSpec

    n = len(layers) - 3
    picked = ([0] if stage.embeds else []) + list(range(1, 1 + blocks))
    picked += ([n + 1] if stage.norms else []) + ([n + 2] if stage.heads else [])
    built = {}
    out = []
    for i in picked:
        layer = layers[i]
        if isinstance(layer, LayerSpec):  # one module per tied key on a stage (pipe/module.py `tied_modules`)
            layer = built.setdefault(getattr(layer, "key", i), layer.build())
        out.append(layer)
    return out


def _tracker(existing: list):
    """activations.py's live-bytes tracker, also counting the parameter gradients live at its peak (each one's
    storage once a step: later micro-batches accumulate into it)."""
    import torch

    from .activations import _tracker_class

    class WithGrads(_tracker_class()):
        def __init__(self, existing):
            super().__init__(existing)
            self.grads = self.grads_at_peak = 0
            self.with_grad = set()
            for p in existing:
                if isinstance(p, torch.nn.Parameter) and p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._counted)

        def _counted(self, param) -> None:
            if id(param) not in self.with_grad:
                self.with_grad.add(id(param))
                self.grads += param.grad.untyped_storage().nbytes()

        def zero_grad(self, params) -> None:
            for p in params:  # the engine's zero_grad after the step (set to None)
                p.grad = None
            self.grads = 0
            self.with_grad.clear()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before = self.peak
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if self.peak > before:
                self.grads_at_peak = self.grads
            return out

    return WithGrads(existing)


class _Schedule:
    """pipe/engine.py's instructions, with their memory, on one stage's layers (module docstring)."""

    def __init__(self, layers, loss_fn, stage: Stage, stages: int, rows: tuple, hidden: int, dtype):
        self.layers, self.loss_fn, self.stage, self.stages = layers, loss_fn, stage, stages
        self.rows, self.hidden, self.dtype = rows, hidden, dtype
        self.inputs, self.labels, self.outputs = {}, {}, {}
        self.persistent = {}  # _grad_layer_buf: one buffer per tensor index, for receiving and for gradients
        self.loss, self.grad_layer = None, None

    def step(self, micro_batches: int) -> None:
        from deepspeed.runtime.pipe import schedule

        handlers = {
            schedule.LoadMicroBatch: self.load,
            schedule.RecvActivation: self.recv,
            schedule.ForwardPass: self.forward,
            schedule.BackwardPass: self.backward,
            schedule.RecvGrad: self.recv_grad,
            schedule.SendGrad: self.send_grad,
        }
        for cmds in schedule.TrainSchedule(micro_batches, self.stages, self.stage.index).steps():
            for cmd in cmds:
                if type(cmd) in handlers:
                    handlers[type(cmd)](cmd.buffer_id)

    def _buffer(self, idx: int, shape, dtype):
        import torch

        buf = self.persistent.get(idx)
        if buf is None or buf.numel() < torch.Size(shape).numel():
            buf = self.persistent[idx] = torch.zeros(shape, dtype=dtype)
        return buf.flatten()[: torch.Size(shape).numel()].view(shape)

    def _incoming(self) -> list:
        """(shape, dtype) of what this stage receives: hidden states and position ids, or the norm's output."""
        import torch

        first_is_head = self.stage.heads and not (self.stage.blocks or self.stage.norms)
        hidden = ((*self.rows, self.hidden), self.dtype)
        return [hidden] if first_is_head else [hidden, (self.rows, torch.long)]

    def load(self, b: int) -> None:
        import torch

        if self.stage.embeds:
            self.inputs[b] = (torch.zeros(self.rows, dtype=torch.long), torch.zeros(self.rows, dtype=torch.long))
        if self.stage.heads:
            self.labels[b] = torch.zeros(self.rows, dtype=torch.long)

    def recv(self, b: int) -> None:
        got = []
        for idx, (shape, dtype) in enumerate(self._incoming()):
            t = self._buffer(idx, shape, dtype).clone().detach()
            t.requires_grad = t.is_floating_point()
            got.append(t)
        self.inputs[b] = got[0] if len(got) == 1 else tuple(got)

    def forward(self, b: int) -> None:
        x = self.inputs[b]
        x = tuple(t.clone() for t in x) if isinstance(x, tuple) else x.clone()
        for layer in self.layers:
            x = layer(x)
        self.outputs[b] = x
        if self.stage.heads:
            self.loss = self.loss_fn(x, self.labels[b])

    def backward(self, b: int) -> None:
        if self.stage.heads:  # the engine's backward of the loss; the logits stay in their buffer
            self.loss.backward()
            return
        out = self.outputs[b]
        floats = [t for t in (out if isinstance(out, tuple) else (out,)) if t.is_floating_point()]
        for i, (t, g) in enumerate(zip(floats, self.grad_layer)):
            t.backward(gradient=g, retain_graph=i < len(floats) - 1)
        self.outputs[b] = None

    def recv_grad(self, b: int) -> None:
        out = self.outputs[b]
        floats = [t for t in (out if isinstance(out, tuple) else (out,)) if t.is_floating_point()]
        self.grad_layer = [self._buffer(i, t.shape, t.dtype) for i, t in enumerate(floats)]

    def send_grad(self, b: int) -> None:
        self.inputs[b] = None
