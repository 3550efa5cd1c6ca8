"""Ulysses sequence parallelism without a launcher: the mesh, the batch cut, packed rows kept apart, and
what is refused before any process group starts."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from zero_recipes.config import lora_options
from zero_recipes.config.train_config import ConfigError, TrainConfig
from zero_recipes.data.packing import collate
from zero_recipes.ds import facts as ds_facts, intake as ds_config
from zero_recipes.modeling import packed_attention
from zero_recipes.modeling.model import TINY_LLAMA
from zero_recipes.parallel import combinations, mesh as parallel, sequence_parallel

TINY = AutoConfig.for_model(**TINY_LLAMA)  # 4 heads over 2 key-value heads


def test_sequence_dimension_is_innermost_and_rows_are_shared_within_a_group():
    mesh = parallel.Mesh(8, sp=2)
    assert (mesh.dp, mesh.group) == (4, 2)
    assert [mesh.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]  # as parallel_state_sp groups them
    assert [mesh.sp_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert mesh.describe() == "8 ranks = 4 data-parallel x 2 sequence-parallel"
    assert mesh.eval_shard(5) == (5, 8)  # eval runs whole rows without SP: every rank its own
    assert parallel.picture(mesh).splitlines()[0].split() == ["sp", "0", "sp", "1"]


def test_gradient_divisor_follows_the_zero_stage():
    mesh = parallel.Mesh(4, sp=2)
    assert mesh.gradient_divisor(1) == mesh.gradient_divisor(2) == 2  # summed over SP, averaged over replicas
    assert mesh.gradient_divisor(3) == 4  # ZeRO-3's reduce-scatter averages over every rank
    assert parallel.Mesh(4, tp=2).gradient_divisor(3) == 2


def resolved(world: int, *fragments: str, **fields):
    raw = ds_config.load_fragments(list(fragments))
    return ds_config.resolve(raw, TrainConfig(**fields), set(fields), world, 128)


def test_auto_batch_counts_replicas_and_llamafactory_block_is_read():
    ds = resolved(8, "ds_configs/zero3.json", "ds_configs/sp4.json", per_device_train_batch_size=2).ds
    assert ds["train_batch_size"] == 2 * 1 * 2  # micro x accumulation x (8 ranks / SP 4)
    raw = {"zero_optimization": {"stage": 3}, "sequence_parallel": {"enabled": True, "size": 2, "mode": "ulysses"}}
    r = ds_config.resolve(raw, TrainConfig(), set(), 2, 128)
    assert r.ds["sequence_parallel_size"] == 2 and "sequence_parallel" not in r.ds
    assert any("LLaMA-Factory" in n for n in r.notes)
    with pytest.raises(ConfigError, match="Ulysses only"):
        ds_config.resolve(
            {**raw, "sequence_parallel": {"enabled": True, "size": 2, "mode": "ring"}}, TrainConfig(), set(), 2, 128
        )


def check(world=2, sp=2, fragments=("ds_configs/zero3.json",), config=TINY, **fields):
    ds = {**ds_config.load_fragments(list(fragments)), "sequence_parallel_size": sp}
    cfg = TrainConfig(
        **{"block_size": 128, **fields}
    )  # what plan.RunPlan.from_args asks: the modes' pairs, then the axis
    combinations.refuse(combinations.modes({"sequence": sp}, ds_facts.zero_stage(ds), lora_options.adapter_name(cfg)))
    return sequence_parallel.check(parallel.Mesh(world, sp=sp), config, ds, cfg, known_head=True)


@pytest.mark.parametrize(
    "kwargs,words",
    [
        (dict(world=4, sp=4, config=AutoConfig.for_model(**{**TINY_LLAMA, "num_attention_heads": 6, "num_key_value_heads": 6, "hidden_size": 132})), "does not divide the model's 6 attention heads"),
        (dict(world=8, sp=8, config=AutoConfig.for_model(**{**TINY_LLAMA, "num_attention_heads": 8, "num_key_value_heads": 3, "hidden_size": 128})), "3 key-value heads"),
        (dict(block_size=127), "does not divide block_size 127"),
        (dict(attn_implementation="eager"), "Ulysses needs a kernel without an s x s mask"),
        (dict(attn_implementation="flex_attention", dataset_format="messages"), "packed examples would attend"),
        (dict(fragments=("ds_configs/zero0.json",)), "ZeRO-0"),
        (dict(fragments=("ds_configs/zero3.json",), lora_r=8), "with LoRA"),
    ],
)  # fmt: skip
def test_refused_in_one_line(kwargs, words):
    with pytest.raises(ConfigError, match=words) as e:
        check(**kwargs)
    assert "\n" not in str(e.value)


def test_reduce_scatter_off_is_refused_under_zero3_and_world_must_divide():
    with pytest.raises(ConfigError, match="reduce_scatter false"):
        sequence_parallel.check(
            parallel.Mesh(2, sp=2),
            TINY,
            {"zero_optimization": {"stage": 3, "reduce_scatter": False}, "sequence_parallel_size": 2},
            TrainConfig(),
            True,
        )
    with pytest.raises(ConfigError, match="cannot split into sequence-parallel groups of 4"):
        parallel.Mesh(6, sp=4).check()
    with pytest.raises(ConfigError, match="does not combine AutoTP with Ulysses"):
        parallel.Mesh(4, tp=2, sp=2).check()
    assert check(world=8, sp=8, config=AutoConfig.for_model(**{**TINY_LLAMA, "num_attention_heads": 8})) != ()


def test_shard_cuts_each_row_into_slices_that_add_up_to_the_whole():
    rows = [[([5, 6, 7, 8, 9], [0, 0, 1, 1, 1]), ([10, 11, 12], None)], [([20, 21, 22, 23, 24, 25, 26], None)]]
    batch = collate(rows, pad_id=0)  # 8 tokens wide: row 1 has one pad
    parts = [sequence_parallel.shard(batch, r, 3) for r in range(3)]  # 8 -> padded to 9
    ids = torch.cat([p["input_ids"] for p in parts], dim=1)
    assert ids.shape == (2, 9) and torch.equal(ids[:, :8], batch["input_ids"])
    targets = torch.cat([p["shift_labels"] for p in parts], dim=1)
    expected = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 2), value=-100)
    assert torch.equal(targets, expected)  # the target of a slice's last token sits in the next slice
    pos = torch.cat([p["position_ids"] for p in parts], dim=1)
    assert pos[0, :8].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]  # global, restarting per packed example
    assert "attention_mask" not in parts[0]


class _Nonzero(TorchDispatchMode):
    """Counts aten.nonzero: the per-layer derivation of cut points from position ids (a host sync on a GPU)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += str(func) == "aten.nonzero.default"
        return func(*args, **(kwargs or {}))


