"""Liger-Kernel's SwiGLU and RMSNorm as the activation trace sees them (`--liger true`): what each kernel saves for
its backward and allocates, written in torch so that the trace (activations.py, fake tensors, no GPU, no Triton)
counts the same bytes. Liger-Kernel's kernels are Triton and need a GPU, so they cannot be traced here themselves;
these stand-ins compute the same values (a unit test checks them against transformers' modules) with the memory
behaviour of liger_kernel/ops/swiglu.py and rms_norm.py:

- SwiGLU (`LigerSiLUMulFunction`): c = silu(a) * b in one kernel, saving a and b only; its backward writes the
  gradients of a and b over the saved a and b, in place. transformers' MLP also keeps silu(a) for the product's
  backward: one intermediate-sized tensor more per MLP.
- RMSNorm (`LigerRMSNormFunction`, the "llama" casting mode): y = (x * rstd in fp32, cast back) * w in one kernel,
  saving x and the fp32 rstd, one number a row. transformers' LlamaRMSNorm keeps fp32 copies of x for its backward.
  Its backward writes dx in x's dtype and sums dw over rows in fp32 partials.

Liger's fused linear cross-entropy is modelled as train.py's tiled loss at Liger's chunk (stack.py); its RoPE
kernel saves what transformers' does (cos and sin), so it changes no peak.
"""

from __future__ import annotations

import torch

CHUNK, SLICES = 2**22, 64
"""The kernels keep their temporaries in registers; the stand-ins keep theirs (fp32, a few at a time) to a slice of
the rows: a 64th of them, and at most 2**22 elements (16 MB each), so that they stay small beside what is saved."""


def _rows(t) -> int:
    rows = t.shape[0]
    return max(1, min(-(-rows // SLICES), CHUNK // t.shape[-1]))


class SiLUMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return torch.nn.functional.silu(a) * b

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        a2, b2, dc2 = a.view(-1, a.shape[-1]), b.view(-1, b.shape[-1]), dc.reshape(-1, dc.shape[-1])
        n = _rows(a2)
        for i in range(0, a2.shape[0], n):  # over a and b, in place, as the kernel writes them
            x, y, g = a2[i : i + n].float(), b2[i : i + n].float(), dc2[i : i + n].float()
            sig = torch.sigmoid(x)
            db, da = g * x * sig, g * y * sig * (1 + x * (1 - sig))  # both before either is written
            b2[i : i + n], a2[i : i + n] = db.to(b.dtype), da.to(a.dtype)
        return a, b


class RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps: float):
        x2 = x.view(-1, x.shape[-1])
        rstd = torch.empty(x2.shape[0], 1, dtype=torch.float32, device=x.device)
        y = torch.empty_like(x2)
        n = _rows(x2)
        for i in range(0, x2.shape[0], n):
            xf = x2[i : i + n].float()
            rstd[i : i + n] = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            y[i : i + n] = (xf * rstd[i : i + n]).to(x.dtype) * w
        ctx.save_for_backward(x, w, rstd)
        return y.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        x, w, rstd = ctx.saved_tensors
        x2, dy2 = x.view(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        dx = torch.empty_like(x2)
        dw = torch.zeros(x2.shape[-1], dtype=torch.float32, device=x.device)
        n = _rows(x2)
        for i in range(0, x2.shape[0], n):
            xf, g, r = x2[i : i + n].float(), dy2[i : i + n].float(), rstd[i : i + n]
            normed = xf * r
            dw += (g * normed.to(x.dtype).float()).sum(0)
            gw = g * w.float()
            dx[i : i + n] = (r * (gw - normed * (gw * normed).mean(-1, keepdim=True))).to(x.dtype)
        return dx.view_as(x), dw.to(w.dtype), None


def _mlp_forward(mlp):
    def forward(x):
        return mlp.down_proj(SiLUMul.apply(mlp.gate_proj(x), mlp.up_proj(x)))

    return forward


def _norm_forward(norm):
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))

    def forward(x):
        return RMSNorm.apply(x, norm.weight, eps)

    return forward


def install(model) -> int:
    """Liger's SwiGLU on every gated SiLU MLP and its RMSNorm on every Llama-style RMSNorm (y = normed x * w);
    returns how many modules it replaced."""
    count = 0
    for module in model.modules():
        act = getattr(module, "act_fn", None)
        silu = type(act).__name__ in ("SiLU", "SiLUActivation")  # torch's, or transformers' ACT2FN["silu"]
        if silu and all(hasattr(module, k) for k in ("gate_proj", "up_proj", "down_proj")):
            module.forward = _mlp_forward(module)
            count += 1
        elif type(module).__name__ in ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"):
            module.forward = _norm_forward(module)
            count += 1
    return count
