"""Ulysses sequence parallelism: DeepSpeed's ALST (`deepspeed.runtime.sequence_parallel.ulysses_sp`).

`"sequence_parallel_size": N` splits every sequence across the N ranks of a group. Each rank runs the
model on its s/N tokens; in each attention layer DeepSpeed's all-to-all trades the sequence split for a
head split (whole sequence, heads/N), the attention kernel runs, and a second all-to-all trades back. The
activations of a rank are those of s/N tokens, so the longest sequence grows with N.

What train.py adds around DeepSpeed's pieces, and why:
- The batch is cut here (`shard`), not by DeepSpeed's UlyssesSPDataLoaderAdapter: the ranks of an SP
  group already hold the same rows (the data order is sharded by data-parallel rank), so the adapter's
  all-gather of every rank's batch would move data each rank has. The cut is the adapter's: labels
  pre-shifted into `shift_labels`, position ids kept global, the attention mask dropped.
- Packed rows stay apart: DeepSpeed's Ulysses drops the attention mask and passes every other kwarg to the
  kernel unchanged (position ids gathered to whole rows), so a kernel left alone attends causally across the
  whole row, letting packed examples see each other. `shard` therefore keeps the collator's cut points between
  examples (packed_attention.varlen_kwargs), re-laid for the whole rows Ulysses attends over (padded to a
  multiple of N), and both kernels read them: sdpa runs once per example (`packed_attention.per_example_sdpa`,
  no host sync per layer), flash-attention runs varlen on `cu_seq_lens_q/k` (transformers derives varlen from
  position ids only for a one-row micro-batch, so without them rows of a larger one mixed their examples).
  flex-attention gets a plain causal mask (DeepSpeed rebuilds it), so packing with it is refused.
- Eval and the export check run without SP (DeepSpeed's `disable_in_eval`): every rank evaluates whole
  rows of its own, as data parallelism over all ranks.
"""

from __future__ import annotations

from types import SimpleNamespace

from zero_recipes.ds.facts import zero_stage
from zero_recipes.errors import ConfigError
from zero_recipes.modeling import packed_attention
from zero_recipes.modeling.lm_loss import KNOWN_HEADS, knows_head
from zero_recipes.parallel.axis import ParallelAxis

ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
"""What Ulysses runs on: kernels that take no s x s mask (eager needs one and DeepSpeed rejects it)."""

KEEP_PACKED_APART = ("sdpa", "flash_attention_2", "flash_attention_3")


def adopt_llamafactory_sequence_parallel(ds: dict) -> tuple[str, ...]:
    """LLaMA-Factory's `"sequence_parallel": {"enabled", "size", "mode"}` block (its own code reads it,
    DeepSpeed does not) becomes DeepSpeed's `sequence_parallel_size`, so its ALST configs run unchanged."""
    block = ds.get("sequence_parallel")
    if not isinstance(block, dict):
        return ()
    ds.pop("sequence_parallel")
    if not block.get("enabled"):
        return ('dropped LLaMA-Factory\'s disabled "sequence_parallel" block',)
    mode, size = str(block.get("mode", "ulysses")).lower(), block.get("size")
    if mode != "ulysses" or not isinstance(size, int) or size < 1:
        raise ConfigError(
            f'"sequence_parallel" (LLaMA-Factory\'s block) asks for mode {mode!r}, size {size!r}: train.py runs '
            'DeepSpeed\'s Ulysses only; replace the block with "sequence_parallel_size": N'
        )
    if ds.get("sequence_parallel_size", size) != size:
        raise ConfigError(
            f'"sequence_parallel" says size {size} but sequence_parallel_size is {ds["sequence_parallel_size"]}; '
            "keep one of them"
        )
    ds["sequence_parallel_size"] = size
    return (f'LLaMA-Factory\'s "sequence_parallel" block read as DeepSpeed\'s "sequence_parallel_size": {size}',)


class SequenceParallel(ParallelAxis):
    owns_attention = True  # register_ulysses wraps the kernel (and packed_attention under it)
    counts_tokens = True  # per-slice means would weight the slices of a row unequally
    live_eval_refusal = "its attention takes each rank's slice of a row (Ulysses), and lm-eval feeds whole rows"

    @staticmethod
    def adopt(ds: dict) -> tuple[str, ...]:
        return adopt_llamafactory_sequence_parallel(ds)

    def check(self, model_config, ds: dict, cfg) -> tuple[str, ...]:
        return check(self.mesh, model_config, ds, cfg, knows_head(model_config))

    def before_build(self, cfg, model_config, log) -> None:
        """Ulysses goes into transformers' attention table before the model is built."""
        sp = self.mesh.sp
        register_ulysses(cfg, model_config, self.mesh)
        log(
            f"sequence parallelism: each rank trains {cfg.block_size // sp} of every {cfg.block_size} tokens; "
            f"attention all-to-alls to whole sequences with 1/{sp} of the heads (DeepSpeed Ulysses)"
        )

    def mpu(self):
        return deepspeed_mpu()

    def shard(self, batch: dict, rank: int) -> dict:
        """This rank's slice of each row: the SP group's ranks hold the same rows."""
        return shard(batch, self.mesh.sp_rank(rank), self.mesh.sp)