def test_shard_keeps_the_cut_points_of_the_whole_rows_ulysses_attends_over():
    """Ulysses gathers the slices of each row back into the whole (padded) row for attention and passes the
    batch's other kwargs through: every rank's shard carries that row's cut points, the ones transformers
    derives from the gathered position ids, so sdpa splits by them without reading the ids in each layer and
    flash-attention runs varlen on them at any micro-batch size."""
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    rows = [
        [([5, 6, 7, 8, 9], [0, 0, 1, 1, 1]), ([10, 11, 12], None)],
        [([20, 21, 22, 23, 24, 25, 26], None)],
        [([30, 31], None), ([32, 33, 34], None)],
    ]
    batch = collate(rows, pad_id=0)  # 8 tokens wide; rows 1 and 2 end in a padding segment
    parts = [sequence_parallel.shard(batch, r, 3) for r in range(3)]  # 8 -> padded to 9
    pos = torch.cat([p["position_ids"] for p in parts], dim=1)  # what Ulysses gathers
    (cu_q, cu_k), (longest_q, _) = prepare_fa_kwargs_from_position_ids(pos)
    for p in parts:  # the same on every rank: they describe the gathered rows, not the slice
        assert p["cu_seq_lens_host"] == (0, 5, 9, 16, 18, 20, 23, 27)  # each row's pad joins its last segment
        assert torch.equal(p["cu_seq_lens_q"], cu_q) and torch.equal(p["cu_seq_lens_k"], cu_k)
        assert p["max_length_q"] == p["max_length_k"] == int(longest_q) == 7
    host_rows = packed_attention.per_row(parts[0]["cu_seq_lens_host"], 3, 9)
    assert host_rows == packed_attention.cuts_from_positions(pos, 3, 9)

    torch.manual_seed(0)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups, module.training = True, 1, True
    q, k, v = (torch.randn(3, 4, 9, 8) for _ in range(3))  # after the all-to-all: whole rows, some heads
    attention = packed_attention.per_example_sdpa(sdpa_attention_forward)
    counted = {}
    for name, kwargs in (
        ("positions", {}),
        ("cuts", {x: parts[0][x] for x in parts[0] if x.startswith(("cu_", "max_"))}),
    ):
        with _Nonzero() as seen:
            counted[name] = (attention(module, q, k, v, None, position_ids=pos, **kwargs)[0], seen.calls)
    assert counted["positions"][1] == 3 and counted["cuts"][1] == 0  # derived per row, or read from the batch
    assert torch.equal(counted["cuts"][0], counted["positions"][0])  # the same slices, the same bits
    unpacked = sequence_parallel.shard(collate([[([1, 2, 3], None)], [([4, 5], None)]], pad_id=0), 0, 3)
    assert not [x for x in unpacked if x.startswith(("cu_", "max_"))]  # nothing to keep apart


def test_per_example_sdpa_keeps_packed_examples_apart_when_ulysses_drops_the_mask():
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 1
    q, k, v = (torch.randn(2, 4, 12, 8) for _ in range(3))
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3], list(range(12))])
    attention = packed_attention.per_example_sdpa(sdpa_attention_forward)
    got, _ = attention(module, q, k, v, None, position_ids=pos)
    for a, e in ((0, 5), (5, 8), (8, 12)):  # row 0: three examples, each as if alone
        alone, _ = sdpa_attention_forward(module, q[:1, :, a:e], k[:1, :, a:e], v[:1, :, a:e], None)
        assert torch.allclose(got[:1, a:e], alone, atol=1e-6)
    whole, _ = sdpa_attention_forward(module, q[1:], k[1:], v[1:], None)  # row 1: one example, plain causal
    assert torch.allclose(got[1:], whole, atol=1e-6)
    mixed, _ = sdpa_attention_forward(module, q[:1], k[:1], v[:1], None)
    assert not torch.allclose(got[:1, 5:8], mixed[:, 5:8], atol=1e-3)  # what plain sdpa would have done
