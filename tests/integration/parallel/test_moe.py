"""Mixtures of experts trained for real on 2 CPU ranks: every ZeRO stage and DeepSpeed AutoEP's expert
parallelism against the shared ZeRO-0 run, the balancing loss in the gradient, resume after a kill, the export.

Every run trains the baseline's global batch: 2 ranks x micro 4, each rank its own rows (the data order
shards by rank), so the two ranks route different tokens to different experts in every step. That is the
case that hangs ZeRO-3 when experts are separate modules; transformers 5 packs a layer's experts into 3-D
parameters, so every rank gathers all of them (moe.py). The balancing loss is on with a coefficient large
enough to move the losses (0.05), so a run that dropped it would fail the parity checks. Those checks, resume,
the export tool and layout changes are the MoE rows of the contract table (tests/contract.py); this file holds
what is particular to experts.
"""

from __future__ import annotations

import json

import pytest

import export_memory
from contract import BY_NAME, MODES, MOE, MOE_COEF, MOE_MODEL, MOE_SHAPE
from helpers import CONFIGS, FAST, export_diff, launch, step_losses
from zero_recipes.config.shipped import EXPERT_PARALLEL, SEQUENCE_PARALLEL

EP2 = EXPERT_PARALLEL[2]
PARITY = 1e-5  # fp32 per-step losses and export logits; measured max 9.5e-7 (losses)
COEF, SHAPE, MIXTRAL = MOE_COEF, MOE_SHAPE, MOE_MODEL