def check(mesh, model_config, ds: dict, cfg, known_head: bool) -> tuple[str, ...]:
    """Refuse, before any process group starts, what Ulysses cannot split or train.py cannot keep right;
    return notes for what is allowed but worth knowing. `known_head`: lm_loss computes this family's loss."""
    if mesh.sp == 1:
        return ()
    sp, kv = mesh.sp, kv_heads(model_config)
    check_split(sp, model_config, cfg.block_size)
    _check_training(sp, model_config, ds, cfg, known_head)
    notes = []
    if sp > kv:
        notes.append(f"sequence parallelism: {sp} ranks share {kv} key-value head(s); each rank holds a copy")
    return tuple(notes)


def kv_heads(model_config) -> int:
    text = model_config.get_text_config()
    return getattr(text, "num_key_value_heads", None) or text.num_attention_heads


def check_split(sp: int, model_config, block_size: int, length: str = "block_size", flag: str = "--block_size") -> None:
    """Ulysses splits heads after its all-to-all and every sequence before it: both must divide. `length`
    names the sequence length in the refusal (the memory estimate says "the sequence length")."""
    heads, kv = model_config.get_text_config().num_attention_heads, kv_heads(model_config)
    if heads % sp:
        raise ConfigError(
            f"sequence_parallel_size = {sp} does not divide the model's {heads} attention heads; use a size that "
            f"divides {heads} (after the all-to-all each rank attends with {heads} / size whole heads)"
        )
    if kv % sp and sp % kv:
        raise ConfigError(
            f"sequence_parallel_size = {sp} and the model's {kv} key-value heads: one must divide the other "
            f"(each rank takes kv_heads / {sp} heads, or copies of one); use a size that divides {kv} or a multiple of it"
        )
    if block_size % sp:
        raise ConfigError(
            f"sequence_parallel_size = {sp} does not divide {length} {block_size}: each rank takes an equal "
            f"slice of every sequence; use {flag} {block_size - block_size % sp or sp}"
        )


def _check_training(sp: int, model_config, ds: dict, cfg, known_head: bool) -> None:
    """What trains wrongly or crashes under Ulysses: the attention kernel, packing, reduce_scatter, the head
    (ZeRO-0 and LoRA are combinations.py's refusals)."""
    attn = cfg.attn_implementation
    if attn not in ATTENTION:
        raise ConfigError(
            f"attn_implementation '{attn}' with sequence_parallel_size = {sp}: Ulysses needs a kernel without an "
            "s x s mask; use --attn_implementation sdpa (or flash_attention_2 on GPUs)"
        )
    if cfg.packing and attn not in KEEP_PACKED_APART and _is_sft(cfg):
        raise ConfigError(
            f"packing with attn_implementation '{attn}' under sequence parallelism: DeepSpeed gives it a plain "
            "causal mask over the whole row, so packed examples would attend to each other; use --attn_implementation "
            "sdpa or flash_attention_2, or --packing false"
        )
    zero = ds.get("zero_optimization") or {}
    if zero_stage(ds) == 3 and zero.get("reduce_scatter") is False:
        raise ConfigError(
            f"sequence_parallel_size = {sp} with ZeRO-3 and reduce_scatter false: DeepSpeed then averages small "
            "gradient buckets over the data-parallel replicas and large parameters over every rank, so the gradient's "
            "scale would differ per parameter; remove reduce_scatter (true is the default)"
        )
    if not known_head:
        raise ConfigError(
            f"sequence_parallel_size = {sp}: under sequence parallelism train.py computes the loss itself, and it "
            f"knows the output head of {', '.join(_known())} but not of '{model_config.model_type}'; remove "
            "sequence_parallel_size"
        )


def _is_sft(cfg) -> bool:
    return cfg.dataset_format != "text"


def _known() -> list[str]:
    return sorted(KNOWN_HEADS)


