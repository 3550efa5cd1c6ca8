"""Packed rows attend per example: the cut points between examples come with the batch, and each example
runs as if alone, either in one varlen flash-attention call (CUDA with flash-attn installed) or in one causal
sdpa call per example (everywhere else).

A packed SFT row carries several examples, told apart by position ids that restart at 0. transformers keeps
them apart with a block-diagonal s x s mask, and sdpa with a mask computes every query against every key of
the row: attention costs grow with the row (s^2), not with the examples (the sum of their squared lengths), and
the mask also rules out sdpa's causal fast path. The split here is exact: an example's tokens see the same keys
as in a row of its own.

The cut points are computed once per batch, on the host, by the collator (data/packing.py, `varlen_kwargs`),
under the names transformers' varlen flash path reads (`cu_seq_lens_q/k`, `max_length_q/k`, as HF's
DataCollatorWithFlattening gives them) plus their host copy (`cu_seq_lens_host`). The model's forward passes
them to every attention call through its **kwargs. Deriving them in each layer from the position ids, as this
module used to, reads device values: a host sync per layer (two with gradient checkpointing's recompute), which
on a GPU stalls the launch queue. Callers that do not pass them (the pipeline, which passes only position ids
between stages) still get the per-layer derivation.

With `--attn_implementation flash_attention_2` the same kwargs drive transformers' own varlen path; without
them transformers reads packed position ids only for a batch of one row, so rows of a larger micro-batch
attended causally across their examples.

Where it applies: training forwards of packed rows, and any forward that reaches attention with no mask
(Ulysses drops it, sequence_parallel.py). Everything else (eval, generation, padded batches, sliding-window
layers) takes sdpa unchanged.
"""

from __future__ import annotations

import functools

HOST_CUTS = "cu_seq_lens_host"
"""The cut points as a tuple of host ints: the sdpa split slices by them without reading a device tensor."""

SHARED_PROMPT = "shared_prompt_pairs_host"
"""A preference batch's layout (preference/pairs.py): per pair (start, prompt, chosen, rejected) lengths as host
ints, in a row of one batch. The chosen tokens attend to the prompt and themselves, the rejected ones to the
prompt and themselves."""


def varlen_kwargs(cuts: list[int]) -> dict:
    """The attention kwargs of a batch from its cut points: offsets into the batch's flattened tokens (rows of
    one length laid end to end) where each example, and each row's padding tail, starts, then the total."""
    import torch

    cu = torch.tensor(cuts, dtype=torch.int32)  # flash-attn's cu_seqlens dtype
    longest = max(e - a for a, e in zip(cuts[:-1], cuts[1:]))
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest,
            HOST_CUTS: tuple(cuts)}  # fmt: skip


def cuts_from_positions(pos, batch: int, seq: int) -> list[list[int]] | None:
    """Per row, the row-local cut points [0, ..., seq] where position ids restart at 0: what the attention
    derives when the batch brings none. Reads the ids' values (a host sync on a device)."""
    starts = [(row == 0).nonzero().flatten().tolist() for row in pos.reshape(-1, pos.shape[-1])]
    if len(starts) != batch:
        return None
    return [(s if s[:1] == [0] else [0, *s]) + [seq] for s in starts]


def per_row(cuts, batch: int, seq: int) -> list[list[int]] | None:
    """Flattened cut points -> per row, the row-local cut points [0, ..., seq]; None unless every row starts
    and ends at a cut (an example spanning two rows cannot be split per row)."""
    rows = []
    for r in range(batch):
        row = [c - r * seq for c in cuts if r * seq <= c <= (r + 1) * seq]
        if row[:1] != [0] or row[-1:] != [seq]:
            return None
        rows.append(row)
    return rows


def per_example_sdpa(sdpa):
    import torch

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        if kwargs.get(SHARED_PROMPT) and query.shape[2] == key.shape[2]:
            return _shared_prompt(sdpa, module, query, key, value, args, kwargs)
        rows = _packed_rows(module, query, key, attention_mask, kwargs)
        if rows is None:
            return sdpa(module, query, key, value, attention_mask, *args, **kwargs)
        kernel = _flash_kernel(query, kwargs)
        if kernel is not None:
            return _flash(kernel, module, query, key, value, args, kwargs)
        out = []
        for b, cuts in enumerate(rows):
            parts = [
                sdpa(module, query[b : b + 1, :, a:e], key[b : b + 1, :, a:e], value[b : b + 1, :, a:e], None,
                     *args, **kwargs)[0]
                for a, e in zip(cuts[:-1], cuts[1:])
                if e > a
            ]  # fmt: skip
            out.append(torch.cat(parts, dim=1))  # sdpa returns [batch, seq, heads, head_dim]
        return torch.cat(out, dim=0), None

    attention.per_example = True
    return attention