# the other families: Qwen2-MoE (a gated shared expert beside the routed ones) and DeepSeek-V3 (a shared expert,
# sigmoid routing in groups, a dense first layer, no balancing loss in transformers: a routing bias instead)
FAMILIES = {
    "qwen2_moe": {"model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    | {"shared_expert_intermediate_size": 48, **SHAPE},
    "deepseek_v3": {"model_type": "deepseek_v3", "n_routed_experts": 4, "num_experts_per_tok": 2}
    | {"moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1}
    | {"q_lora_rank": None, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16}
    | {**SHAPE, "num_key_value_heads": 4},
}

MOE_ROWS = [m for m in MODES if m.family == "moe"]  # the contract's rows (tests/contract.py)


@pytest.fixture(scope="module")
def moe_zero0(baseline_run):
    return baseline_run(MOE_ROWS[0]).check()


@pytest.mark.parametrize("mode", MOE_ROWS, ids=lambda m: m.name)
def test_the_balancing_loss_is_in_every_step(mode, mode_run):
    aux = [r["aux_loss"] for r in mode_run(mode).check().records if "loss" in r]
    assert len(aux) == 8 and all(a >= 1.0 for a in aux)  # Switch's loss is 1 at perfect balance, more otherwise


def test_the_balancing_loss_is_in_the_first_step_and_moves_every_later_one(moe_zero0, tmp_path):
    """Without it (coefficient 0) step 1's loss is the baseline's less COEF x its aux loss, exactly the term
    transformers adds; from step 2 the language loss itself differs, so the term reached the gradient."""
    args = FAST + ["--deepspeed", *CONFIGS["zero0"], "--model_config", json.dumps(MIXTRAL)]
    run = launch(args + ["--router_aux_loss_coef", "0"], tmp_path / "run", launcher="forked").check()
    got, want = step_losses(run), step_losses(moe_zero0)
    aux = {r["step"]: r["aux_loss"] for r in moe_zero0.records if "loss" in r}
    language_loss = {s: want[s] - COEF * aux[s] for s in want}  # the baseline's loss without the term
    assert got[1] == pytest.approx(language_loss[1], abs=1e-6)
    # Adam's first update is lr x sign(gradient): the term changes few signs, so step 2 is 4e-7 apart
    moved = [abs(got[s] - language_loss[s]) for s in range(3, 9)]
    assert min(moved) > 1e-5 and max(moved) > 1e-3, moved  # the router trained otherwise: the term had a gradient
    assert not any("aux_loss" in r for r in run.records)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_shared_expert_families_under_zero3_and_expert_parallelism_match_zero0(family, tmp_path):
    model = ["--model_config", json.dumps(FAMILIES[family]), "--max_steps", "4"]
    base = launch(FAST + ["--deepspeed", *CONFIGS["zero0"], *model], tmp_path / "zero0", launcher="forked").check()
    fragments = [*CONFIGS["zero3"], EP2]
    run = launch(FAST + ["--deepspeed", *fragments, *model, "--verify_export"], tmp_path / "ep", launcher="forked")
    got, want = step_losses(run.check()), step_losses(base)
    assert max(abs(got[s] - want[s]) for s in range(1, 5)) <= PARITY, (got, want)
    assert export_diff(run) <= PARITY  # the shared experts and the router under their HF names
    assert ("aux_loss" in run.records[0]) == (family == "qwen2_moe")  # DeepSeek-V3 balances by a routing bias


def test_sequence_parallel_splits_each_row_and_keeps_the_balancing_loss_of_the_whole_row(moe_zero0, tmp_path):
    """SP2 on 2 ranks is one replica training the baseline's 8 rows a step as micro 4 x 2, each row split over
    the SP group. train.py's loss adds the balancing loss with the per-expert sums all-reduced over the group
    (moe.BalancingLoss), so it is the whole rows' balancing loss: equal to transformers' own loss of one rank
    fed the same micro-batches. The language loss is the shared baseline's (the aux loss is not additive over
    rows, so it depends on how rows group into micro-batches: the baseline groups them by rank)."""
    batch = ["--gradient_accumulation_steps", "2"]
    args = FAST + ["--deepspeed", *CONFIGS["zero3"], SEQUENCE_PARALLEL[2], *MOE, *batch]
    run = launch(args, tmp_path / "sp", launcher="forked").check()
    assert "loss: computed by train.py" in run.log
    one_rank = launch(FAST + ["--deepspeed", *CONFIGS["zero0"], *MOE, *batch], tmp_path / "one", nproc=1).check()
    for key in ("loss", "aux_loss"):
        got, want = [{r["step"]: r[key] for r in x.records if "loss" in r} for x in (run, one_rank)]
        assert max(abs(got[s] - want[s]) for s in range(1, 9)) <= PARITY, (key, got, want)
    language = [
        {r["step"]: r["loss"] - COEF * r["aux_loss"] for r in x.records if "loss" in r} for x in (run, moe_zero0)
    ]
    assert abs(language[0][1] - language[1][1]) <= PARITY, language  # step 1: the same weights, the same rows


def test_packed_sft_keeps_the_balancing_loss_under_expert_parallelism(tmp_path):
    """Packed chat rows (SFT's path: labels masked, the step normalised by its label tokens across ranks,
    transformers' loss with its aux term): ZeRO-2 + EP2 against ZeRO-0 on the same rows."""
    from helpers import SFT, SFT_ZERO0_BATCH

    args = FAST + [*SFT, "--packing", "true", *SFT_ZERO0_BATCH, *MOE, "--max_steps", "4"]
    base = launch(args + ["--deepspeed", *CONFIGS["zero0"]], tmp_path / "zero0", launcher="forked").check()
    run = launch(args + ["--deepspeed", *CONFIGS["zero2"], EP2], tmp_path / "ep", launcher="forked").check()
    for key in ("loss", "aux_loss"):
        got, want = [{r["step"]: r[key] for r in x.records if "loss" in r} for x in (run, base)]
        assert max(abs(got[s] - want[s]) for s in range(1, 5)) <= PARITY, (key, got, want)
    ev = [[r for r in x.records if "eval_loss" in r][-1] for x in (run, base)]
    assert abs(ev[0]["eval_loss"] - ev[1]["eval_loss"]) <= PARITY


@pytest.fixture(scope="module")
def per_expert_checkpoint(tmp_path_factory):
    """tests/remote_code/per_expert_moe.py saved as a hub checkpoint with its code, and the embedded tokenizer."""
    import importlib.util
    import sys

    from helpers import REPO
    from zero_recipes.config.train_config import TrainConfig
    from zero_recipes.data import builtin_tokenizer_dir

    spec = importlib.util.spec_from_file_location(
        "per_expert_moe", REPO / "tests" / "remote_code" / "per_expert_moe.py"
    )
    code = importlib.util.module_from_spec(spec)
    sys.modules["per_expert_moe"] = code  # transformers copies the module's file beside the weights
    spec.loader.exec_module(code)
    code.PerExpertMoeConfig.register_for_auto_class()
    code.PerExpertMoeForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    __import__("torch").manual_seed(0)
    where = tmp_path_factory.mktemp("per-expert") / "model"
    code.PerExpertMoeForCausalLM(code.PerExpertMoeConfig()).save_pretrained(where)
    return ["--model_name_or_path", str(where), "--trust_remote_code", "true"] + [
        "--tokenizer_name_or_path",
        str(builtin_tokenizer_dir(TrainConfig())),
    ]


def test_experts_kept_as_separate_modules_are_gathered_whole_under_zero3(per_expert_checkpoint, tmp_path):
    """8 experts, top-1, 16 tokens per rank and step, each rank its own rows: in every step some expert gets
    tokens on one rank and none on the other. As separate modules ZeRO-3 gathers it on one rank only. Measured
    without the leaf: "Received data size doesn't match expected size. Is there a distributed collective
    mismatch" (gloo's form of the NCCL hang). train.py finds the block's `experts` ModuleList and makes the
    block a leaf (DeepSpeed's set_z3_leaf_modules): the run completes with ZeRO-0's losses. Parameters below
    DeepSpeed's persistence threshold are never partitioned, so the fragment sets it to 0 (real experts are
    far above its 1e5 elements)."""
    partitioned = tmp_path / "partition-every-parameter.json"
    partitioned.write_text('{"zero_optimization": {"stage3_param_persistence_threshold": 0}}')
    args = FAST + [
        *per_expert_checkpoint,
        "--max_steps",
        "4",
        "--block_size",
        "16",
        "--per_device_train_batch_size",
        "1",
    ]
    base = launch(args + ["--deepspeed", *CONFIGS["zero0"]], tmp_path / "zero0", launcher="forked").check()
    zero3 = ["--deepspeed", *CONFIGS["zero3"], str(partitioned)]
    run = launch(args + zero3, tmp_path / "zero3", launcher="forked", timeout=300).check()
    assert "moe: PerExpertMoeBlock keep experts as separate modules" in run.log
    got, want = step_losses(run), step_losses(base)
    assert max(abs(got[s] - want[s]) for s in range(1, 5)) <= PARITY, (got, want)


def test_the_expert_parallel_export_leaves_the_experts_on_rank_0_alone(mode_run):
    """What each rank allocates while the export gathers every rank's experts (tests/export_memory.py: the CPU
    allocator's own count) under ZeRO-2 + EP2: rank 0 holds the state dict it writes and about a layer's experts
    more while it converts them; rank 1 sends its experts as they are and keeps nothing. Measured before the fix
    (an all-gather per layer, every rank keeping every layer's experts until the export returned): rank 1
    peaked at 835,584 bytes, 1.4x all the experts; for Qwen3-30B-A3B that was about 57 GB on every rank."""
    writer, sender = export_memory.read(mode_run(BY_NAME["moe-zero2+ep2"]).check().output_dir, 2)
    layer = 3 * MIXTRAL["num_local_experts"] * MIXTRAL["intermediate_size"] * MIXTRAL["hidden_size"] * 4  # fp32
    # rank 0 may still count the last gather's receive buffers (one weight: 2 blocks of 2 experts): gloo's worker
    # thread drops its reference to them when it gets to it, once after the profile ended in CI. A kept copy of
    # any layer's experts is 3x that, or 2 layers' worth
    late_free = layer // 3
    assert 0 <= writer["held"] - writer["written"] <= late_free, (writer, late_free)
    assert sender["held"] == sender["written"] == 0, sender
    assert sender["peak"] <= layer // 16, (sender, layer)  # no copy of its experts, let alone everyone's
    assert writer["peak"] <= writer["written"] + 2 * layer, (writer, layer)