def register_ulysses(cfg, model_config, mesh):
    """Swap Ulysses into transformers' attention table (before the model is built) and create DeepSpeed's
    SP groups. Collective. Returns the mpu `deepspeed.initialize` takes (parallel_state_sp)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    attn = cfg.attn_implementation
    if attn == "sdpa":  # DeepSpeed wraps whatever the table holds under this name: wrap sdpa first
        packed_attention.install()
    return UlyssesSPAttentionHF.register_with_transformers(
        # DeepSpeed reads `.config` from a model, or loads one by hub id; ours may exist only in memory
        model_name_or_path=SimpleNamespace(config=with_head_dim(model_config)),
        core_attn_implementation=attn,
        sequence_parallel_size=mesh.sp,
        micro_batch_size=cfg.per_device_train_batch_size,
        seq_length_is_variable=True,  # SFT rows vary in length
        disable_in_eval=True,  # eval and the export check run whole rows, no SP (see the module docstring)
    )


def with_head_dim(model_config):
    """The config with `head_dim` set. DeepSpeed 0.19.8's Ulysses reads `config.head_dim` for its query shape,
    and configs whose attention derives it (Mixtral's head_dim is None: hidden_size / heads) made it fail with
    "torch.Size() takes an iterable of 'int'" (measured); the value is the one transformers' attention uses."""
    import copy

    text = model_config.get_text_config()
    if getattr(text, "head_dim", None):
        return model_config
    model_config = copy.deepcopy(model_config)
    text = model_config.get_text_config()
    text.head_dim = text.hidden_size // text.num_attention_heads
    return model_config


def deepspeed_mpu():
    """DeepSpeed's SP groups as the mpu `deepspeed.initialize` takes, reporting no model parallelism.
    parallel_state_sp aliases its model-parallel size to the SP size, so the engine records SP ranks as
    model-parallel shards in every checkpoint (mp_world_size) and ds_to_universal then refuses it ("model-state
    file count 1 does not match pp_degree=1 * tp_degree=2", measured), and a universal load asks for a tensor-
    parallel size parallel_state_sp lacks; but SP shards no weight. Everything else is parallel_state_sp's own; `initialize_sequence_parallel` is what ZeRO checks to know it is SP."""
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as sp_state

    names = [n for n in dir(sp_state) if n.startswith(("get_sequence", "initialize_sequence"))]
    return SimpleNamespace(
        **{n: getattr(sp_state, n) for n in names},
        get_model_parallel_world_size=lambda: 1,
        get_model_parallel_rank=lambda: 0,
        get_tensor_model_parallel_world_size=lambda: 1,  # a universal load asks (base_optimizer.py)
        get_tensor_model_parallel_rank=lambda: 0,
    )


def shard(batch: dict, sp_rank: int, sp: int) -> dict:
    """This rank's slice of every sequence in a batch, cut as DeepSpeed's UlyssesSPDataLoaderAdapter cuts
    it: the targets pre-shifted into `shift_labels` (the target of the slice's last token is the first token
    of the next rank's slice), global position ids (Ulysses gathers them for attention), no attention mask.
    Rows are first padded to a multiple of `sp` with ignored tokens after the end. A packed batch keeps its
    cut points (`gathered_cuts`): not sliced, they describe the whole rows each attention call sees."""
    import torch
    import torch.nn.functional as F

    ids, labels = batch["input_ids"], batch["labels"]
    b, length = ids.shape
    pos = batch.get("position_ids")
    if pos is None:
        pos = torch.arange(length, dtype=ids.dtype).expand(b, length)
    targets = F.pad(labels[:, 1:], (0, 1), value=-100)
    pad = -length % sp
    if pad:
        ids = F.pad(ids, (0, pad), value=0)
        targets = F.pad(targets, (0, pad), value=-100)
        pos = torch.cat([pos, pos[:, -1:] + torch.arange(1, pad + 1, dtype=pos.dtype)], dim=1)
    n = (length + pad) // sp
    cut = slice(sp_rank * n, (sp_rank + 1) * n)
    out = {
        "input_ids": ids[:, cut].contiguous(),
        "position_ids": pos[:, cut].contiguous(),
        "shift_labels": targets[:, cut].contiguous(),
    }
    cuts = batch.get(packed_attention.HOST_CUTS)
    if cuts is not None:
        out.update(packed_attention.varlen_kwargs(gathered_cuts(cuts, length, pad)))
    return out


def gathered_cuts(cuts, length: int, pad: int) -> list[int]:
    """A batch's cut points (offsets into its rows of `length` laid end to end, packing.collate) for the same
    rows `pad` tokens longer, as Ulysses gathers them for attention. The pad tokens continue the positions of
    their row's last segment, so they join it: each offset moves by `pad` per row before it, the total too.
    The same cuts as derived from the gathered position ids, without reading them in every layer."""
    return [c + c // length * pad for c in cuts]