def _shared_prompt(sdpa, module, query, key, value, args, kwargs):
    """Each pair's prompt+chosen as one causal call, then its prompt+rejected as another whose first P outputs
    (the prompt's, already made) are dropped: two causal calls instead of a masked one, so sdpa's (and flash's)
    causal fast path applies, at the cost of the prompt's attention computed twice (its layers' matmuls are not)."""
    import torch

    seq, out = query.shape[2], []
    ends = 0
    for a, p, c, r in kwargs[SHARED_PROMPT]:
        if a > ends:  # nothing is laid there (collate leaves no gaps); kept exact anyway
            out.append(sdpa(module, *(t[:, :, ends:a] for t in (query, key, value)), None, *args, **kwargs)[0])
        out.append(sdpa(module, *(t[:, :, a : a + p + c] for t in (query, key, value)), None, *args, **kwargs)[0])
        rejected = [
            torch.cat([t[:, :, a : a + p], t[:, :, a + p + c : a + p + c + r]], dim=2) for t in (query, key, value)
        ]
        out.append(sdpa(module, *rejected, None, *args, **kwargs)[0][:, p:])
        ends = a + p + c + r
    if ends < seq:
        out.append(sdpa(module, *(t[:, :, ends:] for t in (query, key, value)), None, *args, **kwargs)[0])
    return torch.cat(out, dim=1), None  # sdpa returns [batch, seq, heads, head_dim]


def _packed_rows(module, query, key, attention_mask, kwargs) -> list[list[int]] | None:
    """Per row, the cut points of a packed training row; None where plain sdpa is right (no packed row, a
    KV cache, an eval mask, a sliding window)."""
    batch, seq = query.shape[0], query.shape[2]
    if (
        seq != key.shape[2]  # a KV cache: decoding, not a packed row
        or not (attention_mask is None or module.training)
        or getattr(module, "sliding_window", None)
    ):
        return None
    rows = per_row(kwargs[HOST_CUTS], batch, seq) if kwargs.get(HOST_CUTS) else None
    if rows is None:
        pos = kwargs.get("position_ids")
        if pos is None or pos.shape[-1] != seq:
            return None
        rows = cuts_from_positions(pos, batch, seq)
    if rows is None or all(len(r) == 2 for r in rows):  # one example per row: sdpa's causal path as it is
        return None
    return rows


def _flash_kernel(query, kwargs) -> str | None:
    """transformers' name for the installed flash-attention kernel when the varlen path can run this call:
    CUDA, half precision, the batch's cut points on the query's device. flash-attn 2 first (it has dropout;
    flash-attn 3 ignores it)."""
    import torch

    cu = kwargs.get("cu_seq_lens_q")
    if not (
        query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and cu is not None
        and cu.device == query.device
        and kwargs.get("max_length_q") is not None
    ):
        return None
    kernel = installed_flash()
    if kernel == "flash_attention_3" and kwargs.get("dropout"):
        return None
    return kernel


@functools.cache
def installed_flash() -> str | None:
    """flash_attention_2 or flash_attention_3 when its package is installed and CUDA is present, else None.
    The `kernels` package's hub builds are not taken here: loading one may download it mid-run."""
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

    if is_flash_attn_2_available():
        return "flash_attention_2"
    if is_flash_attn_3_available():
        return "flash_attention_3"
    return None


def _flash(kernel: str, module, query, key, value, args, kwargs):
    """transformers' flash-attention forward on the batch's cut points (its varlen branch). It loads the kernel
    named by `module.config._attn_implementation`, which here says sdpa, so it is shown a view naming the
    kernel. No mask: the cut points keep the examples apart."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    view = _Replaced(module, config=_Replaced(module.config, _attn_implementation=kernel))
    kwargs = {k: v for k, v in kwargs.items() if k != HOST_CUTS}
    return ALL_ATTENTION_FUNCTIONS[kernel](view, query, key, value, None, *args, **kwargs)


class _Replaced:
    """`obj` with some attributes replaced, every other one read from it."""

    def __init__(self, obj, **replaced):
        self.__dict__.update(replaced)
        self._obj = obj

    def __getattr__(self, name):
        return getattr(self._obj, name)


def install() -> None:
    """Put the per-example split in front of transformers' sdpa (once per process; before the first forward)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if not getattr(ALL_ATTENTION_FUNCTIONS["sdpa"], "per_example", False):
        ALL_ATTENTION_FUNCTIONS["sdpa"] = per_example_sdpa(ALL_ATTENTION_FUNCTIONS["sdpa"])
